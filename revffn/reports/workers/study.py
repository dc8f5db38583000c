"""One study run in a fresh process, so its peak memory is its own.

    python -m revffn.reports.workers.study JOB.json [JOB.json ...]

JOB.json (written by `revffn.reports.study`) names the base model (and `model`, a converted directory to
start from instead), the held-out retention text and the knowledge probes, the method (and `method_module`,
the module that registers it, imported first), its YAML section (`options`), task, seed, learning rate,
schedule and torch threads. The worker writes the run's training config next to it, trains through the one
loop (`revffn.training.loop.run`), reloads the exported `final/` model, and prints one JSON line: exact
match on the task's test split (and val split when asked), retention loss, probe accuracy (when the job
names probes), training peak memory, tokens/s and the loss curve. Before training it measures, when asked,
the base's retention loss and probe accuracy (`measure_base`) and those of the method's prepared model at
init (`gap_init`: RevFFN's conversion); a method with a stage boundary (`steady_state_step` > 0) also gets
the retention loss there.

Memory on CPU is the process peak RSS during training minus the RSS right after the imports (as in
`revffn bench`); on CUDA `torch.cuda.max_memory_allocated`. Both peaks restart after the evaluations before
training (`peak_since: training`); rows without the key (before stop 58) include them.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
from pathlib import Path

import peft  # noqa: F401  (imported before the RSS baseline for every method alike)
import torch
import transformers  # noqa: F401
import yaml

from revffn.memory.measure import current_rss_bytes, reset_peak_memory
from revffn.training.evaluate import RETENTION_SET
from revffn.training.watch import read_jsonl

BASE = "builtin:base"


def _base(job: dict) -> str:
    return job.get("base") or BASE


def train_config(job: dict, run_dir: Path) -> dict:
    """The `revffn train` config of a study run (every method shares all keys but its own section)."""
    cfg = {
        "model": job.get("model") or _base(job), "method": job["method"], "data": f"builtin:{job['task']}_train",
        "eval_data": None, "output_dir": str(run_dir), "overwrite": True,
        "max_steps": job["steps"], "per_device_train_batch_size": job["batch"], "learning_rate": job["lr"],
        "lr_scheduler_type": "cosine", "warmup_steps": job["warmup_steps"], "min_lr_ratio": 0.1,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "max_seq_length": job["max_seq_length"], "seed": job["seed"],
        "logging_steps": job["logging_steps"], "dtype": "float32", "device": job.get("device", "auto"),
    }
    if job.get("options"):
        cfg[job["method"]] = dict(job["options"])
    return cfg


def write_config(job: dict, run_dir: Path):
    """The run's config, kept as `RUN.yaml` next to the run (so `revffn train` can repeat it), and the
    method built from it. A method with a stage boundary gets the retention set as eval data,
    evaluated every `steady_state_step()` steps: the first eval is the retention right after stage 1."""
    from revffn.methods import method_class
    from revffn.training.config import load_config

    cls = method_class(job["method"], job.get("method_module"))
    cfg_file = run_dir.parent / f"{run_dir.name}.yaml"
    cfg_file.parent.mkdir(parents=True, exist_ok=True)
    cfg = train_config(job, run_dir)
    cfg_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
    boundary = cls(load_config(str(cfg_file))).steady_state_step()
    if boundary and job.get("retention_limit") is None:
        cfg.update(eval_data=job.get("retention_data") or RETENTION_SET, eval_steps=boundary)
        cfg_file.write_text(yaml.safe_dump(cfg, sort_keys=False))
    loaded = load_config(str(cfg_file))
    return loaded, cls(loaded)


def eval_device(job: dict) -> torch.device:
    """Where the worker measures: the run's device (`device: auto` is CUDA where there is one)."""
    name = job.get("device", "auto")
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)


def forgetting(job: dict, model, tok, prefix: str = "") -> dict:
    """`model`'s loss on the job's held-out retention text and, when it names probes, its probe accuracy
    (containment), as {prefix}retention_loss and {prefix}probe_accuracy."""
    from revffn.data.formats import load_examples
    from revffn.training.evaluate import evaluate, retention_loss

    out = {f"{prefix}retention_loss": retention_loss(model, tok, job.get("retention_data") or RETENTION_SET,
                                                     limit=job.get("retention_limit"))}
    if job.get("probes"):
        probes = load_examples(job["probes"], "probes")[: job.get("probe_limit")]
        out[f"{prefix}probe_accuracy"] = evaluate(model, tok, probes, 128, 32, 24, match="contains")["exact_match"]
    return out


def losses_before_training(job: dict, method) -> dict:
    """Retention loss (and probe accuracy) of the base (`measure_base`) and of `method`'s prepared model at
    init (`gap_init`: converted at prepare, or the study's converted directory `model`)."""
    from revffn.conversion.causal_lm import CausalLM
    from revffn.data.tokenizer import load_tokenizer
    from revffn.models.loading import load, load_hf, resolve_model_ref

    base = _base(job)
    tok = load_tokenizer(resolve_model_ref(base))
    out = {}
    device = eval_device(job)
    if job.get("measure_base"):
        out.update(forgetting(job, CausalLM(load_hf(base)).to(device).eval(), tok, "base_"))
    if job.get("gap_init"):
        model = load(job["model"], device) if job.get("model") else method.prepare(load_hf(base)).to(device)
        out.update(forgetting(job, model.eval(), tok, "converted_"))
    return out


def run_job(job: dict, baseline: int) -> dict:
    from revffn.data.formats import load_examples
    from revffn.data.tokenizer import load_tokenizer
    from revffn.models.loading import load
    from revffn.training.evaluate import evaluate
    from revffn.training.loop import run

    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    run_dir = Path(job["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg, method = write_config(job, run_dir)
    result = {"name": job["name"], **losses_before_training(job, method)}
    gc.collect()  # the models evaluated before training are gone; the peak is training's from here
    result["peak_since"] = "training" if reset_peak_memory(eval_device(job)) else "start"
    summary = run(cfg)
    records = read_jsonl(run_dir / "metrics.jsonl")
    boundary = method.steady_state_step()
    after_stage1 = [r["eval_loss"] for r in records if boundary and r["step"] == boundary and "eval_loss" in r]
    result.update(
        curve=[[r["step"], r["loss"]] for r in records],
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in records[1:] or records),
        peak_mem_bytes=max(r["peak_mem_bytes"] for r in records) - (baseline if torch.device(
            summary["device"]).type == "cpu" else 0),
        stage1_retention_loss=after_stage1[0] if after_stage1 else None,
    )
    model = load(summary["final_dir"], summary["device"])
    tok = load_tokenizer(summary["final_dir"])
    result.update(forgetting(job, model, tok))
    for split in ("val", "test") if job.get("eval_val") else ("test",):
        examples = load_examples(f"builtin:{job['task']}_{split}", split)[: job["eval_limit"]]
        ev = evaluate(model, tok, examples, job["max_seq_length"], 32, job["max_new_tokens"], job["eval_limit"])
        result[f"{split}_exact_match"] = ev["exact_match"]
        result[f"{split}_loss"] = ev["loss"]
        result[f"{split}_samples"] = ev["samples"][:2]
    return result


def main(job_files: list[str]) -> None:
    """Run each job in turn; one JSON line per finished job (a failing job prints nothing)."""
    transformers.utils.logging.disable_progress_bar()
    baseline = current_rss_bytes()
    for job_file in job_files:
        job = json.loads(Path(job_file).read_text())
        try:
            print(json.dumps(run_job(job, baseline)), flush=True)
        except Exception as e:  # reported as this job's error row; the other jobs still run
            print(f"study job {job['name']} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            if len(job_files) == 1:
                raise


if __name__ == "__main__":
    main(sys.argv[1:])

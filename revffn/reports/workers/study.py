"""One study run in a fresh process, so its peak memory is its own.

    python -m revffn.reports.workers.study JOB.json [JOB.json ...]

JOB.json (written by `revffn.reports.study`) names the method, task, seed, learning rate and
schedule. The worker writes the run's training config next to it, trains through the one loop
(`revffn.training.loop.run`), reloads the exported `final/` model, and prints one JSON line:
exact match on the task's test split (and val split when asked), retention loss, training peak
memory, tokens/s and the loss curve. Before training it measures, when asked, the base's retention
loss (`measure_base`) and that of the freshly converted RevFFN model (`gap_init`).

Memory on CPU is the process peak RSS during training minus the RSS right after the imports (as in
`revffn bench`); on CUDA `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import peft  # noqa: F401  (imported before the RSS baseline for every method alike)
import torch
import transformers  # noqa: F401
import yaml

from revffn.memory.measure import current_rss_bytes

BASE = "builtin:base"


def train_config(job: dict, run_dir: Path) -> dict:
    """The `revffn train` config of a study run (every method shares all keys but its own section)."""
    cfg = {
        "model": BASE, "method": job["method"], "data": f"builtin:{job['task']}_train",
        "eval_data": None, "output_dir": str(run_dir), "overwrite": True,
        "max_steps": job["steps"], "per_device_train_batch_size": job["batch"], "learning_rate": job["lr"],
        "lr_scheduler_type": "cosine", "warmup_steps": job["warmup_steps"], "min_lr_ratio": 0.1,
        "weight_decay": 0.0, "max_grad_norm": 1.0, "max_seq_length": job["max_seq_length"], "seed": job["seed"],
        "logging_steps": job["logging_steps"], "dtype": "float32", "device": job.get("device", "auto"),
    }
    if job["method"] == "revffn":
        cfg["revffn"] = dict(job.get("revffn", {}))
        # Retention loss right after stage 1 comes from the loop's periodic eval at the stage boundary.
        if job.get("retention_limit") is None and cfg["revffn"].get("adapter_warmup_steps"):
            cfg["eval_data"] = "builtin:retention_test"
            cfg["eval_steps"] = cfg["revffn"]["adapter_warmup_steps"]
    return cfg


def losses_before_training(job: dict) -> dict:
    """Retention loss of the base (`measure_base`) and of the converted model at init (`gap_init`)."""
    from revffn.data.tokenizer import load_tokenizer
    from revffn.models.causal_lm import CausalLM
    from revffn.models.convert import convert
    from revffn.models.loading import load_hf, resolve_model_ref
    from revffn.training.evaluate import retention_loss

    tok = load_tokenizer(resolve_model_ref(BASE))
    limit = job.get("retention_limit")
    out = {}
    if job.get("measure_base"):
        out["base_retention_loss"] = retention_loss(CausalLM(load_hf(BASE)).eval(), tok, limit=limit)
    if job.get("gap_init"):
        init = job.get("revffn", {}).get("adapter_init", "coordinate")
        out["converted_retention_loss"] = retention_loss(convert(load_hf(BASE), adapter_init=init).eval(), tok,
                                                         limit=limit)
    return out


def run_job(job: dict, baseline: int) -> dict:
    if job["method"] in os.environ.get("REVFFN_STUDY_FAULT", "").split(","):  # test hook: this method fails
        raise RuntimeError(f"injected fault in {job['method']}")
    from revffn.data.formats import load_examples
    from revffn.data.tokenizer import load_tokenizer
    from revffn.models.loading import load
    from revffn.training.config import load_config
    from revffn.training.evaluate import evaluate, retention_loss
    from revffn.training.loop import run

    run_dir = Path(job["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    result = {"name": job["name"]}
    result.update(losses_before_training(job))
    cfg_file = run_dir.parent / f"{run_dir.name}.yaml"
    cfg_file.write_text(yaml.safe_dump(train_config(job, run_dir), sort_keys=False))
    summary = run(load_config(str(cfg_file)))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    warm = job.get("revffn", {}).get("adapter_warmup_steps", 0) if job["method"] == "revffn" else 0
    after_stage1 = [r["eval_loss"] for r in records if r["step"] == warm and "eval_loss" in r]
    result.update(
        curve=[[r["step"], r["loss"]] for r in records],
        tokens_per_s=statistics.median(r["tokens_per_s"] for r in records[1:] or records),
        peak_mem_bytes=max(r["peak_mem_bytes"] for r in records) - (baseline if torch.device(
            summary["device"]).type == "cpu" else 0),
        stage1_retention_loss=after_stage1[0] if after_stage1 else None,
    )
    model = load(summary["final_dir"])
    tok = load_tokenizer(summary["final_dir"])
    result["retention_loss"] = retention_loss(model, tok, limit=job.get("retention_limit"))
    for split in ("val", "test") if job.get("eval_val") else ("test",):
        examples = load_examples(f"builtin:{job['task']}_{split}", split)[: job["eval_limit"]]
        ev = evaluate(model, tok, examples, job["max_seq_length"], 32, job["max_new_tokens"], job["eval_limit"])
        result[f"{split}_exact_match"] = ev["exact_match"]
        result[f"{split}_loss"] = ev["loss"]
        result[f"{split}_samples"] = ev["samples"][:2]
    return result


def main(job_files: list[str]) -> None:
    """Run each job in turn; one JSON line per finished job (a failing job prints nothing)."""
    torch.set_num_threads(int(os.environ.get("REVFFN_STUDY_THREADS", torch.get_num_threads())))
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

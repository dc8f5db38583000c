"""Everything checked before a model is built: output dir, resume target, tokenizer, data.

`prepare_run(cfg)` raises `UserError` for bad input and writes nothing; the loop only starts
allocating once it returns.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from revffn.errors import UserError
from revffn.methods import method_class
from revffn.models.loading import check_model_ref, is_converted
from revffn.models.presets import TINY_PRESETS
from revffn.training.checkpoint import is_sharded_checkpoint, latest_checkpoint, read_trainer_state
from revffn.training.optim import check_optimizer
from revffn.training.parallel import launched_world, pick_distributed
from revffn.training.trackers import check_trackers

RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "final", "report.md", "loss.png", "memory.png",
             "events.jsonl", "tensorboard", "heartbeat.json")


@dataclass
class RunPlan:
    run_dir: Path
    resume_from: Path | None
    device: torch.device
    weights_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    tokenizer: object
    train_set: object
    eval_set: object | None
    distributed: str = "none"  # "none" | "ddp" | "fsdp" (`parallel.pick_distributed`)


def _holds_run(run_dir: Path) -> bool:
    return run_dir.is_dir() and any((run_dir / f).exists() for f in RUN_FILES)


def resolve_resume(cfg, run_dir: Path) -> Path | None:
    """The checkpoint to resume from, or None; refuses a resume that changed model or method."""
    if cfg.resume is False:
        return None
    if cfg.resume is True:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise UserError(f"resume=true but {run_dir}/checkpoints holds no complete checkpoint. Fix: set "
                            "resume=false (with overwrite=true to replace the run), or save_steps > 0 next time.")
    else:
        ckpt = Path(cfg.resume)
        if not ckpt.is_dir():
            raise UserError(f"resume: checkpoint {cfg.resume!r} not found. Fix: give a checkpoints/step-N "
                            "directory, or resume=true for the latest one in output_dir.")
    state = read_trainer_state(ckpt)
    for key in ("model", "method"):
        if state.get(key) != getattr(cfg, key):
            raise UserError(f"resume: the checkpoint was trained with {key}={state.get(key)!r}, but the config "
                            f"says {key}={getattr(cfg, key)!r}. Fix: resume with the same {key}, or start a new "
                            "run in another output_dir.")
    return ckpt


def check_output_dir(cfg, run_dir: Path, resume_from: Path | None) -> None:
    """The run directory can be created (no file in its place or on its path) and holds no other run."""
    blocker = next((p for p in (run_dir, *run_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise UserError(f"output_dir: {str(run_dir)!r} cannot be a directory: {str(blocker)!r} is a file. Fix: "
                        "choose another output_dir.")
    if resume_from is None and _holds_run(run_dir) and not cfg.overwrite:
        raise UserError(f"output_dir: {str(run_dir)!r} already holds a run. Nothing was touched. Fix: set "
                        "resume=true to continue it, overwrite=true to replace it, or choose another output_dir.")


def clear_run(run_dir: Path, keep_events: bool = False) -> None:
    """overwrite=true: remove a previous run's files (only ours); a restart keeps its event log."""
    for name in RUN_FILES:
        if keep_events and name == "events.jsonl":
            continue
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def resolve_launch(cfg):
    """The config as this launch runs it. `global_batch_size` sets gradient_accumulation_steps for the
    number of processes; a job torchrun restarted (`--max-restarts`, TORCHELASTIC_RESTART_COUNT > 0)
    resumes from the last complete checkpoint, or starts over where there is none, as an in-process
    restart does (`max_restarts`)."""
    from revffn.training.config import TrainConfig

    values, world = dict(cfg.values), launched_world()
    if cfg.global_batch_size is not None:
        per_step = cfg.per_device_train_batch_size * world
        if cfg.gradient_accumulation_steps != 1:
            raise UserError(f"global_batch_size: {cfg.global_batch_size} and gradient_accumulation_steps: "
                            f"{cfg.gradient_accumulation_steps} both set the batch. Fix: keep one of them.")
        if cfg.global_batch_size % per_step:
            raise UserError(f"global_batch_size: {cfg.global_batch_size} is not a multiple of "
                            f"per_device_train_batch_size {cfg.per_device_train_batch_size} x {world} processes = "
                            f"{per_step}. Fix: a global_batch_size that is a multiple of {per_step}, another "
                            "per_device_train_batch_size, or a number of processes that divides it.")
        values["gradient_accumulation_steps"] = cfg.global_batch_size // per_step
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) and cfg.resume is False:
        ckpt = latest_checkpoint(Path(cfg.output_dir))
        values.update(resume=bool(ckpt), overwrite=cfg.overwrite or not ckpt)
    return cfg if values == cfg.values else TrainConfig(values, cfg.sections, cfg.source)


def pick_device(cfg) -> tuple[torch.device, torch.dtype, torch.dtype | None]:
    """(device, weights dtype, autocast dtype): bf16 on CUDA, fp32 on CPU unless dtype says otherwise.
    Under torchrun, CUDA is the rank's own device, `LOCAL_RANK`."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda requested but no CUDA device is available. Fix: device=auto or device=cpu.")
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    local = os.environ.get("LOCAL_RANK")
    device = torch.device("cpu") if not cuda else torch.device("cuda", int(local)) if local else torch.device("cuda")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda else "float32")
    weights = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    autocast = torch.bfloat16 if (cuda and dtype == "bfloat16") else None
    return device, weights, autocast


def check_converted(cfg) -> None:
    """A converted model directory (`revffn convert`) trains only with a method that accepts it as it is."""
    from revffn.methods import METHODS, method_class

    if is_converted(cfg.model) and not method_class(cfg.method).ACCEPTS_CONVERTED:
        ok = ", ".join(n for n, m in METHODS.items() if m.ACCEPTS_CONVERTED)
        raise UserError(f"model: {cfg.model!r} holds a model already converted to RevFFN; method {cfg.method!r} "
                        f"trains unconverted HF models. Fix: method={ok}, or point model at the unconverted base.")


def prepare_run(cfg) -> RunPlan:
    """Validate everything that can be validated without a model. Writes nothing."""
    from revffn.data.collate import tokenize_dataset
    from revffn.data.formats import load_examples
    from revffn.data.tokenizer import model_tokenizer

    check_model_ref(cfg.model)
    check_converted(cfg)
    run_dir = Path(cfg.output_dir)
    resume_from = resolve_resume(cfg, run_dir)
    check_output_dir(cfg, run_dir, resume_from)
    distributed = pick_distributed(cfg)
    if distributed == "fsdp" and resume_from is not None and not is_sharded_checkpoint(resume_from):
        raise UserError(f"resume: {str(resume_from)!r} holds the whole model of a run without FSDP; distributed: fsdp "
                        "resumes the sharded checkpoints FSDP writes. Fix: resume it with distributed=ddp or none.")
    check_trackers(cfg)
    device, weights, autocast = pick_device(cfg)
    check_optimizer(cfg, device, weights, method_class(cfg.method))
    tokenizer = model_tokenizer(cfg.model, cfg.tokenizer)
    train_set = tokenize_dataset(load_examples(cfg.data, "data"), tokenizer, cfg.max_seq_length, cfg.packing, "data")
    step_rows = cfg.per_device_train_batch_size * launched_world() * cfg.gradient_accumulation_steps
    if step_rows > len(train_set.items):
        raise UserError(f"per_device_train_batch_size {cfg.per_device_train_batch_size} x {launched_world()} "
                        f"processes x gradient_accumulation_steps {cfg.gradient_accumulation_steps} = {step_rows} rows "
                        f"a step, but data holds {len(train_set.items)}: every step would repeat examples. Fix: a "
                        "smaller batch (or global_batch_size), or more data.")
    eval_set = None
    if cfg.eval_data:
        eval_set = tokenize_dataset(load_examples(cfg.eval_data, "eval_data"), tokenizer, cfg.max_seq_length, False,
                                    "eval_data")
    return RunPlan(run_dir, resume_from, device, weights, autocast, tokenizer, train_set, eval_set, distributed)


def model_overrides(cfg, tokenizer) -> dict:
    """`model_config` overrides; presets are built with the tokenizer's vocabulary."""
    extra = {"vocab_size": len(tokenizer)} if cfg.model in TINY_PRESETS else {}
    return {**extra, **cfg.model_config}


def saved_config_text(cfg) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

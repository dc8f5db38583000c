"""Everything checked before a model is built: output dir, resume target, tokenizer, data.

`prepare_run(cfg)` raises `UserError` for bad input and writes nothing; the loop only starts
allocating once it returns.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import yaml

from revffn.data.collate import data_shard
from revffn.errors import UserError
from revffn.methods import method_class
from revffn.models.loading import check_model_ref, is_converted, resolve_model_ref
from revffn.models.presets import TINY_PRESETS
from revffn.training.checkpoint import latest_checkpoint, read_trainer_state
from revffn.training.optim import check_optimizer

RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "final", "report.md", "loss.png", "memory.png",
             "events.jsonl")


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
    distributed: str = "none"  # "none" | "ddp" (`pick_distributed`)


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


DIST_TIMEOUT = timedelta(minutes=10)  # a collective waiting longer (a rank died or hangs) raises instead


def pick_distributed(cfg) -> str:
    """"none" or "ddp": the `distributed` key, `auto` read from torchrun's environment. Refuses what DDP
    cannot run exactly: a method that changes what trains or where its optimizer state lives per step
    (`Method.DDP_OK`), parameters stepped in backward (the hooks would step before the all-reduce),
    and restarts inside the process (torchrun restarts the ranks: `torchrun --max-restarts`)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if cfg.distributed == "ddp" and not launched:
        raise UserError("distributed: ddp needs the processes torchrun starts (no RANK/WORLD_SIZE in the "
                        "environment). Fix: torchrun --nproc-per-node N $(which revffn) train CONFIG "
                        "distributed=ddp, or distributed=none for one process.")
    if cfg.distributed == "none" and world > 1:
        raise UserError(f"distributed: none, but torchrun started {world} processes, which would each train and "
                        "write the same run. Fix: distributed=ddp (or auto), or --nproc-per-node 1.")
    mode = "ddp" if cfg.distributed == "ddp" or (cfg.distributed == "auto" and world > 1) else "none"
    if mode == "ddp":
        method = method_class(cfg.method)
        if not method.DDP_OK:
            raise UserError(f"distributed: ddp cannot train method {cfg.method!r}: it changes the trained group and "
                            "moves optimizer state every step. Fix: train it in one process (distributed=none, "
                            "no torchrun), or choose another method.")
        if cfg.optimizer_in_backward:
            raise UserError("optimizer_in_backward: true steps each parameter in backward, before DDP all-reduces "
                            "its gradient. Fix: optimizer_in_backward=false, or train in one process.")
        if cfg.max_restarts:
            raise UserError(f"max_restarts: {cfg.max_restarts} restarts the job inside one process; under torchrun "
                            "the ranks restart together instead. Fix: max_restarts=0 and torchrun --max-restarts "
                            "N with resume=true.")
    return mode


def init_distributed(plan) -> None:
    """Join torchrun's process group (once per process): NCCL on CUDA, gloo on CPU, with a finite
    timeout so a hung collective ends in an error."""
    dist = torch.distributed
    if plan.distributed == "none" or dist.is_initialized():
        return
    if plan.device.type == "cuda":
        torch.cuda.set_device(plan.device)
    dist.init_process_group("nccl" if plan.device.type == "cuda" else "gloo", timeout=DIST_TIMEOUT)


def is_main_process() -> bool:
    """Rank 0, or the only process: the one that writes the run's files and shows the bar."""
    return data_shard()[0] == 0


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


def tokenizer_ref(cfg) -> str | None:
    if cfg.tokenizer:
        return cfg.tokenizer
    return None if cfg.model in TINY_PRESETS else resolve_model_ref(cfg.model)


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
    from revffn.data.tokenizer import load_tokenizer

    check_model_ref(cfg.model)
    check_converted(cfg)
    run_dir = Path(cfg.output_dir)
    resume_from = resolve_resume(cfg, run_dir)
    check_output_dir(cfg, run_dir, resume_from)
    distributed = pick_distributed(cfg)
    device, weights, autocast = pick_device(cfg)
    check_optimizer(cfg, device, weights, method_class(cfg.method))
    tokenizer = load_tokenizer(tokenizer_ref(cfg))
    train_set = tokenize_dataset(load_examples(cfg.data, "data"), tokenizer, cfg.max_seq_length, cfg.packing, "data")
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

"""Calibrate a converted model from a data source: what `revffn.adapter_init: calibrated` and
`revffn convert` run (the maths is in `conversion.calibrate`; the heal is the revffn method's stage 1,
`conversion.heal`, run by the training loop's step).

A source is `self` (text sampled from the unconverted model: no data), a data file or a `builtin:`
set. Task data alone is a measured failure (docs/conversion.md: fitted or healed on `commas_train`
the converted base loses more than with no calibration), so a source that is the run's training
data, or that holds conversations rather than plain text, gets a warning.
"""

from __future__ import annotations

import sys
import time

import torch

from revffn.conversion.calibrate import calibrate
from revffn.data import DEFAULT_CALIBRATION
from revffn.data.calibration import SELF, calibration_rows, is_task_data, row_batches
from revffn.data.collate import data_shard
from revffn.data.formats import load_examples
from revffn.data.tokenizer import model_tokenizer
from revffn.memory.measure import peak_rss_bytes
from revffn.progress import progress


def log_line(line: str) -> None:
    print(f"revffn: {line}", file=sys.stderr, flush=True)


def check_source(source: str, key: str, training_data: tuple[str | None, ...] = (), log=log_line) -> None:
    """Warn when `source` is the training data or task-shaped (conversations) rather than general text."""
    if source == SELF:
        return
    if source in [d for d in training_data if d]:
        log(f"warning: {key}={source!r} is this run's task data. Adapters fitted to a narrow task lose more of "
            f"the base than no calibration (docs/conversion.md). Fix: "
            f"{key}={DEFAULT_CALIBRATION} or other general text.")
    elif is_task_data(load_examples(source, key)):
        log(f"warning: {key}={source!r} holds task examples (conversations), not general text: fitted to them the "
            f"adapters lose more of the base (docs/conversion.md). Fix: "
            f"{key}={DEFAULT_CALIBRATION} or plain-text documents.")


def calibrate_model(model, tokenizer, source: str, n_tokens: int, key: str = "revffn.calibration_data",
                    seed: int = 0, log=log_line, budget_key: str = "revffn.calibration_tokens") -> dict:
    """Fit `model`'s adapters (ridge, layer by layer) on `n_tokens` of `source`; returns the fit report
    with the data's wall time (sampling for `self`) and the process's peak RSS. Under a process group (torchrun)
    the job calibrates once: each process passes over its share of the rows and the fits' sums are all-reduced
    (`calibrate(reduce=...)`), so every process holds the adapters of all rows at 1/N of the passes' work."""
    t0 = time.perf_counter()
    rows = calibration_rows(source, tokenizer, model, n_tokens, key, seed, budget_key=budget_key)
    device = next(model.parameters()).device
    data_s = time.perf_counter() - t0
    rank, world = data_shard()
    share = f"; this process fits rows {rank}::{world}, the sums all-reduced" if world > 1 else ""
    log(f"calibrating the adapters on {rows.numel()} tokens of {source} ({rows.shape[0]} rows{share})")
    reduce = (lambda t: torch.distributed.all_reduce(t)) if world > 1 else None
    with progress("calibrate", "pass") as bar:
        report = calibrate(model, row_batches(rows[rank::world].to(device)), log=None, progress=bar,
                           reduce=reduce)
    worst = max(report["residuals"].items(), key=lambda kv: kv[1])
    log(f"calibrated in {report['wall_s']:.1f} s (+{data_s:.1f} s for the data); worst relative residual "
        f"{worst[1]:.3f} ({worst[0]})")
    return {**report, "data": source, "tokens": int(rows.numel()), "data_wall_s": round(data_s, 2),
            "peak_rss_bytes": peak_rss_bytes()}


def calibrate_for_run(model, cfg, opts: dict) -> dict:
    """`revffn.adapter_init: calibrated` in a training run: warn about task data, calibrate on the run's device."""
    key = "revffn.calibration_data"
    check_source(opts["calibration_data"], key, (cfg.data, cfg.eval_data))
    device = torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")
    if next(model.parameters()).device.type != device.type:  # (`.to` would reshard a gathered FSDP2 root)
        model.to(device)
    tokenizer = model_tokenizer(cfg.model, cfg.tokenizer)
    return calibrate_model(model, tokenizer, opts["calibration_data"], opts["calibration_tokens"], key, cfg.seed)

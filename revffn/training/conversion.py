"""`revffn convert`: convert a pretrained model to RevFFN once, calibrated and (optionally) healed,
and write it with its conversion-gap figures; `revffn train model=DIR method=revffn` then starts
from it without converting again, so one heal serves many tasks.

    revffn convert builtin:base --out runs/base-rev --heal-steps 400
    revffn train model=runs/base-rev output_dir=runs/qs

Everything is checked before the model is loaded (bad input: exit 2, nothing written), and DIR is
written aside and renamed into place. DIR holds the converted model as transformers loads it with
remote code (`models.hf_remote`: config.json, the base HF config with `auto_map`, `model.safetensors`, the
two modeling files), the tokenizer and `revffn.json` (`format: revffn`, the calibration and heal reports, and
the loss on the eval set of the base, of the plain `coordinate` conversion, after calibration and
after the heal). The eval set defaults to `builtin:retention_test` for `builtin:base` (its held-out
pretraining text); other models report no gap unless `eval_data` is given.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from revffn.data.calibration import SELF, file_rows
from revffn.data.formats import load_examples
from revffn.data.tokenizer import model_tokenizer
from revffn.errors import UserError
from revffn.methods.base import write_manifest
from revffn.methods.conversion import (
    calibrate_model,
    check_source,
    heal_model,
    log_line,
    peak_rss_bytes,
)
from revffn.models.causal_lm import CausalLM
from revffn.models.convert import STREAM_WIDTHS, convert
from revffn.models.generation import save_generation_config
from revffn.models.hf_remote import save_converted
from revffn.models.loading import check_model_ref, is_converted, load_hf, parse_dtype
from revffn.models.presets import TINY_PRESETS
from revffn.training.evaluate import RETENTION_SET, retention_loss


@dataclass
class ConvertSpec:
    """What `revffn convert` does (its flags)."""

    model: str
    out: str
    calibration_data: str = SELF
    calibration_tokens: int = 32768
    heal_steps: int = 0
    heal_data: str = SELF
    heal_batch_size: int = 8
    heal_lr: float = 1e-3
    heal_norms: bool = False
    heal_hidden_coef: float = 0.0
    adapter_skip: bool = True
    stream_width: str = "half"
    eval_data: str | None = None
    stream_dtype: str = "float32"
    seed: int = 0
    overwrite: bool = False


def validate(spec: ConvertSpec):
    """Every check that needs no model; returns the tokenizer. Raises UserError naming the flag."""
    check_model_ref(spec.model, "MODEL")
    if is_converted(spec.model, "MODEL"):
        raise UserError(f"MODEL: {spec.model!r} is already converted to RevFFN. Fix: give the unconverted base model.")
    parse_dtype(spec.stream_dtype, "--stream-dtype")
    if spec.stream_width not in STREAM_WIDTHS:
        raise UserError(f"--stream-width: unknown width {spec.stream_width!r}. Fix: one of {', '.join(STREAM_WIDTHS)}.")
    if spec.heal_hidden_coef < 0:
        raise UserError(f"--heal-hidden-coef: {spec.heal_hidden_coef} is negative. Fix: give 0 (off) or a "
                        "positive weight.")
    out = Path(spec.out)
    if out.exists() and any(out.iterdir()) and not spec.overwrite:
        raise UserError(f"--out: {spec.out!r} exists and is not empty. Nothing was written. Fix: choose a new "
                        "directory, or --overwrite to replace it.")
    if out.exists() and not out.is_dir():
        raise UserError(f"--out: {spec.out!r} is a file. Fix: give a directory path.")
    tokenizer = model_tokenizer(spec.model)  # (a Hub ID: its tokenizer files only, not the weights yet)
    if spec.calibration_data != SELF:
        file_rows(spec.calibration_data, tokenizer, spec.calibration_tokens, "--calibration-data",
                  budget_key="--calibration-tokens")
    if spec.heal_steps and spec.heal_data != SELF:
        file_rows(spec.heal_data, tokenizer, None, "--heal-data")
    if spec.eval_data:
        load_examples(spec.eval_data, "--eval-data")
    check_source(spec.calibration_data, "--calibration-data")
    if spec.heal_steps:
        check_source(spec.heal_data, "--heal-data")
    return tokenizer


def eval_set(spec: ConvertSpec) -> str | None:
    return spec.eval_data or (RETENTION_SET if spec.model == "builtin:base" else None)


def run_convert(spec: ConvertSpec, log=log_line) -> dict:
    """Convert, calibrate, heal, measure and write `spec.out`; returns the manifest written."""
    tokenizer = validate(spec)
    t0 = time.perf_counter()
    torch.manual_seed(spec.seed)
    data = eval_set(spec)
    hf = load_hf(spec.model, seed=spec.seed, **({"vocab_size": len(tokenizer)} if spec.model in TINY_PRESETS else {}))
    gap: dict = {"data": data}
    if data:
        gap["base"] = retention_loss(CausalLM(hf).eval(), tokenizer, data)
    model = convert(hf, adapter_init="calibrated", stream_dtype=parse_dtype(spec.stream_dtype),
                    adapter_skip=spec.adapter_skip, stream_width=spec.stream_width).eval()
    if data:
        gap["coordinate"] = retention_loss(model, tokenizer, data)
    calibration = calibrate_model(model, tokenizer, spec.calibration_data, spec.calibration_tokens,
                                  "--calibration-data", spec.seed, log, "--calibration-tokens")
    if data:
        gap["calibrated"] = retention_loss(model, tokenizer, data)
    heal = None
    if spec.heal_steps:
        heal = heal_model(model, tokenizer, spec.heal_data, spec.heal_steps, spec.heal_batch_size, spec.heal_lr,
                          spec.heal_norms, "--heal-data", spec.seed, log, hidden_coef=spec.heal_hidden_coef)
        if data:
            gap["healed"] = retention_loss(model, tokenizer, data)
    if data:
        log("loss on " + data + ": " + ", ".join(f"{k} {v:.4f}" for k, v in gap.items() if k != "data"))
    manifest = {"format": "revffn", "method": "revffn", "adapter_init": "calibrated",
                "stream_dtype": spec.stream_dtype, "converted_from": spec.model, "convert": asdict(spec),
                "conversion_gap": gap, "calibration": calibration, "heal": heal,
                "wall_s": round(time.perf_counter() - t0, 2), "peak_rss_bytes": peak_rss_bytes()}
    _write(model, tokenizer, Path(spec.out), manifest)
    return manifest


def _write(model, tokenizer, out: Path, manifest: dict) -> None:
    """The model directory, written aside and renamed into place (`models.cache.staged_dir`)."""
    from revffn.models.cache import staged_dir

    with staged_dir(out) as tmp:
        save_converted(model, tmp)
        tokenizer.save_pretrained(tmp)
        save_generation_config(tmp, tokenizer)
        write_manifest(tmp, **manifest)

"""Load an HF model from a tiny preset name or a local directory. Never downloads."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from revffn.errors import UserError, closest
from revffn.models.presets import TINY_PRESETS, tiny_model

# Models shipped inside the package, usable wherever a model directory is accepted.
SHIPPED_MODELS = {"builtin:base": Path(__file__).resolve().parent.parent / "assets" / "base"}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str, key: str = "dtype") -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"{key}: unknown dtype {name!r}. Fix: use float32 or bfloat16 "
                        "(float16 is not supported: its range overflows in MoE training; use bfloat16).")
    return DTYPES[name]


def resolve_model_ref(model: str) -> str:
    """`builtin:base` -> the shipped base model's directory; any other reference unchanged."""
    return str(SHIPPED_MODELS[model]) if model in SHIPPED_MODELS else model


def check_model_ref(model: str, key: str = "model") -> None:
    """Raise a UserError unless `model` is a preset, a shipped model or a local HF directory with config.json."""
    if model in TINY_PRESETS:
        return
    if model.startswith("builtin:") and model not in SHIPPED_MODELS:
        raise UserError(f"{key}: unknown shipped model {model!r}. Fix: use {', '.join(SHIPPED_MODELS)}, a preset "
                        f"({', '.join(TINY_PRESETS)}) or a local HF model directory.")
    model = resolve_model_ref(model)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{key}: {model!r} has no config.json. Fix: point {key} at a directory written by "
                            "save_pretrained (it holds config.json and *.safetensors).")
        return
    if model.startswith("tiny-") or "/" not in model:
        raise UserError(f"{key}: unknown model preset {model!r}.{closest(model, TINY_PRESETS)} "
                        f"Presets: {', '.join(TINY_PRESETS)}; or give a local HF model directory.")
    raise UserError(f"{key}: {model!r} is not a local directory. revffn never downloads: "
                    f"Fix: download the model yourself and give its local path, or use a preset "
                    f"({', '.join(TINY_PRESETS)}).")


def load_hf(model: str, dtype: torch.dtype = torch.float32, seed: int = 0, **config_overrides):
    """An HF causal LM from a preset name or a local directory (offline only)."""
    check_model_ref(model)
    if model in TINY_PRESETS:
        return tiny_model(model, seed=seed, dtype=dtype, **config_overrides)
    model = resolve_model_ref(model)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model, local_files_only=True, **config_overrides)
    return AutoModelForCausalLM.from_pretrained(model, config=config, local_files_only=True, dtype=dtype)

"""The method interface: how a fine-tuning method plugs into the one training loop.

A method is one small file: its option schema (the YAML section named after it), a `prepare`
that turns the HF model into the model to train, the trainable set for each step, and how to
export `final/`. The loop never branches on method names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Protocol

from torch import nn


class Method(Protocol):
    """Required: SCHEMA, validate, prepare, optimizer_parameters, set_trainable, export.
    Optional (see `hook`): schedule_position, schedule_length, after_step, log_metrics,
    state_dict, load_state_dict."""

    name: ClassVar[str]
    SCHEMA: ClassVar[dict]  # option name -> training.config.Key, under the YAML section `name:`

    @classmethod
    def validate(cls, cfg) -> None:
        """Cross-key checks beyond types and ranges; raise UserError."""

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        """The model to train: forward(input_ids, attention_mask, labels, return_logits) -> output."""

    def optimizer_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Every parameter that may train at some step (the optimizer holds these)."""

    def set_trainable(self, model: nn.Module, step: int, optimizer=None) -> str:
        """Set requires_grad for `step` (0-based) and return the stage name to log. May also move
        optimizer state between devices (HiFT keeps only the active group's on the device)."""

    def schedule_position(self, step: int) -> int:
        """Position of `step` in the LR schedule (HiFT advances once per cycle)."""

    def schedule_length(self, max_steps: int) -> int:
        """Length of the LR schedule for a run of max_steps optimizer steps."""

    def after_step(self, step: int, model: nn.Module, optimizer) -> None:
        """Hook after the optimizer step (e.g. move idle optimizer state off the device)."""

    def log_metrics(self, model: nn.Module, optimizer) -> dict:
        """Extra method-specific fields for metrics.jsonl (e.g. optimizer bytes resident on device)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def export(self, model: nn.Module, out_dir: Path) -> None:
        """Write the final model to out_dir (model files + revffn.json); tokenizer is added by the loop."""


_OPTIONAL = {
    "schedule_position": lambda step: step,
    "schedule_length": lambda max_steps: max_steps,
    "after_step": lambda step, model, optimizer: None,
    "log_metrics": lambda model, optimizer: {},
    "state_dict": lambda: {},
    "load_state_dict": lambda state: None,
}


def hook(method, name: str):
    """`method.<name>` if the method defines it, else the optional hook's default (identity
    schedule, no-op step hook, no extra metrics, no state): most methods define none of them."""
    return getattr(method, name, None) or _OPTIONAL[name]


def set_requires_grad(model: nn.Module, trainable: set[int]) -> None:
    """requires_grad=True exactly for parameters whose id() is in `trainable`."""
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)


def write_manifest(out_dir: Path, **fields) -> None:
    (out_dir / "revffn.json").write_text(json.dumps(fields, indent=2))

"""The optimizer of a training run: AdamW over a method's `optimizer_parameters`, in two decay groups."""

from __future__ import annotations

import torch
from torch import nn


def decay_groups(params: list[nn.Parameter], weight_decay: float) -> list[dict]:
    """Parameter groups with no weight decay on 1-D parameters (biases, norm weights), as HF Trainer does.

    Every parameter lands in exactly one group: `>= 2-D` ones decay by `weight_decay`, the others by 0.
    """
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(cfg, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with the config's peak LR, betas and epsilon (the loop sets each step's LR from the schedule)."""
    return torch.optim.AdamW(decay_groups(params, cfg.weight_decay), lr=cfg.learning_rate,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)

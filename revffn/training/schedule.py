"""Learning-rate schedules as pure functions of the schedule position (exactly resumable)."""

from __future__ import annotations

import math


def lr_at(position: int, length: int, peak: float, warmup: int, kind: str, min_ratio: float = 0.0) -> float:
    """LR at 0-based `position` of a `length`-long schedule: linear warmup, then cosine/linear/constant.

    Warmup reaches the peak on its last step ((position + 1) / warmup), so step 0 already moves.
    """
    if position < warmup:
        return peak * (position + 1) / warmup
    if kind == "constant":
        return peak
    floor = peak * min_ratio
    progress = min(1.0, (position - warmup) / max(1, length - warmup))
    if kind == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return peak - (peak - floor) * progress
    raise ValueError(f"unknown schedule {kind!r}")

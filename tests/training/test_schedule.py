"""`lr_at`: linear warmup to the peak, then cosine / linear to min_lr_ratio x peak, or constant.

(HiFT's schedule, delayed by its cycle, is checked through `train_step` in test_step.py.)
"""

from __future__ import annotations

import pytest

from revffn.training.schedule import lr_at

PEAK = 2e-3


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_warmup_reaches_the_peak_on_its_last_step(kind):
    lrs = [lr_at(p, 100, PEAK, 4, kind, 0.1) for p in range(4)]
    assert lrs == pytest.approx([PEAK / 4, PEAK / 2, 3 * PEAK / 4, PEAK])  # step 0 already moves
    assert lr_at(4, 100, PEAK, 4, kind, 0.1) == pytest.approx(PEAK)  # the decay starts from the peak


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_decay_ends_at_min_lr_ratio_times_peak(kind):
    lrs = [lr_at(p, 20, PEAK, 5, kind, 0.1) for p in range(5, 21)]
    assert lrs[-1] == pytest.approx(0.1 * PEAK)  # position == length: the end of the schedule
    assert lr_at(25, 20, PEAK, 5, kind, 0.1) == pytest.approx(0.1 * PEAK)  # and it stays there
    assert all(a > b for a, b in zip(lrs, lrs[1:]))  # strictly decreasing in between
    assert lr_at(5, 20, PEAK, 5, kind, 0.0) == PEAK and lr_at(20, 20, PEAK, 5, kind, 0.0) == 0.0


def test_linear_and_cosine_midpoints():
    floor = 0.2 * PEAK
    assert lr_at(5, 10, PEAK, 0, "linear", 0.2) == pytest.approx((PEAK + floor) / 2)
    assert lr_at(5, 10, PEAK, 0, "cosine", 0.2) == pytest.approx((PEAK + floor) / 2)  # cos(pi/2) = 0
    assert lr_at(2, 10, PEAK, 0, "cosine", 0.2) > lr_at(2, 10, PEAK, 0, "linear", 0.2)  # cosine stays high longer


def test_constant_after_warmup():
    assert [lr_at(p, 10, PEAK, 2, "constant", 0.5) for p in range(2, 12)] == [PEAK] * 10


def test_unknown_kind_raises():
    with pytest.raises(ValueError, match="unknown schedule"):
        lr_at(3, 10, PEAK, 0, "step")


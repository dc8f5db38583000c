"""DataOrder: seeded per-epoch permutations and exact resume from state_dict."""

import pytest

from revffn.data.collate import DataOrder


def _run(order, sizes):
    return [order.next_indices(b) for b in sizes]


def test_epochs_are_permutations():
    order = DataOrder(10, seed=3)
    epoch0, epoch1 = order.next_indices(10), order.next_indices(10)
    assert sorted(epoch0) == sorted(epoch1) == list(range(10)) and epoch0 != epoch1
    assert DataOrder(10, seed=3).next_indices(10) == epoch0  # same seed, same order
    assert DataOrder(10, seed=4).next_indices(10) != epoch0
    assert DataOrder(5, seed=3, shuffle=False).next_indices(7) == [0, 1, 2, 3, 4, 0, 1]


def test_batch_spans_epoch_boundary():
    order = DataOrder(7, seed=0)
    first = order.next_indices(5)
    spanning = order.next_indices(5)
    assert sorted(first + spanning[:2]) == list(range(7))
    assert order.state_dict() == {"epoch": 1, "position": 3}


@pytest.mark.parametrize("stop", [1, 2, 3, 5])  # mid-epoch, right after a boundary, across several epochs
def test_resume_is_exact(stop):
    sizes = [3] * 12
    reference = _run(DataOrder(7, seed=11), sizes)
    first = DataOrder(7, seed=11)
    head = _run(first, sizes[:stop])
    state = dict(first.state_dict())
    resumed = DataOrder(7, seed=11)
    resumed.load_state_dict(state)
    assert head + _run(resumed, sizes[stop:]) == reference


def test_resume_at_exact_epoch_end():
    reference = _run(DataOrder(6, seed=1), [3, 3, 3, 3])
    first = DataOrder(6, seed=1)
    _run(first, [3, 3])
    assert first.state_dict() == {"epoch": 1, "position": 0}
    resumed = DataOrder(6, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert _run(resumed, [3, 3]) == reference[2:]

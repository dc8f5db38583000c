"""Exact-match scoring (`revffn eval`, the study): whitespace-insensitive, GSM-style final answers."""

import pytest

from revffn.training.evaluate import is_match


@pytest.mark.parametrize("prediction, reference, expected", [
    ("cat blue red", "cat blue red", True),
    ("  cat\n blue   red ", "cat blue red", True),  # whitespace collapses
    ("cat blue", "cat blue red", False),
    ("Cat blue red", "cat blue red", False),  # case counts
    ("rope, ink, tea", "rope, ink, tea", True),
    ("rope, ink tea", "rope, ink, tea", False),
])
def test_plain_answers_compare_after_collapsing_whitespace(prediction, reference, expected):
    assert is_match(prediction, reference) is expected


@pytest.mark.parametrize("prediction, expected", [
    ("3 + 4 = 7\nAnswer: 7", True),
    ("I guess 4 + 3 = 7\nAnswer: 7", True),  # different working, same final answer
    ("3 + 4 = 7\nAnswer:   7  ", True),
    ("3 + 4 = 8\nAnswer: 8", False),
    ("3 + 4 = 7", False),  # no final answer line: only a whole-text match would count
    ("Answer: 7 apples", False),
])
def test_gsm_references_compare_the_final_answer(prediction, expected):
    assert is_match(prediction, "3 + 4 = 7\nAnswer: 7") is expected


def test_answer_line_in_the_prediction_alone_is_not_enough():
    """Without an `Answer:` line in the reference the texts must match as a whole."""
    assert not is_match("blah\nAnswer: 7", "7")

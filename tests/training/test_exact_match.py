"""Exact-match scoring (`revffn eval`, the study): whitespace-insensitive, GSM-style final answers; and
`--match contains` (knowledge probes): the reference anywhere in the generation, case-insensitive."""

import pytest

from revffn import cli
from revffn.training.evaluate import MATCHES, evaluate, is_match


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


@pytest.mark.parametrize("prediction, reference, exact, contains", [
    ("The capital of France is Paris.", "Paris", False, True),
    ("paris", "Paris", False, True),  # case counts for exact only
    ("It is  Paris,\n France", "paris, france", False, True),  # whitespace collapses on both sides
    ("Paris", "Paris", True, True),
    ("Lyon, not Pa ris", "Paris", False, False),
    ("Par", "Paris", False, False),  # a prefix of the reference is not the reference
    ("", "Paris", False, False),
    ("3 + 4 = 7\nAnswer: 7", "3 + 4 = 7\nAnswer: 7", True, True),
    ("I guess 4 + 3 = 7\nAnswer: 7", "3 + 4 = 7\nAnswer: 7", True, False),  # GSM answers: exact only
    ("anything", "", False, False),  # an empty reference is not contained in everything
    ("", "", True, True),
])
def test_contains_scores_the_reference_anywhere_in_the_prediction(prediction, reference, exact, contains):
    assert is_match(prediction, reference) is exact
    assert is_match(prediction, reference, "exact") is exact
    assert is_match(prediction, reference, "contains") is contains


def test_unknown_match_is_refused():
    with pytest.raises(ValueError, match="match: expected one of exact, contains, got 'fuzzy'"):
        is_match("a", "a", "fuzzy")
    with pytest.raises(ValueError, match="'fuzzy'"):
        evaluate(None, None, [], match="fuzzy")  # before any model work


def test_cli_match_default_and_choices():
    parse = cli.build_parser().parse_args
    assert parse(["eval", "m", "--data", "d"]).match == "exact"
    assert [parse(["eval", "m", "--data", "d", "--match", m]).match for m in MATCHES] == list(MATCHES)


def test_cli_refuses_an_unknown_match(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["eval", "builtin:base", "--data", "builtin:commas_test", "--match", "fuzzy"])
    assert exit_info.value.code == 2
    assert "--match: invalid choice: 'fuzzy'" in capsys.readouterr().err


def test_eval_reports_the_loss_and_the_generation_as_two_bars(monkeypatch):
    """One bar over both ran its ETA low: it priced a generation batch (up to max_new_tokens forwards) as a loss
    batch (one forward)."""
    import contextlib

    from revffn.data.formats import load_examples
    from revffn.training import evaluate as module

    bars = []

    @contextlib.contextmanager
    def recording(desc, unit, total=None, **kw):
        bars.append([desc, total, []])
        yield lambda done, total=None, note="": bars[-1][2].append((done, total))

    monkeypatch.setattr(module, "progress", recording)
    examples = load_examples("builtin:commas_test")[:10]
    evaluate(*cli._load_for_cli("builtin:base"), examples, batch_size=4, max_new_tokens=2, limit=6)
    assert [(desc, total) for desc, total, _ in bars] == [("eval loss", 3), ("eval generate", 2)]
    assert [updates[-1] for _, _, updates in bars] == [(3, 3), (2, 2)]


def test_a_sample_shows_the_user_s_question_after_a_tool_s_result():
    from revffn.data.formats import normalise

    tool_use = normalise({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "weather",
                                                                               "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18 C"}, {"role": "assistant", "content": "18 C."}]}, "t:1")
    report = evaluate(*cli._load_for_cli("builtin:base"), [tool_use], max_new_tokens=2)
    assert [s["prompt"] for s in report["samples"]] == ["Weather in Paris?"]  # not the tool's "18 C"

"""The loop closes metrics.jsonl and the progress bar on every path, and writes the report on error too."""

from __future__ import annotations

import builtins
import contextlib
import io
import json

import pytest

from revffn.progress import progress
from revffn.training import loop
from revffn.training.config import load_config

TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 1, hidden_size: 32}", "data=builtin:reversal_train",
        "eval_data=null", "max_steps=4", "logging_steps=1", "save_steps=0", "per_device_train_batch_size=2",
        "max_seq_length=32", "dtype=float32", "device=cpu"]


@pytest.fixture
def opened(monkeypatch):
    """Every metrics file and progress the loop opens; each progress's updates, and whether it was closed."""
    seen = {"files": [], "bars": []}

    def recording_open(path, *args, **kwargs):
        f = builtins.open(path, *args, **kwargs)
        if str(path).endswith("metrics.jsonl"):
            seen["files"].append(f)
        return f

    @contextlib.contextmanager
    def recording_progress(*args, **kwargs):
        bar = {"was_closed": False, "updates": [], "lines": io.StringIO()}
        seen["bars"].append(bar)
        try:  # each update a line (every=0) on a log, so the test reads what a captured run prints
            with progress(*args, **{**kwargs, "file": bar["lines"], "every": 0}) as update:
                yield lambda done, total=None, note="": (bar["updates"].append(done), update(done, total, note))
        finally:
            bar["was_closed"] = True

    monkeypatch.setattr(loop, "open", recording_open, raising=False)  # shadows the builtin inside loop.py
    monkeypatch.setattr(loop, "progress", recording_progress)
    return seen


def _raise_at_step_2(point: str, step: int, restart: int) -> None:
    if (point, step) == ("step", 2):
        raise RuntimeError("injected fault at step 2")


def test_closed_and_reported_when_a_step_raises(tmp_path, opened):
    cfg = load_config(None, [*TINY, f"output_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="injected fault at step 2"):
        loop.train(cfg, fault=_raise_at_step_2)
    assert len(opened["files"]) == 1 and opened["files"][0].closed
    assert len(opened["bars"]) == 1 and opened["bars"][0]["was_closed"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # step 2 raised before its line
    report = (tmp_path / "report.md").read_text()
    assert "status: **error**" in report and "injected fault at step 2" in report
    assert not (tmp_path / "final").exists()


def test_closed_after_a_run_that_finishes(tmp_path, opened):
    cfg = load_config(None, [*TINY, f"output_dir={tmp_path}"])
    summary = loop.train(cfg)
    assert summary["status"] == "ok" and summary["steps"] == 4 and summary["stage"] == "joint"
    assert opened["files"][0].closed and opened["bars"][0]["was_closed"]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    bar = opened["bars"][0]
    assert bar["updates"] == [1, 2, 3, 4]
    last = bar["lines"].getvalue().splitlines()[-1]  # a log's line names the run, the step and the logged loss
    assert last.startswith("revffn: train revffn [4/4 steps, 100%] ") and f"loss={rows[-1]['loss']:.3f}" in last
    assert (tmp_path / "final" / "revffn.json").is_file()
    assert "status: **ok**" in (tmp_path / "report.md").read_text()

"""The loop closes metrics.jsonl and the progress bar on every path, and writes the report on error too."""

from __future__ import annotations

import builtins
import json

import pytest

from revffn.training import loop
from revffn.training.config import load_config

TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 1, hidden_size: 32}", "data=builtin:reversal_train",
        "eval_data=null", "max_steps=4", "logging_steps=1", "save_steps=0", "per_device_train_batch_size=2",
        "max_seq_length=32", "dtype=float32", "device=cpu", "revffn.adapter_warmup_steps=1"]


@pytest.fixture
def opened(monkeypatch):
    """Every metrics file and progress bar the loop opens."""
    seen = {"files": [], "bars": []}

    def recording_open(path, *args, **kwargs):
        f = builtins.open(path, *args, **kwargs)
        if str(path).endswith("metrics.jsonl"):
            seen["files"].append(f)
        return f

    class RecordingBar(loop.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.was_closed = False
            seen["bars"].append(self)

        def close(self):
            self.was_closed = True
            super().close()

    monkeypatch.setattr(loop, "open", recording_open, raising=False)  # shadows the builtin inside loop.py
    monkeypatch.setattr(loop, "tqdm", RecordingBar)
    return seen


def _raise_at_step_2(point: str, step: int, restart: int) -> None:
    if (point, step) == ("step", 2):
        raise RuntimeError("injected fault at step 2")


def test_closed_and_reported_when_a_step_raises(tmp_path, opened):
    cfg = load_config(None, [*TINY, f"output_dir={tmp_path}"])
    with pytest.raises(RuntimeError, match="injected fault at step 2"):
        loop.train(cfg, fault=_raise_at_step_2)
    assert len(opened["files"]) == 1 and opened["files"][0].closed
    assert len(opened["bars"]) == 1 and opened["bars"][0].was_closed
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]  # step 2 raised before its line
    report = (tmp_path / "report.md").read_text()
    assert "status: **error**" in report and "injected fault at step 2" in report
    assert not (tmp_path / "final").exists()


def test_closed_after_a_run_that_finishes(tmp_path, opened):
    cfg = load_config(None, [*TINY, f"output_dir={tmp_path}"])
    summary = loop.train(cfg)
    assert summary["status"] == "ok" and summary["steps"] == 4 and summary["stage"] == "joint"
    assert opened["files"][0].closed and opened["bars"][0].was_closed
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert (tmp_path / "final" / "revffn.json").is_file()
    assert "status: **ok**" in (tmp_path / "report.md").read_text()

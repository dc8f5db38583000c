"""Exact resume after kill -9 (mid-step and mid-checkpoint), rollback over a damaged checkpoint,
auto-restart, NaN stop."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import THREADS
from tests.training._util import flip_byte

pytestmark = pytest.mark.integration  # subprocess runs (CLI, workers)

FAULT_RUN = Path(__file__).with_name("fault_run.py")  # revffn train with a fault injected

BASE = {
    "model": "tiny-qwen2-moe", "method": "revffn", "data": "builtin:reversal_train",
    "max_steps": 10, "save_steps": 3, "save_total_limit": 2, "logging_steps": 1, "seed": 3,
    "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_seq_length": 48,
    "learning_rate": 2e-3, "warmup_steps": 2,
}


def _write(tmp: Path, name: str, **over) -> Path:
    cfg = {**BASE, "output_dir": str(tmp / name), **over}
    p = tmp / f"{name}.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


def _train(cfg: Path, *over, fault: str | None = None) -> subprocess.CompletedProcess:
    """`revffn train CONFIG over...` in a child process; `fault`: a fault_run.py spec injected into it."""
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}  # the same in every run a test compares
    launch = [str(FAULT_RUN), fault] if fault else ["-m", "revffn", "train"]
    return subprocess.run([sys.executable, *launch, str(cfg), *over], env=env,
                          capture_output=True, text=True, timeout=600)


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    proc = _train(_write(tmp, "ref"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses = _losses(tmp / "ref")
    assert sorted(losses) == list(range(1, 11))
    return losses


def _resume_matches(cfg: Path, run: Path, reference: dict[int, float]) -> None:
    """resume=true finishes the run, and every step's loss is the uninterrupted run's (1e-6)."""
    newest = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))[-1]
    second = _train(cfg, "resume=true")
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"revffn train: resuming from {newest} (step {newest.name[5:]} of 10)" in second.stderr  # said where from
    resumed = _losses(run)
    assert sorted(resumed) == list(range(1, 11))
    for step, loss in reference.items():
        assert abs(resumed[step] - loss) <= 1e-6, (step, resumed[step], loss)


@pytest.mark.parametrize("fault,expect_ckpt", [("kill@step:8", 6), ("kill@save:9", 6)])
def test_kill_and_resume_reproduces_losses(tmp_path, reference, fault, expect_ckpt):
    cfg = _write(tmp_path, "run")
    first = _train(cfg, fault=fault)
    assert first.returncode == -9, first.stderr[-2000:]  # SIGKILL
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert ckpts[-1].name == f"step-{expect_ckpt}"
    _resume_matches(cfg, tmp_path / "run", reference)
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


def test_a_full_disk_while_saving_exits_1_in_one_line_and_resume_continues_exactly(tmp_path, reference):
    """From the middle of writing step-6's checkpoint no file may grow past 1 KiB (RLIMIT_FSIZE, as a full disk):
    exit 1, one line (what it needs, what is free, where), no traceback, the partial checkpoint removed and step-3
    kept; resume=true then finishes with an uninterrupted run's losses."""
    cfg = _write(tmp_path, "run")
    first = _train(cfg, fault="fsize@save:6")
    assert first.returncode == 1, first.stderr[-2000:]
    errors = [line for line in first.stderr.splitlines() if "error:" in line]
    assert "Traceback" not in first.stderr and len(errors) == 1, first.stderr[-3000:]
    assert "cannot write checkpoint step-6 in" in errors[0] and "bytes; " in errors[0] and "are free" in errors[0]
    assert "limited to 1,024 bytes" in errors[0] and "resume=true" in errors[0], errors[0]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-3"]
    _resume_matches(cfg, tmp_path / "run", reference)


def test_damaged_latest_checkpoint_rolls_back(tmp_path):
    """One flipped byte in step-6's weights: resume=true rolls back to step-3 (events.jsonl and a warning
    say so, step-6 is moved aside), finishes, and steps 4-7 reproduce the losses the killed run logged
    uninterrupted. (The buffered default: no calibration, the cheapest two runs.)"""
    cfg = _write(tmp_path, "run")
    first = _train(cfg, fault="kill@step:8")
    assert first.returncode == -9, first.stderr[-2000:]
    run = tmp_path / "run"
    uninterrupted = _losses(run)
    assert sorted(uninterrupted) == list(range(1, 8))
    flip_byte(run / "checkpoints" / "step-6" / "model.safetensors")  # tensor data: it would still load
    second = _train(cfg, "resume=true")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "checkpoint step-6 fails verification (model.safetensors: sha256 mismatch" in second.stderr
    assert "rolled back to step-3" in second.stderr
    taken, *events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert taken["event"] == "lock_taken_over"  # the killed first run never released the run lock
    assert [(e["event"], e["from"], e["to"]) for e in events] == [("rollback", "step-6", "step-3")]
    assert events[0]["reason"].startswith("model.safetensors: sha256 mismatch")
    assert (run / "checkpoints" / "rejected-step-6" / "model.safetensors").exists()
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-6", "step-9"]
    resumed = _losses(run)
    assert sorted(resumed) == list(range(1, 11))
    for step, loss in uninterrupted.items():
        assert abs(resumed[step] - loss) <= 1e-6, (step, resumed[step], loss)


def test_auto_restart_after_crash(tmp_path, reference):
    cfg = _write(tmp_path, "run", max_restarts=1)
    proc = _train(cfg, fault="raise@step:7")
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "restart" and events[0]["from_step"] == 6
    assert "restart 1/1" in proc.stderr
    losses = _losses(tmp_path / "run")
    for step, loss in reference.items():
        assert abs(losses[step] - loss) <= 1e-6


def test_crash_without_restarts_exits_1(tmp_path):
    proc = _train(_write(tmp_path, "run", max_steps=6), fault="raise@step:2")
    assert proc.returncode == 1
    assert "injected fault" in proc.stderr
    assert (tmp_path / "run" / "report.md").exists()  # the report is written on error too


def test_nan_loss_stops_with_exit_1_and_keeps_checkpoint(tmp_path):
    cfg = _write(tmp_path, "run", learning_rate=1e30, warmup_steps=0, save_steps=1, max_grad_norm=0.0,
                 max_steps=6)
    proc = _train(cfg)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "diverged" in proc.stderr and "nan" in proc.stderr.lower()
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert ckpts, "the last good checkpoint must survive"
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(ckpts[-1] / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values())
    report = (tmp_path / "run" / "report.md").read_text()
    assert "diverged" in report

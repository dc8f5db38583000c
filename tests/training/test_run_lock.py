"""The run directory is locked for the whole run: a second start, an overwrite or a resume of a live run exits 2
and touches nothing; two simultaneous starts make exactly one run, whose metrics are an uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from revffn import cli
from revffn.training.setup import LOCK_FILE, RunLock

TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 1, hidden_size: 32}", "data=builtin:reversal_train",
        "eval_data=null", "eval_generate_limit=0", "max_steps=3", "logging_steps=1", "save_steps=0",
        "per_device_train_batch_size=2", "max_seq_length=32", "dtype=float32", "device=cpu", "method=full"]


def _files(run_dir) -> dict[str, float]:
    """Every file of the run and its mtime (the lock file aside: holding it writes the holder's name)."""
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in sorted(run_dir.rglob("*"))
            if p.name != LOCK_FILE}


def _losses(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_a_live_run_blocks_a_second_start_an_overwrite_and_a_resume(tmp_path, capsys):
    run_dir, args = tmp_path / "run", [*TINY, "save_steps=2"]  # (a checkpoint to resume from)
    assert cli.main(["train", *args, f"output_dir={run_dir}"]) == 0
    before = _files(run_dir)
    lock = RunLock(run_dir).acquire()  # as a live run holds it
    try:
        for extra, says in (([], "already holds a run"), (["overwrite=true"], f"held by pid {os.getpid()}"),
                            (["resume=true"], f"held by pid {os.getpid()}")):
            assert cli.main(["train", *args, f"output_dir={run_dir}", *extra]) == 2, extra
            err = capsys.readouterr().err
            assert says in err and "Fix:" in err, err
            assert _files(run_dir) == before, extra  # nothing deleted, nothing written
    finally:
        lock.release()
    assert cli.main(["train", *args, f"output_dir={run_dir}", "resume=true"]) == 0  # released: it runs


@pytest.mark.integration
def test_a_lock_names_its_holder_and_dies_with_its_process(tmp_path):
    run_dir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; from revffn.training.setup import RunLock; "
                              f"RunLock({str(run_dir)!r}).acquire(); print('held', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(Exception, match=f"held by pid {child.pid} on "):
            RunLock(run_dir).acquire()
    finally:
        child.kill()
        child.wait()
    lock = RunLock(run_dir).acquire()  # the kernel dropped the killed holder's lock: taken over, its name kept
    assert json.loads(lock.taken_over)["pid"] == child.pid
    lock.release()
    again = RunLock(run_dir).acquire()
    assert again.taken_over is None  # released cleanly: nothing to take over
    again.release()
    assert oct((run_dir / LOCK_FILE).stat().st_mode & 0o777) == "0o600"


def _race(tmp_path, times: int) -> None:
    reference = tmp_path / "reference"
    assert cli.main(["train", *TINY, f"output_dir={reference}"]) == 0
    for i in range(times):
        run_dir = tmp_path / f"race{i}"
        procs = [subprocess.Popen([sys.executable, "-m", "revffn", "train", *TINY, f"output_dir={run_dir}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
        codes = sorted(rc for rc, _ in results)
        assert codes == [0, 2], results
        loser = next(err for rc, err in results if rc == 2)
        assert "output_dir" in loser and "Traceback" not in loser, loser
        got, want = _losses(run_dir), _losses(reference)  # one run, uninterrupted, in order
        assert [step for step, _ in got] == [step for step, _ in want]
        assert [loss for _, loss in got] == pytest.approx([loss for _, loss in want], abs=1e-6)


@pytest.mark.integration
def test_simultaneous_starts_make_exactly_one_run(tmp_path):
    _race(tmp_path, 3)


@pytest.mark.slow
def test_simultaneous_starts_make_exactly_one_run_20_times(tmp_path):
    _race(tmp_path, 20)


@pytest.mark.integration
def test_between_restarts_the_supervisor_holds_the_run_directory(tmp_path):
    """Under max_restarts the first attempt (a child) holds the lock; once it dies the supervising process takes it
    and keeps it for every later attempt, so no other process can start in the directory between two attempts: a
    second lock tried from inside the restarted attempt names the supervisor as the holder."""
    probe, run_dir = tmp_path / "probe", tmp_path / "run"
    script = Path(__file__).with_name("lock_probe_run.py")
    env = {**os.environ, "LOCK_PROBE_OUT": str(probe), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, str(script), "kill@step:2", *TINY, "max_steps=4", "save_steps=1",
                           "max_restarts=1", f"output_dir={run_dir}"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    supervisor, outcome = probe.read_text().splitlines()
    assert f"held by pid {supervisor} on " in outcome, outcome
    assert [s for s, _ in _losses(run_dir)] == [1, 2, 3, 4]


def test_a_lock_file_removed_by_its_holder_is_not_held_by_the_start_that_waited_on_it(tmp_path, monkeypatch):
    """A start that opened the lock file just before its holder removed it (a build that failed: `RunLock.remove`)
    locks the file there now, not the removed one: two starts never both hold the directory."""
    run_dir = tmp_path / "run"
    holder = RunLock(run_dir).acquire()
    real_open, opened = os.open, []

    def open_then_holder_removes(path, *args):
        fd = real_open(path, *args)
        if not opened:  # the first open: the holder removes the file and releases it right after
            opened.append(fd)
            holder.remove()
        return fd

    monkeypatch.setattr(os, "open", open_then_holder_removes)
    waiting = RunLock(run_dir).acquire()
    monkeypatch.undo()
    try:
        assert os.fstat(waiting.fd).st_ino == os.stat(run_dir / LOCK_FILE).st_ino  # the file a third start opens
        with pytest.raises(Exception, match="is in use: held by pid"):
            RunLock(run_dir).acquire()
    finally:
        waiting.release()

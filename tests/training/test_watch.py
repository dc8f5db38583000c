"""Watching a run: heartbeat.json, the stall watchdog (exit 3, a stack dump, a restart that resumes)
and the memory-growth alert (fires on an injected leak, silent on the same run without it)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from revffn import cli
from revffn.errors import UserError
from revffn.training import loop
from revffn.training.watch import STALL_EXIT, MemoryGrowth, Stalled, run_in_child

FAULT_RUN = Path(__file__).with_name("fault_run.py")  # revffn train with a fault injected
MIB = 2**20
STALL_S = 5
# leaks about 3.5 MiB a step with `leak@step:1` (every module's output kept); the memory in use stays flat without
RUN = {
    "model": "tiny-qwen2-moe", "model_config": {"num_hidden_layers": 1, "hidden_size": 128},
    "data": "builtin:reversal_train", "eval_data": None, "max_steps": 40, "save_steps": 3, "logging_steps": 1,
    "seed": 3, "per_device_train_batch_size": 8, "max_seq_length": 64, "dtype": "float32", "device": "cpu",
    "memory_growth_window": 10, "memory_growth_tolerance_mib": 8,
}


def _train(tmp: Path, name: str, fault: str | None = None, **over) -> subprocess.CompletedProcess:
    """`revffn train` of RUN (+ `over`) into tmp/name in a child process, `fault` (fault_run.py) injected."""
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({**RUN, "output_dir": str(tmp / name), **over}))
    launch = [str(FAULT_RUN), fault] if fault else ["-m", "revffn", "train"]
    return subprocess.run([sys.executable, *launch, str(cfg)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _jsonl(run / "metrics.jsonl")}


# --- the memory-growth rule on made-up series ------------------------------------------------------


def _fired(series_mib: list[float], window: int = 10, tolerance_mib: float = 16) -> list[dict]:
    growth = MemoryGrowth(window, tolerance_mib)
    return [e for step, m in enumerate(series_mib, 1) if (e := growth.update(step, int(m * MIB)))]


def test_memory_growth_fires_once_on_a_steady_rise():
    leak = [500.0] * 3 + [540.0] * 7 + [540 + 3.5 * i for i in range(1, 31)]  # a warm-up jump, then 3.5 MiB a step
    events = _fired(leak)
    assert len(events) == 1  # judged from step 21: 10 warm-up steps, then 10 steps' rises
    assert events[0]["from_step"] == 11 and events[0]["step"] == 21 and events[0]["rise_mib"] == 35.0


@pytest.mark.parametrize("series", [
    [500.0] * 40,  # flat
    [500.0] * 20 + [600.0] * 20,  # one jump (a stage's first step, a longer batch)
    [500.0] * 15 + [520.0] * 5 + [540.0] * 20,  # two jumps: rising on 2 of 10 steps
    [500 + 0.01 * i for i in range(400)],  # a creep of 10 KiB a step
    [500 + 0.01 * i + 30 * (i == 25) for i in range(40)],  # a creep plus one jump over the tolerance
    [500 + 5 * (i % 2) for i in range(40)],  # up and down
])
def test_memory_growth_ignores_jumps_creeps_and_noise(series):
    assert _fired(series) == []


def test_memory_growth_waits_out_the_warm_up():
    assert _fired([500 + 10 * i for i in range(20)], window=10) == []  # 10 warm-up steps + 10: not judged yet
    assert len(_fired([500 + 10 * i for i in range(21)], window=10)) == 1


# --- the supervisor: one attempt in a child process -----------------------------------------------


def _bad_input():
    raise UserError("bad key")


def test_run_in_child_returns_its_result_and_raises_its_error():
    assert run_in_child(lambda a, b: {"sum": a + b}, 2, 3) == {"sum": 5}
    with pytest.raises(UserError, match="bad key") as caught:
        run_in_child(_bad_input, errors=(UserError,))
    assert "in the training process" in "".join(getattr(caught.value, "__notes__", []))
    with pytest.raises(RuntimeError, match="UserError: bad key"):  # a type not named in `errors`
        run_in_child(_bad_input)


def test_run_in_child_tells_a_stall_from_a_kill():
    with pytest.raises(Stalled, match="exit code 3"):
        run_in_child(os._exit, STALL_EXIT)
    with pytest.raises(RuntimeError, match="killed by SIGKILL"):
        run_in_child(lambda: os.kill(os.getpid(), signal.SIGKILL))


def test_train_exits_3_when_the_last_attempt_stalled(monkeypatch, tmp_path):
    def stalled(cfg):
        raise Stalled("the training process made no step")

    monkeypatch.setattr(loop, "run", stalled)
    assert cli.main(["train", f"output_dir={tmp_path}"]) == STALL_EXIT


# --- real runs (subprocesses) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("clean")
    proc = _train(tmp, "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tmp / "run", proc


@pytest.mark.integration
def test_heartbeat_and_no_alert_on_a_clean_run(clean):
    run, proc = clean
    beat = json.loads((run / "heartbeat.json").read_text())
    assert set(beat) == {"step", "time", "pid", "loss", "loss_step", "peak_mem_bytes", "mem_bytes"}
    assert beat["step"] == beat["loss_step"] == 40 and beat["loss"] == _losses(run)[40]
    assert beat["peak_mem_bytes"] >= beat["mem_bytes"] > 0 and time.time() - beat["time"] < 600
    assert not (run / ".heartbeat.json.tmp").exists()
    assert _jsonl(run / "events.jsonl") == []
    assert "memory in use rose" not in proc.stderr and "warning: memory" not in (run / "report.md").read_text()


@pytest.mark.integration
def test_an_injected_leak_fires_the_memory_alert(tmp_path):
    proc = _train(tmp_path, "run", fault="leak@step:1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = _jsonl(tmp_path / "run" / "events.jsonl")
    print(events)
    assert [e["event"] for e in events] == ["memory_growth"]
    assert events[0]["rise_mib"] >= 8 and events[0]["steps_rising"] >= 3
    assert "warning: memory in use rose" in proc.stderr
    assert "warning: memory in use rose" in (tmp_path / "run" / "report.md").read_text()


@pytest.mark.integration
def test_a_stall_exits_3_with_every_threads_stack(tmp_path):
    proc = _train(tmp_path, "run", fault="hang@step:7", stall_timeout_s=STALL_S)
    ended = time.time()
    assert proc.returncode == STALL_EXIT, proc.stderr[-2000:]
    last_beat = json.loads((tmp_path / "run" / "heartbeat.json").read_text())
    print(f"exit {ended - last_beat['time']:.1f} s after the last step (stall_timeout_s={STALL_S})")
    assert last_beat["step"] == 6 and ended - last_beat["time"] <= STALL_S + 3
    (stall,) = _jsonl(tmp_path / "run" / "events.jsonl")
    assert stall["event"] == "stall" and stall["step"] == 6 and stall["stall_timeout_s"] == STALL_S
    main = next(s for name, s in stall["stacks"].items() if name.startswith("MainThread"))
    assert "fault_run.py" in main and "time.sleep(600)" in main  # where the step hangs
    assert "stalled" in proc.stderr and "time.sleep(600)" in proc.stderr


@pytest.mark.integration
def test_a_stall_is_restarted_from_the_checkpoint_and_finishes(tmp_path, clean):
    proc = _train(tmp_path, "run", fault="hang@step:7", stall_timeout_s=STALL_S, max_restarts=1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stall, restart = _jsonl(tmp_path / "run" / "events.jsonl")
    assert stall["event"] == "stall" and stall["step"] == 6
    assert restart["event"] == "restart" and restart["from_step"] == 6 and "exit code 3" in restart["error"]
    assert "restart 1/1" in proc.stderr
    losses, reference = _losses(tmp_path / "run"), _losses(clean[0])
    assert sorted(losses) == list(range(1, 41))
    assert all(abs(losses[s] - reference[s]) <= 1e-6 for s in reference)  # resumed exactly at step 6
    assert (tmp_path / "run" / "final" / "revffn.json").is_file()
    report = (tmp_path / "run" / "report.md").read_text()
    assert "stalled after step 6" in report and "automatic restarts: 1" in report

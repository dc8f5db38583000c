"""Watching a run as it trains: the heartbeat, the stall watchdog, the memory-growth alert.

    with RunWatch(cfg, run_dir, device, main) as watch:     # Recipe.train (left in Recipe.cleanup)
        ...one optimizer step, its metrics line, eval and checkpoint...
        watch.step(step, logged)

- `heartbeat.json` (rank 0) is rewritten atomically after every step: `step`, `time` (Unix seconds),
  `pid`, `loss` (the last logged loss, at `loss_step`: reading it every step would add a host sync
  per step when `logging_steps` > 1), `peak_mem_bytes` (metrics.jsonl's measure, this rank's) and
  `mem_bytes` (in use after the step). A monitor whose heartbeat's `time` stops moving knows the run
  is stuck or gone.
- The stall watchdog (`stall_timeout_s` > 0; every process, torchrun's ranks included) is a daemon
  thread. When no step completes for `stall_timeout_s` seconds (the first one counted from the loop's
  start; a step includes its eval and checkpoint), it writes every thread's stack to events.jsonl
  (event `stall`) and stderr, then ends the process with exit code 3 (`STALL_EXIT`). It ends the
  process rather than raising into the main thread because a stalled main thread may sit where no
  Python exception reaches it (a CUDA sync, a collective, a C-level deadlock). A restart therefore
  comes from a supervising process: with `max_restarts` > 0 every attempt runs in a child process
  (`run_in_child`; the loop's `_run` restarts it from the last checkpoint), and under torchrun the
  agent restarts the ranks (`--max-restarts`).
- The memory-growth alert (rank 0, `memory_growth_window` > 0): see `MemoryGrowth`. It writes one
  `memory_growth` event and a warning on stderr; the run report shows it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

import torch

from revffn.memory.measure import memory_in_use_bytes, peak_memory_bytes

STALL_EXIT = 3  # the exit code of a process the watchdog ended


class Stalled(RuntimeError):
    """An attempt run in a child process was ended by its stall watchdog (exit code 3)."""


def append_event(run_dir: Path, event: str, **fields) -> None:
    """One line of events.jsonl (restarts, stalls, memory growth); nothing when the run dir is absent."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n"
        with open(run_dir / "events.jsonl", "a+b") as f:  # (writes go to the end, wherever it read)
            end = f.seek(0, os.SEEK_END)
            if end:
                f.seek(end - 1)
                if f.read(1) != b"\n":
                    line = "\n" + line  # after the unfinished line a killed process left
            f.write(line.encode())


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file the run appends to (metrics.jsonl, events.jsonl); a line that does not
    parse, which a process killed mid-write leaves, is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    return [r for line in path.read_text(errors="replace").splitlines() if (r := read_jsonl_line(line)) is not None]


def read_jsonl_line(line: str) -> dict | None:
    """One record of a run's JSON-lines file, or None for a line a killed write left unfinished."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def thread_stacks() -> dict[str, str]:
    """Every other thread's Python stack, by `name (ident)`."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    return {f"{names.get(ident, 'thread')} ({ident})": "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items() if ident != me}


class Watchdog:
    """Ends the process with `STALL_EXIT` when `beat` is not called for `timeout_s` seconds."""

    def __init__(self, timeout_s: float, run_dir: Path, rank: int = 0):
        self.timeout_s, self.run_dir, self.rank = timeout_s, run_dir, rank
        self.last, self.step = time.monotonic(), 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="revffn-stall-watchdog", daemon=True)

    def start(self) -> None:
        self.last = time.monotonic()
        self._thread.start()

    def beat(self, step: int) -> None:
        self.last, self.step = time.monotonic(), step

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)  # exits at most `poll` seconds late
        while not self._stop.wait(poll):
            waited = time.monotonic() - self.last
            if waited > self.timeout_s:
                self._end(waited)

    def _end(self, waited: float) -> None:
        """The dump, then exit code 3; the exit happens even if writing the dump fails."""
        try:
            stacks = thread_stacks()
            append_event(self.run_dir, "stall", rank=self.rank, pid=os.getpid(), step=self.step,
                         stall_timeout_s=self.timeout_s, seconds_since_step=round(waited, 1), stacks=stacks)
            dump = "\n".join(f"--- thread {name}\n{stack}" for name, stack in stacks.items())
            print(f"revffn train: stalled: no optimizer step completed in {waited:.0f} s (stall_timeout_s="
                  f"{self.timeout_s}) after step {self.step}; exiting with code {STALL_EXIT}. Every thread's "
                  f"stack (also in events.jsonl):\n{dump}", file=sys.stderr, flush=True)
        finally:
            os._exit(STALL_EXIT)


class MemoryGrowth:
    """Warns once when the memory a step leaves in use keeps rising: a leak (a hook or a list keeping
    tensors). It watches the memory in use after each step (CUDA allocated, process RSS), not the
    peak: a peak is a high-water mark, and the setup's (loading, calibrating) can hide a leak for
    many steps (in tests/training/test_watch.py's leaky CPU run, 3.5 MiB a step, the peak RSS stayed
    flat until step 22, while the RSS in use rose from step 10).

    The first `window` steps of the process are warm-up (the optimizer's states, the allocator's
    pools). After them, with the memory of the last `window` + 1 steps, M_0 ... M_w, it fires when

        M_w - M_0 >= tolerance,   no single rise M_i - M_(i-1) exceeds half of M_w - M_0,
        and the memory rose on at least a quarter of the w steps.

    So one-off jumps never fire it (the first step of a stage, a longer batch, a checkpoint's
    buffers), nor does a creep of a few KiB a step; a leak raises the memory a little on most steps.
    """

    def __init__(self, window: int, tolerance_mib: float):
        self.window, self.tolerance = window, tolerance_mib * 2**20
        self.memory: deque[tuple[int, int]] = deque(maxlen=window + 1)  # (step, bytes)
        self.seen, self.fired = 0, False

    def update(self, step: int, in_use: int) -> dict | None:
        """Record the memory in use after `step`; returns the event's fields when it fires (once)."""
        self.seen += 1
        if self.fired or self.seen <= self.window:
            return None
        self.memory.append((step, in_use))
        if len(self.memory) <= self.window:
            return None
        values = [m for _, m in self.memory]
        rises = [b - a for a, b in zip(values, values[1:])]
        total, rising = values[-1] - values[0], sum(r > 0 for r in rises)
        if total < self.tolerance or max(rises) > total / 2 or rising < self.window / 4:
            return None
        self.fired = True
        return {"from_step": self.memory[0][0], "step": step, "rise_mib": round(total / 2**20, 2),
                "largest_step_rise_mib": round(max(rises) / 2**20, 2), "steps_rising": rising,
                "window": self.window, "tolerance_mib": self.tolerance / 2**20, "mem_bytes": in_use}


class RunWatch:
    """The heartbeat, the watchdog and the memory-growth alert of one process's step loop."""

    def __init__(self, cfg, run_dir: Path, device: torch.device, main: bool, rank: int = 0):
        self.run_dir, self.device, self.main = Path(run_dir), device, main
        self.watchdog = Watchdog(cfg.stall_timeout_s, self.run_dir, rank) if cfg.stall_timeout_s else None
        self.growth = MemoryGrowth(cfg.memory_growth_window, cfg.memory_growth_tolerance_mib) \
            if main and cfg.memory_growth_window else None

    def __enter__(self) -> RunWatch:
        if self.watchdog:
            self.watchdog.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.watchdog:
            self.watchdog.stop()

    def step(self, step: int, logged: tuple[int, float] | None) -> None:
        """After optimizer step `step` (and its line, eval, checkpoint); `logged`: the last (step, loss)."""
        if self.watchdog:
            self.watchdog.beat(step)
        if not self.main:
            return
        in_use = memory_in_use_bytes(self.device)
        beat = {"step": step, "time": round(time.time(), 3), "pid": os.getpid(), "loss": logged and logged[1],
                "loss_step": logged and logged[0], "peak_mem_bytes": peak_memory_bytes(self.device),
                "mem_bytes": in_use}
        tmp = self.run_dir / ".heartbeat.json.tmp"
        tmp.write_text(json.dumps(beat) + "\n")
        os.replace(tmp, self.run_dir / "heartbeat.json")  # atomic: a reader never sees half a file
        if self.growth and (event := self.growth.update(step, in_use)):
            append_event(self.run_dir, "memory_growth", **event)
            print(f"revffn train: warning: memory in use rose {event['rise_mib']} MiB over steps {event['from_step']}"
                  f"-{step}, on {event['steps_rising']} of {event['window']} steps: a leak? Look for references "
                  "kept to tensors (hooks, lists of outputs); events.jsonl has the figures.", file=sys.stderr)


def run_in_child(fn, *args, errors: tuple[type[BaseException], ...] = ()):
    """`fn(*args)` in a forked child process: its result, or its exception raised here.

    The child dies with this process (Linux: PR_SET_PDEATHSIG). The supervisor itself touches no
    device: each attempt initialises CUDA in its own process. The outcome comes back as JSON, not
    pickle (no load here runs code): the result a JSON value, an exception its type name, message
    and traceback.

    Raises:
        The exception `fn` raised, as the class of that name in `errors` (else a RuntimeError naming
        the type), its traceback in the child attached as a note. Stalled: the child's watchdog ended
        it. RuntimeError: it died otherwise (killed, out of memory, crashed).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 1  # the outcome could not be sent
        try:
            _die_with(parent)
            with os.fdopen(write, "w") as out:
                out.write(_outcome(fn, args))
            code = 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # skips the atexit handlers and finalizers inherited from the parent
    os.close(write)
    with os.fdopen(read, "r") as f:
        payload = f.read()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if payload:
        outcome = json.loads(payload)
        if outcome["kind"] == "ok":
            return outcome["value"]
        known = {cls.__name__: cls for cls in errors}
        cls = known.get(outcome["type"])
        error = cls(outcome["message"]) if cls else RuntimeError(f"{outcome['type']}: {outcome['message']}")
        error.add_note(f"in the training process {pid}:\n{outcome['traceback']}")
        raise error
    if code == STALL_EXIT:
        raise Stalled(f"the training process {pid} made no step in stall_timeout_s and was ended with exit code "
                      f"{STALL_EXIT} (every thread's stack is in events.jsonl)")
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    raise RuntimeError(f"the training process {pid} {how} (out of memory? killed?)")


def _outcome(fn, args) -> str:
    """JSON of {"kind": "ok", "value"} or {"kind": "error", "type", "message", "traceback"}; a value JSON
    cannot hold is sent as its string."""
    try:
        return json.dumps({"kind": "ok", "value": fn(*args)}, default=str)
    except BaseException as e:
        return json.dumps({"kind": "error", "type": type(e).__name__, "message": str(e),
                           "traceback": traceback.format_exc()})


def _die_with(parent: int) -> None:
    """Have the kernel kill this child when its parent dies, so no attempt trains on unsupervised."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)

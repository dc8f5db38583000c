"""`revffn train` with a fault injected, for the kill -9 / crash / stall / leak tests (run in a child process):

    python tests/training/fault_run.py 'kill@step:7' CONFIG.yaml key=value ...
    python tests/training/fault_run.py 'kill@save:9,raise@step:5' CONFIG.yaml ...

SPEC is a comma-separated list of ACTION@POINT:STEP[:RANK]. POINT is `step` (after that optimizer step),
`save` (in the middle of writing that step's checkpoint) or `final` (after step N of the final/ swap,
`models.cache.staged_dir`). ACTION `kill` sends SIGKILL to this process; `raise` raises a RuntimeError once;
`hang` sleeps for ten minutes (a hung rank, a stalled step); `leak` makes a forward hook on every module keep
its output from then on (debug code holding tensors: a memory leak); `fsize` limits every file this process
writes from then on to 1 KiB (RLIMIT_FSIZE: a full disk, deterministically). A restart of the run does not see
a fault again: not in the same process, nor in a later attempt (the loop tells the hook its attempt: a
`max_restarts` restart, or torchrun's). Under torchrun, RANK limits a fault to that rank.

    torchrun --nproc-per-node 2 tests/training/fault_run.py 'kill@step:3:1' CONFIG.yaml ...
"""

from __future__ import annotations

import functools
import os
import resource
import signal
import sys
import time

KEPT: list = []  # what the `leak` fault keeps
LEAKING = {"on": False}


def parse_fault(spec: str):
    """The `fault(point, step, restart)` callback of SPEC (see the module docstring)."""
    items = []
    for item in filter(None, spec.split(",")):
        action, where = item.split("@")
        point, at, *rank = where.split(":")
        actions, points = ("kill", "raise", "hang", "leak", "fsize"), ("step", "save", "final")
        if action not in actions or point not in points or len(rank) > 1:
            raise ValueError(f"bad fault {item!r}: expected kill|raise|hang|leak|fsize @ step|save|final : N [: RANK]")
        if rank and int(rank[0]) != int(os.environ.get("RANK", "0")):
            continue
        items.append((item, action, point, int(at)))
    fired: set[str] = set()

    def fault(point: str, step: int, restart: int) -> None:
        if restart:  # a later attempt (max_restarts, or torchrun's): the fault happened already
            return
        for item, action, name, at in items:
            if name == point and at == step and item not in fired:
                if action == "leak":
                    LEAKING["on"] = True
                    fired.add(item)
                    return
                if action == "fsize":  # from here on no file may grow past 1 KiB: the disk is "full"
                    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
                    fired.add(item)
                    return
                if action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if action == "hang":
                    time.sleep(600)
                fired.add(item)
                raise RuntimeError(f"injected fault at {point} {step}")

    return fault


def keeping_outputs(build_run):
    """`build_run` whose model's modules each keep their output in KEPT once the `leak` fault fired."""

    def keep(module, inputs, output):
        if LEAKING["on"]:
            KEPT.append(output)

    def wrapped(*args, **kwargs):
        run = build_run(*args, **kwargs)
        for module in run.model.modules():
            module.register_forward_hook(keep)
        return run

    return wrapped


def main(argv: list[str]) -> int:
    from revffn import cli
    from revffn.training import loop

    spec, *train_args = argv
    loop.run = functools.partial(loop.run, fault=parse_fault(spec))  # what `revffn train` calls
    if "leak@" in spec:
        loop.build_run = keeping_outputs(loop.build_run)
    return cli.main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

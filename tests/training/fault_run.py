"""`revffn train` with a fault injected, for the kill -9 / crash tests (run in a child process):

    python tests/training/fault_run.py 'kill@step:7' CONFIG.yaml key=value ...
    python tests/training/fault_run.py 'kill@save:9,raise@step:5' CONFIG.yaml ...

SPEC is a comma-separated list of ACTION@POINT:STEP[:RANK]. POINT is `step` (after that optimizer
step) or `save` (in the middle of writing that step's checkpoint). ACTION `kill` sends SIGKILL to this
process; `raise` raises a RuntimeError once; `hang` sleeps for ten minutes (a hung rank). A restart
of the run does not see a fault again: not in the same process, nor after torchrun restarted the job
(TORCHELASTIC_RESTART_COUNT > 0). Under torchrun, RANK limits a fault to that rank.

    torchrun --nproc-per-node 2 tests/training/fault_run.py 'kill@step:3:1' CONFIG.yaml ...
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time


def parse_fault(spec: str):
    """The `fault(point, step)` callback of SPEC (see the module docstring)."""
    items = []
    for item in filter(None, spec.split(",")):
        action, where = item.split("@")
        point, at, *rank = where.split(":")
        if action not in ("kill", "raise", "hang") or point not in ("step", "save") or len(rank) > 1:
            raise ValueError(f"bad fault {item!r}: expected kill|raise|hang @ step|save : N [: RANK]")
        if rank and int(rank[0]) != int(os.environ.get("RANK", "0")):
            continue
        items.append((item, action, point, int(at)))
    fired: set[str] = set()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")):
        items = []

    def fault(point: str, step: int) -> None:
        for item, action, name, at in items:
            if name == point and at == step and item not in fired:
                if action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if action == "hang":
                    time.sleep(600)
                fired.add(item)
                raise RuntimeError(f"injected fault at {point} {step}")

    return fault


def main(argv: list[str]) -> int:
    from revffn import cli
    from revffn.training import loop

    spec, *train_args = argv
    loop.run = functools.partial(loop.run, fault=parse_fault(spec))  # what `revffn train` calls
    return cli.main(["train", *train_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

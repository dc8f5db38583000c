"""`revffn train` under `max_restarts` whose restarted attempts try to take the run lock themselves (run by
tests/training/test_run_lock.py):

    LOCK_PROBE_OUT=FILE python tests/training/lock_probe_run.py 'kill@step:2' key=value ...

In every attempt after the first, after its first optimizer step (the fault hook, told its attempt), a second
`RunLock` on the output directory is tried, as another process starting there would; the outcome ("held by pid N
..." or "taken") goes to $LOCK_PROBE_OUT, and the supervising process's pid beside it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from revffn.errors import UserError
from revffn.training.setup import RunLock
from tests.training import fault_run


def _probing(parse_fault):
    def parse(spec: str):
        inner = parse_fault(spec)

        def fault(point: str, step: int, restart: int) -> None:
            if restart and point == "step" and not Path(os.environ["LOCK_PROBE_OUT"]).exists():
                try:
                    RunLock(OUTPUT_DIR[0]).acquire()
                    outcome = "taken"
                except UserError as e:
                    outcome = str(e)
                Path(os.environ["LOCK_PROBE_OUT"]).write_text(f"{os.getppid()}\n{outcome}\n")
            inner(point, step, restart)

        return fault

    return parse


OUTPUT_DIR: list[Path] = []  # the run's output_dir (from the command line's overrides)


if __name__ == "__main__":
    OUTPUT_DIR.append(Path(next(a.split("=", 1)[1] for a in sys.argv[2:] if a.startswith("output_dir="))))
    fault_run.parse_fault = _probing(fault_run.parse_fault)
    sys.exit(fault_run.main(sys.argv[1:]))

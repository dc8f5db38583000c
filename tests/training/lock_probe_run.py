"""`revffn train` under `max_restarts` whose restarted attempts try to take the run lock themselves (run by
tests/training/test_run_lock.py):

    LOCK_PROBE_OUT=FILE python tests/training/lock_probe_run.py 'kill@step:2' key=value ...

In every attempt after the first (REVFFN_RESTART_COUNT > 0), just after the model is built, a second `RunLock` on the
output directory is tried, as another process starting there would; the outcome ("held by pid N ..." or "taken")
goes to $LOCK_PROBE_OUT, and the supervising process's pid beside it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from revffn.errors import UserError
from revffn.training import loop
from revffn.training.setup import RunLock
from tests.training import fault_run


def _probing(build_run):
    def wrapped(cfg, *args, **kwargs):
        run = build_run(cfg, *args, **kwargs)
        if int(os.environ.get("REVFFN_RESTART_COUNT", "0")):
            try:
                RunLock(Path(cfg.output_dir)).acquire()
                outcome = "taken"
            except UserError as e:
                outcome = str(e)
            Path(os.environ["LOCK_PROBE_OUT"]).write_text(f"{os.getppid()}\n{outcome}\n")
        return run

    return wrapped


if __name__ == "__main__":
    loop.build_run = _probing(loop.build_run)
    sys.exit(fault_run.main(sys.argv[1:]))

"""The real bench worker with rank 1 joining the process group `LATE_S` seconds after rank 0 has begun to (a file
named by `$REVFFN_TEST_JOINING` is the signal), as a rank whose imports end later would: rank 0 waits at least that
long in the rendezvous, and none of it may count as start-up (`load_s`).

    python -m tests.reports.late_rank_worker ARGS_JSON      as `python -m revffn.reports.workers.bench`
"""

import os
import sys
import time
from pathlib import Path

from revffn.reports.workers import bench as worker

LATE_S = 3.0
_rendezvous = worker.rendezvous


def _late_rendezvous(strategy, device, timeout_s):
    signal = Path(os.environ["REVFFN_TEST_JOINING"])
    if strategy == "none":
        pass
    elif os.environ.get("RANK") == "0":
        signal.touch()
    else:
        while not signal.exists():
            time.sleep(0.01)
        signal.unlink()  # (the next method's rank 0 signals anew)
        time.sleep(LATE_S)
    return _rendezvous(strategy, device, timeout_s)


if __name__ == "__main__":
    worker.rendezvous = _late_rendezvous  # what `measure` joins with
    sys.exit(worker.main())

"""The real bench worker with its `dora` run made to fail mid-measurement (an injected RuntimeError in
its first optimizer step), to check that a failed method becomes an error row and the others go on.

    python -m tests.reports.fault_worker ARGS_JSON      as `python -m revffn.reports.workers.bench`
"""

import json
import sys

from revffn.reports.workers import bench as worker

FAILING = "dora"


def _failing_step(run, step, *args, **kwargs):
    raise RuntimeError(f"injected fault in the {run.cfg.method} worker at step {step}")


if __name__ == "__main__":
    if json.loads(sys.argv[1])["method"] == FAILING:
        worker.train_step = _failing_step  # what `measure` steps with
    sys.exit(worker.main())

"""The real study worker (`revffn.reports.workers.study`) with every `lora` run made to fail, to
exercise how `revffn study` reports a failed run (the test points `WORKER_MODULE` here).

    python -m tests.reports.faulty_study_worker JOB.json [JOB.json ...]
"""

import sys

from revffn.reports.workers import study as worker

_run_job = worker.run_job


def run_job(job: dict, baseline: int) -> dict:
    if job["method"] == "lora":
        raise RuntimeError("injected fault in lora")
    return _run_job(job, baseline)


if __name__ == "__main__":
    worker.run_job = run_job  # main() looks it up at call time
    worker.main(sys.argv[1:])

"""A stand-in for `revffn.reports.workers.bench` (no imports, instant) to exercise how the bench
parent handles workers that die, print garbage, hang, or succeed.

    python -m tests.reports.fake_worker ARGS_JSON      behaviour chosen by args["method"]
"""

import json
import os
import signal
import sys
import time

args = json.loads(sys.argv[1])
method = args["method"]
if method == "full":  # killed (as by the kernel's OOM killer)
    os.kill(os.getpid(), signal.SIGKILL)
elif method == "lora":  # no JSON line, a traceback on stderr, exit 1
    print("warming up...")
    print("Traceback (most recent call last):\nRuntimeError: boom", file=sys.stderr)
    sys.exit(1)
elif method == "dora":  # hangs past --timeout
    time.sleep(60)
else:  # a successful row, after some noise on stdout
    print("some library chatter")
    print(json.dumps({"method": method, "status": "ok", "peak_mem_bytes": 3 * 2**20, "tokens_per_s": 100.0,
                      "activation_bytes": 2**20, "routing_record_bytes": 64, "param_bytes": 1000, "grad_bytes": 1000,
                      "optimizer_state_bytes": 2000, "trainable_params": 250, "threads": 1, "wall_s": 0.1}))

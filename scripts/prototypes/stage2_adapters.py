"""Prototype (issue 23, forgetting in stage 2): does training the adapters in stage 2 cause RevFFN's extra forgetting?

One study run of RevFFN on `commas` (the real-base plan: 60 steps x 8, lr 3e-5, retention on 32 documents of the
manual, the 76 probes) from a converted SmolLM2 directory, with the adapters (skips, unfolded P_down) trained as
today or frozen at their calibrated / healed values (`revffn.train_adapters: false`).

    [STREAMS=float32|float64] OMP_NUM_THREADS=1 python scripts/prototypes/stage2_adapters.py CONVERTED_DIR OUT \
        {trained,frozen} [LR] [STEPS]

STREAMS forces revffn.stream_dtype (default: the method's, auto since stop 46): the stream dtype's effect on stage 2.
"""

import json
import os
import sys
from pathlib import Path

from revffn.reports import study
from revffn.reports.workers import study as worker

src, out, variant = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
lr = float(sys.argv[4]) if len(sys.argv) > 4 else 3e-5
steps = int(sys.argv[5]) if len(sys.argv) > 5 else 60
out.mkdir(parents=True, exist_ok=True)
if not (out / "converted").exists():
    (out / "converted").symlink_to(src.resolve())
plan = study.plan_for(False, "builtin:smollm2", steps=steps)
options = {**plan.options("revffn"), "train_adapters": variant == "trained",
           **({"stream_dtype": os.environ["STREAMS"]} if os.environ.get("STREAMS") else {})}
job = study._job(plan, out, "revffn", "commas", 0, lr, eval_val=False, options=options, gap_init=variant == "trained")
job["name"] = job["name"] + "-" + variant + os.environ.get("STREAMS", "")
job["run_dir"] = str(out / "runs" / job["name"])
result = worker.run_job(job, worker.current_rss_bytes())
keep = ("converted_retention_loss", "converted_probe_accuracy", "retention_loss", "probe_accuracy",
        "test_exact_match", "tokens_per_s", "peak_mem_bytes")
print(json.dumps({"variant": variant, "lr": lr, "steps": steps, "streams": os.environ.get("STREAMS", "auto"),
                   **{k: result.get(k) for k in keep}}))

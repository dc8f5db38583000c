"""The quickstart with each optimizer option: final eval loss against AdamW's, same steps and data.

    python scripts/optimizer_quality.py --out runs/optimizers --docs docs/optimizers.md --jobs 2

Each row is one `revffn train` (the built-in quickstart: `builtin:base`, RevFFN, 200 steps x 16 on
`commas_train`, eval loss on `commas_test`) in a fresh process with one torch thread, plus the
overrides of the row. The bf16 rows train bf16 weights (CPU autocast off: the weights are bf16), with
and without torchao's stochastic rounding, against the fp32 reference. JSON in OUT/optimizers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROWS = [  # label, overrides
    ("adamw (reference)", []),
    ("adamw, in-backward", ["optimizer_in_backward=true"]),
    ("adamw8bit", ["optimizer=adamw8bit"]),
    ("adamw8bit, in-backward", ["optimizer=adamw8bit", "optimizer_in_backward=true"]),
    ("adamw4bit", ["optimizer=adamw4bit"]),
    ("adafactor, lr 1e-3", ["optimizer=adafactor"]),
    ("adafactor, lr 1e-2", ["optimizer=adafactor", "learning_rate=1e-2"]),
    ("adafactor, lr 1e-2, in-backward", ["optimizer=adafactor", "learning_rate=1e-2", "optimizer_in_backward=true"]),
    ("bf16 weights, adamw", ["dtype=bfloat16"]),
    ("bf16 weights, adamw + stochastic rounding", ["dtype=bfloat16", "bf16_stochastic_round=true"]),
]


def run_row(label: str, overrides: list[str], out: Path) -> dict:
    run_dir = out / label.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "").replace("+", "plus")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "revffn", "train", f"output_dir={run_dir}", "overwrite=true",
                           *overrides], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"label": label, "overrides": overrides, "status": "error", "error": proc.stderr[-600:], "wall_s": wall}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    return {"label": label, "overrides": overrides, "status": "ok", "final_eval_loss": evals[-1],
            "final_train_loss": rows[-1]["loss"], "peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows),
            "wall_s": round(wall, 1)}


def render(data: dict) -> str:
    ref = next(r for r in data["rows"] if r["label"] == "adamw (reference)")["final_eval_loss"]
    lines = ["# Optimizer options on the quickstart", "", f"Regenerate: `{data['command']}`", "",
             f"{data['wall_s'] / 60:.1f} min, {data['jobs']} run(s) at a time, one torch thread each; git "
             f"{data['git']}. Every row: the built-in quickstart (`revffn train`, RevFFN on `builtin:base`, 200 "
             "steps x 16 of `commas_train`, LR 1e-3 unless given), final eval loss on `commas_test`; target: "
             "within 1.25x AdamW's.", "",
             "| optimizer | overrides | final eval loss | ÷ AdamW | within 1.25x | wall s |",
             "|---|---|---:|---:|---|---:|"]
    for r in data["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['label']} | `{' '.join(r['overrides'])}` | error | | | |")
            continue
        ratio = r["final_eval_loss"] / ref
        lines.append(f"| {r['label']} | `{' '.join(r['overrides']) or '-'}` | {r['final_eval_loss']:.4f} | "
                     f"{ratio:.3f} | {'yes' if ratio <= 1.25 else 'no'} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--docs", default=None)
    ap.add_argument("--jobs", type=int, default=2)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda r: run_row(*r, out), ROWS))
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    data = {"command": "python scripts/optimizer_quality.py " + " ".join(sys.argv[1:]), "rows": rows,
            "wall_s": round(time.perf_counter() - t0, 1), "jobs": args.jobs, "git": git}
    (out / "optimizers.json").write_text(json.dumps(data, indent=1) + "\n")
    if args.docs:
        Path(args.docs).write_text(render(data))
        Path(args.docs).with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    print(render(data))


if __name__ == "__main__":
    main()

"""Host memory of a run against the size of its data, streamed (`streaming: true`) and loaded whole: one fresh
`revffn train` process per row count and mode, its own peak RSS (`revffn.memory.measure.peak_rss_bytes`, written
at exit: not `os.wait4`'s ru_maxrss, which starts from the parent's size), the same tiny model and steps for every
row.

    python scripts/stream_memory.py --rows 20000,200000,2000000 --whole-up-to 200000 --out docs/streaming.json

Each row count writes a parquet file of that many alpaca examples (about 70 characters each, every one
distinct; row groups of ROW_GROUP rows) into a scratch directory, then trains `tiny-qwen2-moe` for `--steps` steps
on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROW_GROUP = 10_000  # rows per parquet row group: a stream decodes one group at a time (hub files: 10k-100k rows)
WORDS = "red cat sun rope ink tea map owl fig jam kit log mud net oak pan rag sky tin urn van web yak zip".split()


def write_parquet(path: Path, n: int) -> None:
    import datasets

    def rows():
        for i in range(n):
            words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(4 + i % 5)]
            yield {"instruction": f"Example {i}: put commas between: {' '.join(words)}", "output": ", ".join(words)}

    datasets.Dataset.from_generator(rows).to_parquet(str(path), batch_size=ROW_GROUP)


# `revffn train` ARGS in this process, its peak RSS written at exit to the file named first
PEAK_AT_EXIT = ("import atexit, pathlib, sys; from revffn.cli import main; from revffn.memory.measure import "
                "peak_rss_bytes; out = pathlib.Path(sys.argv.pop(1)); "
                "atexit.register(lambda: out.write_text(str(peak_rss_bytes()))); raise SystemExit(main(sys.argv[1:]))")


def train(data: Path, out: Path, streaming: bool, steps: int) -> dict:
    peak = out.with_name(out.name + ".peak")
    cmd = [sys.executable, "-c", PEAK_AT_EXIT, str(peak), "train", "model=tiny-qwen2-moe", f"data={data}",
           "eval_data=null", f"output_dir={out}", f"max_steps={steps}", "save_steps=0", "logging_steps=5",
           "max_seq_length=64", "per_device_train_batch_size=8", "dtype=float32", "device=cpu",
           f"streaming={str(streaming).lower()}", "revffn.adapter_init=coordinate", "revffn.adapter_warmup_steps=0"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    err = proc.communicate()[1]
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return {"peak_rss_bytes": int(peak.read_text()), "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="20000,200000")
    ap.add_argument("--whole-up-to", type=int, default=200000, help="load whole (streaming: false) up to this many "
                    "rows too: tokenizing 2M rows up front takes longer than the stream's whole run")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("docs/streaming.json"))
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.rows.split(",")]:
            data = Path(tmp) / f"rows{n}.parquet"
            write_parquet(data, n)
            for streaming in (True, False) if n <= args.whole_up_to else (True,):
                r = {"rows": n, "streaming": streaming, "parquet_bytes": data.stat().st_size,
                     **train(data, Path(tmp) / f"run-{n}-{streaming}", streaming, args.steps)}
                print(json.dumps(r), flush=True)
                results.append(r)
    args.out.write_text(json.dumps({"command": f"python scripts/stream_memory.py --rows {args.rows} --whole-up-to "
                                               f"{args.whole_up_to}",
                                    "steps": args.steps, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()

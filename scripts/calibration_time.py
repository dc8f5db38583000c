"""Calibration time at a real geometry: seconds per layer per 1M calibration tokens.

    python scripts/calibration_time.py --model qwen1.5-moe-a2.7b --layers 2 --tokens 4096 \
        --out docs/calibration_time.json

Builds the config-only geometry with `--layers` decoder layers (random weights: the fit's cost does
not depend on them), converts it, and runs the calibrated init (`conversion.calibrate.calibrate`, the
default sequential mode) on `--tokens` random token ids in rows of 128. The time scales linearly in
tokens and in layers (each layer's passes are single-layer passes over the kept layer inputs), so
the figure is wall_s / layers / tokens × 1M. Threads: torch's default (all cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from revffn.conversion.calibrate import calibrate
from revffn.conversion.convert import convert
from revffn.data.calibration import SEQ_LEN, row_batches
from revffn.memory.measure import peak_rss_bytes
from revffn.models.loading import build_hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen1.5-moe-a2.7b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", default=None, help="write the JSON result here too")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    hf = build_hf(args.model, dtype=dtype, seed=0, num_hidden_layers=args.layers)
    model = convert(hf, adapter_init="calibrated")
    build_s = time.perf_counter() - t0
    vocab = hf.config.vocab_size
    rows = torch.randint(0, vocab, (args.tokens // SEQ_LEN, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    report = calibrate(model, row_batches(rows, batch_size=8))
    per_layer_per_m = report["wall_s"] / args.layers / rows.numel() * 1e6
    result = {"model": args.model, "layers": args.layers, "tokens": int(rows.numel()), "dtype": args.dtype,
              "hidden_size": hf.config.hidden_size, "calibrate_wall_s": report["wall_s"],
              "s_per_layer_per_1M_tokens": round(per_layer_per_m, 1),
              "accumulator_bytes": report["accumulator_bytes"], "kept_bytes": report["kept_bytes"],
              "build_s": round(build_s, 1), "peak_rss_bytes": peak_rss_bytes(),
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "cores": os.cpu_count(), "torch": torch.__version__,
              "command": "python scripts/calibration_time.py " + " ".join(
                  f"--{k} {v}" for k, v in vars(args).items() if v is not None)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Where a training step's memory peak comes from: torch.profiler's memory timeline of one step, by category.

    python scripts/memory_timeline.py --method revffn --seq 512                 # the bench's act-heavy profile
    python scripts/memory_timeline.py --method ckpt --seq 2048 --set optimizer_in_backward=true
    python scripts/memory_timeline.py --out docs/memory_timeline.json           # the page's set, a process each

Builds the bench's model (tiny-qwen2-moe, 16 layers, hidden 256, batch 4, fp32, CPU, one thread) with the bench's
own `train_config` / `build_run` / `train_step`, takes one step to settle the optimizer state, profiles the next
with `profile_memory=True`, and prints the bytes alive at the step's peak by torch's categories (parameters,
optimizer state, gradients, activations, temporaries, autograd detail) and where in the step the peak falls.
Allocations made before the profiled step (the weights, AdamW's moments) appear as preexisting. The figures in
docs/benchmarks.md ("Where RevFFN's peak is") come from this script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

from revffn.models.loading import build_hf
from revffn.reports.bench import train_config
from revffn.training.setup import pick_device
from revffn.training.step import build_run, train_step

# column 1 + i of the coalesced timeline holds the category whose index is i (None: no category)
NAMES = {i + 1: (c.name.lower() if c is not None else "uncategorized") for c, i in _CATEGORY_TO_INDEX.items()}


def timeline(method: str, seq: int, overrides: list[str], layers: int = 16, hidden: int = 256, batch: int = 4) -> dict:
    torch.set_num_threads(1)
    cfg = train_config({"model": "tiny-qwen2-moe", "method": method, "device": "cpu", "dtype": "float32",
                        "model_config": {"num_hidden_layers": layers, "hidden_size": hidden}, "set": overrides})
    device, weights, autocast = pick_device(cfg)
    hf = build_hf(cfg.model, weights, cfg.seed, device, **cfg.model_config)
    run = build_run(cfg, device, weights, autocast, hf=hf)
    ids = torch.randint(3, hf.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    first = run.method.steady_state_step()
    train_step(run, first, [data])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        train_step(run, first + 1, [data])
    times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline("cpu")
    totals = [sum(s) for s in sizes]
    peak = max(range(len(totals)), key=totals.__getitem__)
    return {"method": method, "seq": seq, "set": overrides, "peak_mib": round(totals[peak] / 2**20, 1),
            "peak_at": round((times[peak] - times[0]) / max(times[-1] - times[0], 1), 3),
            "at_peak_mib": {NAMES[i]: round(v / 2**20, 1) for i, v in enumerate(sizes[peak]) if v and i in NAMES},
            "trainable_params": sum(p.numel() for p in run.params if p.requires_grad)}


# docs/benchmarks.md's set: revffn's checkpointing, RevFFN (the buffered default), and both with the optimizer stepped
# in backward
PAGE_SET = [("ckpt", []), ("revffn", []), ("ckpt", ["optimizer_in_backward=true"]),
            ("revffn", ["optimizer_in_backward=true"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--method", default="revffn")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", help="run PAGE_SET at --seq, a fresh process each, and write the JSON list here")
    args = ap.parse_args()
    if not args.out:
        print(json.dumps(timeline(args.method, args.seq, args.set)))
        return
    rows = []
    for method, extra in PAGE_SET:
        cmd = [sys.executable, __file__, "--method", method, "--seq", str(args.seq)] + [f"--set={x}" for x in extra]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

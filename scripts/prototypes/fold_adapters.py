"""Prototype (issue 24): fold RevFFN's full-width P_down adapters into the branches' last linear maps for stage 2.

    python scripts/prototypes/fold_adapters.py                 # ckpt, revffn, revffn folded at seq 512 and 2048
    python scripts/prototypes/fold_adapters.py --seq 2048 --set revffn.recompute_chunk_tokens=1024

At full stream width F(X_2) = P_a Attn(X_2) + S_a X_2 and G(Y_1) = P_m MoE(Y_1) + S_m Y_1. Attn ends in o_proj and
the MoE in each expert's (and the shared expert's) down projection, so P_a and P_m can be multiplied into them
(W <- P W) at the start of joint training: the same function, 2 d^2 fewer trainable parameters a layer (their
gradients and AdamW moments) and two fewer d x d matmuls per token in the forward, the recompute and the backward.
The skips S stay (they read the stream, not the branch). Stage 1 (the heal) still trains P, so a real build folds
at the stage boundary.

Each configuration runs in a fresh process through the bench's own worker (`revffn.reports.workers.bench.run`:
the same model, batch, timing and peak-RSS accounting as `revffn bench`, with the bench's allocator setting);
the folded one patches `build_run` to fold after building and rebuild AdamW over what is left. Prints one JSON
row per configuration and checks the fold is exact (loss of one forward, before and after).
Model: tiny-qwen2-moe (qwen2_moe's o_proj, fused experts.down_proj, shared_expert.down_proj) only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

PROFILE = {"model": "tiny-qwen2-moe", "model_config": {"num_hidden_layers": 16, "hidden_size": 256}, "batch": 4,
           "steps": 3, "dtype": "float32", "device": "cpu", "seed": 0, "threads": 1, "nproc": 1,
           "distributed": "none"}


def fold(model) -> None:
    """W <- P W for each block's attention output and expert/shared-expert down projections; P_down removed."""
    import torch
    from torch import nn

    class Identity(nn.Module):  # F and G read p_down's weight dtype
        def __init__(self, like):
            super().__init__()
            self.register_buffer("weight", torch.empty(0, dtype=like.dtype), persistent=False)

        def forward(self, x):
            return x

    with torch.no_grad():
        for block in model.blocks:
            layer, pa, pm = block.base_layer, block.p_down_attn.weight, block.p_down_moe.weight
            layer.self_attn.o_proj.weight.copy_(pa @ layer.self_attn.o_proj.weight)
            layer.mlp.experts.down_proj.copy_(torch.einsum("ij,ejk->eik", pm, layer.mlp.experts.down_proj))
            layer.mlp.shared_expert.down_proj.weight.copy_(pm @ layer.mlp.shared_expert.down_proj.weight)
            block.p_down_attn, block.p_down_moe = Identity(pa), Identity(pm)


def one(args: dict) -> dict:
    import torch

    from revffn.reports.workers import bench
    from revffn.training.optim import build_optimizer

    baseline = bench.current_rss_bytes()
    if args.pop("fold", False):
        build = bench.build_run

        def build_folded(cfg, device, *a, **kw):
            run = build(cfg, device, *a, **kw)
            ids = torch.randint(3, run.hf.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                before = run.model(ids, labels=ids).loss_sum
                fold(run.model)
                after = run.model(ids, labels=ids).loss_sum
            run.params = run.method.optimizer_parameters(run.model)
            run.optimizer = build_optimizer(cfg, run.params, getattr(run.model, "partial_gradients", None))
            print(json.dumps({"fold_rel_loss_change": abs(float(after - before)) / abs(float(before))}),
                  file=sys.stderr)
            return run

        bench.build_run = build_folded
    return bench.run(args, baseline)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--one", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(json.loads(a.one))))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # the bench's ALLOC_ENV
    for seq in a.seq:
        for method, fold_it in (("ckpt", False), ("revffn", False), ("revffn", True)):
            sets = [*a.set, "revffn.adapter_init=coordinate"] if method == "revffn" else list(a.set)
            job = {**PROFILE, "method": method, "seq": seq, "set": sets, "fold": fold_it}
            out = subprocess.run([sys.executable, __file__, "--one", json.dumps(job)], env=env, text=True,
                                 capture_output=True, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            extra = [ln for ln in out.stderr.splitlines() if ln.startswith("{")]
            print(json.dumps({"seq": seq, "method": method + (" folded" if fold_it else ""), "sets": a.set,
                              "status": row["status"], "peak_mib": round((row.get("peak_mem_bytes") or 0) / 2**20, 1),
                              "tokens_per_s": round(row.get("tokens_per_s") or 0, 1),
                              "step_times_s": [round(t, 2) for t in row.get("step_times_s", [])],
                              "trainable_params": row.get("trainable_params"), "error": row.get("error"),
                              **(json.loads(extra[-1]) if extra else {})}), flush=True)


if __name__ == "__main__":
    main()

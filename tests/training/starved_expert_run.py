"""`revffn train` under torchrun where expert 0 of every MoE layer receives no token on rank 1 (run
by tests/training/test_distributed.py):

    torchrun --nproc-per-node 2 tests/training/starved_expert_run.py key=value ...

On rank 1, a hook on each router sends the tokens routed to expert 0 to the last expert instead. The
rank then produces no gradient from expert 0's tokens; DDP must still complete its buckets (the fused
3-D expert tensors get a gradient, zero in expert 0's rows), neither hanging nor erroring. Rank 1
writes "CALLS TOKENS" to $STARVED_OUT: the router calls it hooked, the tokens expert 0 saw there.
"""

from __future__ import annotations

import os
import sys

import torch

from revffn.cli import main
from revffn.training import loop

seen = [0, 0]  # router calls hooked on this rank; tokens routed to expert 0 there, after the hook


def _starve(router, inputs, out):
    logits, weights, indices = out
    indices = torch.where(indices == 0, router.num_experts - 1, indices)
    seen[0] += 1
    seen[1] += int((indices == 0).sum())
    return logits, weights, indices


def _build_run(*args, _build=loop.build_run, **kwargs):
    run = _build(*args, **kwargs)
    if torch.distributed.get_rank() == 1:
        routers = [m for m in run.model.modules() if type(m).__name__.endswith("TopKRouter")]
        assert routers, "no router found"
        for r in routers:
            r.register_forward_hook(_starve)
    return run


if __name__ == "__main__":
    loop.build_run = _build_run
    code = main(["train", "", *sys.argv[1:]])
    if os.environ.get("RANK") == "1":
        with open(os.environ["STARVED_OUT"], "w") as f:
            f.write(f"{seen[0]} {seen[1]}")
    raise SystemExit(code)

"""Under torchrun (2 ranks, gloo): `build_run` under FSDP2 with sharded loading (the model built on the meta
device, each rank reading its own rows) and with the model loaded whole on every rank; writes, from rank 0,
each parameter's largest difference between the two (all-gathered), whether their buffers are equal, which
route each build took, which experts' tensors each rank read from the checkpoint, and which of them it read for
transformers' converter (the others straight into its shards).

    torchrun --nproc-per-node 2 tests/models/sharded_load_run.py OUT.json MODEL METHOD [KEY=VALUE ...]
"""

from __future__ import annotations

import json
import re
import sys

import torch

from revffn.models import sharded as sharded_loading
from revffn.models.loading import load_hf
from revffn.training.config import load_config
from revffn.training.parallel import init_distributed
from revffn.training.step import build_run


def full_state(model) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in model.named_parameters()}


def main(out: str, model: str, method: str, *extra: str) -> None:
    cfg = load_config(None, [f"model={model}", f"method={method}", "dtype=float32", "device=cpu",
                             "distributed=fsdp", "output_dir=/nonexistent", *extra])
    device = torch.device("cpu")
    init_distributed("fsdp", device, 120)
    read, converted = set(), set()
    whole_read, read_into = sharded_loading._read, sharded_loading._Stored.read_into

    def expert(key: str, into: set) -> None:
        if m := re.search(r"\.experts\.(\d+)\.", key):
            into.add(int(m.group(1)))

    def counted(where, *args, **kwargs):  # the experts whose tensors this rank reads whole, for transformers' converter
        for keys in where.values():
            for k in keys:
                expert(k, read)
                expert(k, converted)
        return whole_read(where, *args, **kwargs)

    def counted_into(stored, key, dest, rows=None):  # or straight into its shards
        expert(key, read)
        return read_into(stored, key, dest, rows)

    sharded_loading._read, sharded_loading._Stored.read_into = counted, counted_into
    sharded = build_run(cfg, device, strategy="fsdp")
    sharded_loading._read, sharded_loading._Stored.read_into = whole_read, read_into
    experts, by_converter = [None, None], [None, None]
    torch.distributed.all_gather_object(experts, sorted(read))
    torch.distributed.all_gather_object(by_converter, sorted(converted))
    from torch.distributed.tensor import DTensor

    routes = {"loading": sharded.loading, "dtensors": all(isinstance(p, DTensor) for p in sharded.model.parameters())}
    one = full_state(sharded.model)
    whole = build_run(cfg, device, hf=load_hf(cfg.model, dtype=torch.float32, **cfg.model_config), strategy="fsdp")
    routes["whole"] = whole.loading
    other = full_state(whole.model)
    if torch.distributed.get_rank() == 0:
        diff = {k: (one[k] - other[k]).abs().max().item() if one[k].numel() else 0.0 for k in other}
        buffers = dict(whole.model.named_buffers())
        json.dump({"keys_equal": sorted(one) == sorted(other), "diff": diff, "routes": routes, "experts_read": experts,
                   "experts_converted": by_converter,
                   "buffers_equal": all(torch.equal(b, buffers[k]) for k, b in sharded.model.named_buffers()),
                   "bitwise": all(torch.equal(one[k], other[k]) for k in other)}, open(out, "w"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])

"""Data parallelism over torchrun's processes: the strategy, the process group, DDP and FSDP2.

    torchrun --nproc-per-node N -m revffn train CONFIG distributed=ddp|fsdp

`pick_distributed` reads the `distributed` key (and `auto` from torchrun's environment) and refuses
what a strategy cannot run exactly. `init_distributed` joins the process group: NCCL on CUDA, gloo
on CPU, with `distributed_timeout`, so a hung collective ends in an error (`CollectiveTimeout`).

- `ddp`: every rank holds the whole model and optimizer; the step's forward goes through a
  `DDPModel` wrapper (`forward_module`), rebuilt whenever the trainable set changes, since DDP
  registers only the parameters that require grad when it is built.
- `fsdp`: FSDP2 `fully_shard` on the method's units (`Method.fsdp_units`: the decoder layers, or
  for RevFFN the modules F and G call) and then on the whole model (the root: embeddings, final
  norm, head). Parameters, gradients and optimizer states are sharded over the ranks; a unit's
  parameters are all-gathered in its pre-forward hook and its gradients reduce-scattered after its
  backward. The reversible stack works under it because F and G call every unit through
  `__call__`, in the no-grad forward and in the backward's recompute alike.

In both, each rank steps its share of the global batch and the gradients are averaged over ranks
(`training.step` scales each rank's loss to make that the global batch's gradient).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from datetime import timedelta

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from revffn.data.collate import data_shard
from revffn.errors import UserError
from revffn.memory.estimate import FSDP_OPTIMIZERS
from revffn.methods import Method, method_class

STRATEGIES = ("ddp", "fsdp")


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than `distributed_timeout` for the other ranks."""


def launched_world() -> int:
    """torchrun's WORLD_SIZE (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_distributed(cfg, method: type[Method] | None = None) -> str:
    """"none", "ddp" or "fsdp": the `distributed` key, `auto` read from torchrun's environment (DDP
    when WORLD_SIZE > 1). Refuses what the strategy cannot run exactly: a method not built for it
    (`Method.DISTRIBUTED`), parameters stepped in backward (the hooks would step before the
    gradients are averaged), gradients moved to the host as they are made (`optimizer_offload`),
    restarts inside the process (torchrun restarts the ranks instead), and under FSDP the torchao
    optimizers (tested only unsharded)."""
    world = launched_world()
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if cfg.distributed in STRATEGIES and not launched:
        raise UserError(f"distributed: {cfg.distributed} needs the processes torchrun starts (no RANK/WORLD_SIZE "
                        "in the environment). Fix: torchrun --nproc-per-node N -m revffn train CONFIG "
                        f"distributed={cfg.distributed}, or distributed=none for one process.")
    if cfg.distributed == "none" and world > 1:
        raise UserError(f"distributed: none, but torchrun started {world} processes, which would each train and "
                        "write the same run. Fix: distributed=ddp or fsdp (or auto), or --nproc-per-node 1.")
    mode = "ddp" if cfg.distributed == "auto" and world > 1 else cfg.distributed
    if mode not in STRATEGIES:
        return "none"
    check_strategy(cfg, mode, method)
    return mode


def check_strategy(cfg, mode: str, method: type[Method] | None = None) -> None:
    """Refuse (UserError) a config that `mode` ("ddp" or "fsdp") cannot run exactly; `pick_distributed`
    and the bench (`--nproc`, before it launches anything) ask the same questions."""
    method = method or method_class(cfg.method)
    if mode not in method.DISTRIBUTED:
        ok = " or ".join(method.DISTRIBUTED) or "no strategy"
        raise UserError(f"distributed: {mode} cannot train method {cfg.method!r} ({method.DISTRIBUTED_NOTE}); it runs "
                        f"under {ok}. Fix: train it in one process (distributed=none, no torchrun), or choose "
                        "another method or strategy.")
    if cfg.optimizer_in_backward:
        raise UserError(f"optimizer_in_backward: true steps each parameter in backward, before {mode} averages its "
                        "gradient over the ranks. Fix: optimizer_in_backward=false, or train in one process.")
    if cfg.max_restarts:
        raise UserError(f"max_restarts: {cfg.max_restarts} restarts the job inside one process; under torchrun "
                        "the ranks restart together instead. Fix: max_restarts=0 and torchrun --max-restarts N "
                        "(a restarted job resumes from the last checkpoint).")
    if cfg.optimizer_offload != "none":
        raise UserError(f"optimizer_offload: {cfg.optimizer_offload} moves each gradient to the host as soon as it "
                        f"is computed, before {mode} averages it over the ranks. Fix: optimizer_offload=none "
                        "(sharding with distributed=fsdp saves more), or train in one process.")
    if mode == "fsdp" and (cfg.optimizer not in FSDP_OPTIMIZERS or cfg.bf16_stochastic_round):
        raise UserError(f"distributed: fsdp shards the optimizer state of optimizer=adamw or adafactor only (got "
                        f"optimizer={cfg.optimizer}, bf16_stochastic_round={cfg.bf16_stochastic_round}). Fix: "
                        "optimizer=adamw (or adafactor) without stochastic rounding, or distributed=ddp.")


def init_distributed(mode: str, device: torch.device, timeout_s: int) -> None:
    """Join torchrun's process group (once per process): NCCL on CUDA, gloo on CPU."""
    dist = torch.distributed
    if mode == "none" or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    # torchrun's store outlives a restart (--max-restarts), with the addresses the killed ranks published
    # in it: each attempt keeps its keys apart (pytorch/pytorch#135712)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout, rank=rank,
                            world_size=world, store=dist.PrefixStore(f"revffn/attempt-{attempt}/", store))


def is_main_process() -> bool:
    """Rank 0, or the only process: the one that writes the run's files and shows the bar."""
    return data_shard()[0] == 0


def barrier() -> None:
    """Wait for every rank (data-parallel only)."""
    if data_shard()[1] > 1:
        torch.distributed.barrier()


def max_over_ranks(value: int, device: torch.device) -> int:
    if data_shard()[1] == 1:
        return value
    t = torch.tensor(value, dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t)


def is_timeout(error: BaseException) -> bool:
    """Whether `error` is a collective that gave up waiting (gloo and NCCL word it differently)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text)


class DDPModel(DistributedDataParallel):
    """DDP whose missing attributes are the wrapped model's (`model.hf`, `model.spec`, ...), so a
    method's `forward` uses the wrapper as it would the model, and calling it syncs the gradients."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)


def shard_model(model: nn.Module, units: list[nn.Module], device: torch.device,
                materialize: Callable[[nn.Module], None] | None = None) -> None:
    """FSDP2: `fully_shard` each unit, then the whole model (the root: what no unit holds). The
    model may still be on the host: each rank moves only its shards to `device`. A model built on the meta
    device is given its shards' memory and values by `materialize` (`models.sharded`), once sharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (data_shard()[1],))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if materialize is not None:
        materialize(model)
    # FSDP2 makes the first module whose forward runs the root. The heal's sampler and teacher call
    # units before the model's own forward: initialize now, with the model as the root.
    model._get_fsdp_state()._lazy_init()
    # FSDP2 reduce-scatters a unit's gradient after the backward of each of its calls and reshards it: a
    # branch recomputed by chunks calls its units once per chunk, and the chunks' sum is lost (measured:
    # 3.6e-2 off one process in tests/training/test_distributed.py). Each branch is recomputed whole.
    if getattr(model, "recompute_chunk_tokens", 0):
        model.recompute_chunk_tokens = 0
    # FSDP2 warns when a unit returns a view (an in-place op on it would skip the unit's pre-backward
    # hook). The MoE blocks return a reshape of their output; revffn adds to it out of place only.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unshard_root(model: nn.Module) -> None:
    """All-gather the root's parameters (embeddings, final norm, head) until its backward reshards
    them: a method may call those modules directly (the heal's teacher and sampler), outside the
    root's forward, where FSDP2 would otherwise gather them."""
    if is_sharded(model):
        model.unshard()


def gather_full(model: nn.Module, keep: bool) -> None:
    """FSDP2, at the end of a run: every sharded parameter all-gathered (a collective, in module
    order on every rank) and, where `keep` (rank 0), put back in its module as a plain parameter on
    the host, so the method's `export` sees an ordinary model. Other ranks only take part."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for module in model.modules():  # the root stays gathered after a forward (the final eval's)
        if isinstance(module, FSDPModule):
            module.reshard()
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if isinstance(p, DTensor):
                full = p.full_tensor()
                if keep:
                    module._parameters[name] = nn.Parameter(full.to("cpu", copy=True), requires_grad=p.requires_grad)
                del full

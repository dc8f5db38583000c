"""One optimizer step, the same for the training loop, the bench worker and the method tests.

    run = build_run(cfg, device, weights_dtype, autocast_dtype, model_config=...)
    result = train_step(run, step, micro_batches)

`build_run` builds what a run steps: the method, its prepared model (train mode, on the device) and
AdamW over the method's `optimizer_parameters`. `train_step` is one optimizer step of `revffn train`:

    method.restructure(model, step)                 # e.g. RevFFN folds its adapters at stage 2 (`restructure`)
    stage = method.set_trainable(step)
    lr    = lr_at(method.schedule_position(step), method.schedule_length(max_steps), ...)
    micro_batches = method.step_batches(step)       # the task's, or what the method's stage trains on
    for each micro-batch:  output, extra = method.forward(...) under autocast
        loss = loss_sum / n_total  (+ extra / n_micro)  (+ aux_loss_coef * aux_loss / n_micro when the router trains)
        loss.backward()
    clip to max_grad_norm (0 disables), optimizer step, zero_grad(set_to_none=True), method.after_step
    (optimizer_in_backward: each parameter was clipped and stepped by its gradient hook in backward)

`n_total` counts the predicted tokens of all micro-batches, so accumulating gives the gradient of
one big batch.

Data-parallel (`Run.strategy`, torchrun, `training.parallel`): each rank steps its share of the
global batch. Under DDP the forward goes through a `DistributedDataParallel` wrapper of `run.model`
(`forward_module`, handed to `Method.forward`; everything else uses `run.model` itself), built at
the first step and again whenever the set of parameters that require grad changes (RevFFN's stage
boundary), since DDP registers only those at construction; micro-batches before the last skip the
all-reduce (`no_sync`). Under FSDP `run.model` is sharded (`parallel.shard_model`, before the
optimizer is built over the shards) and each unit reduce-scatters its gradients after its backward.
Both average the gradients over ranks: `n_total` is all-reduced to the global count and each rank
divides its token-loss sum by `n_total / world`, so the average is the gradient of the global batch,
as one process would compute it. `extra` and the router aux loss stay per rank (averaged over ranks,
as they are over micro-batches). The step's `loss_sum` and token counts are global sums, on every rank.

Hooks let the bench measure inside the step without a copy of it: `forward_context`
wraps each forward (the saved-tensor log), `after_backward` runs before clipping (gradient bytes).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from revffn.data.collate import data_shard
from revffn.methods import Method, method_class
from revffn.methods.base import TokenSum
from revffn.models.loading import load_hf
from revffn.models.sharded import (
    check_loaded,
    conversion,
    load_shards,
    mark_unloaded,
    materialize,
    meta_hf,
    parameter_slots,
    sharded_loadable,
)
from revffn.training.config import TrainConfig
from revffn.training.optim import InBackward, Offloaded, build_optimizer, drop_parameters, set_lr
from revffn.training.parallel import DDPModel, shard_model, unshard_root
from revffn.training.schedule import lr_at


@dataclass
class Run:
    """What one training run steps."""

    cfg: TrainConfig
    method: Method
    hf: nn.Module  # the HF model `method.prepare` was given (its config: the geometry)
    model: nn.Module  # the prepared model, in train mode, on `device`
    params: list[nn.Parameter]  # method.optimizer_parameters(model): all the optimizer holds
    optimizer: torch.optim.Optimizer
    device: torch.device
    autocast: Callable[[], AbstractContextManager]  # a fresh autocast context per forward (none in fp32)
    strategy: str = "none"  # "none" | "ddp" | "fsdp": data-parallel over the torch.distributed group
    ddp: DDPModel | None = None  # the forward's wrapper of `model` under DDP (`forward_module`)
    ddp_trainable: frozenset = frozenset()  # ids of the parameters `ddp` was built to reduce
    loading: str = "whole"  # "whole": every process loaded the model; "sharded": each rank read its shards only

    @property
    def distributed(self) -> bool:
        return self.strategy != "none"


@dataclass
class StepResult:
    stage: str  # what method.set_trainable returned
    lr: float
    loss_sum: torch.Tensor  # () fp32 on the device: summed token losses of all micro-batches (no host sync)
    n_tokens: int  # predicted tokens (labels != -100) of all micro-batches
    n_inputs: int  # input tokens (attention_mask) of the micro-batches the step trained on
    grad_norm: torch.Tensor  # total norm before clipping
    aux_loss: torch.Tensor | None  # the last micro-batch's router aux loss, detached


def build_run(cfg, device: torch.device, weights_dtype: torch.dtype = torch.float32,
              autocast_dtype: torch.dtype | None = None, hf: nn.Module | None = None,
              model_config: dict | None = None, strategy: str | None = None, resuming: bool = False,
              method_cls: type[Method] | None = None) -> Run:
    """Seed, build the HF model (unless given), prepare it with the method, build the optimizer.

    Under FSDP, for a method that prepares a model without weights (`Method.prepares_on_meta`) and a checkpoint
    directory (`models.sharded.sharded_loadable`), the model is built and prepared on the meta device, sharded, and
    each rank reads only its shards (`Run.loading` "sharded"); then `Method.after_load` (RevFFN's adapters).

    Args:
        hf: the HF model to fine-tune; None loads `cfg.model` as training does (`load_hf`, or shard by shard).
        model_config: HF config overrides for that load (default `cfg.model_config`; the loop adds
            the tokenizer's vocabulary for tiny presets, see `setup.model_overrides`).
        strategy: "none", "ddp" or "fsdp" (`parallel.pick_distributed`); None: ddp when a process
            group is up, else none.
        resuming: a checkpoint is loaded next (`Method.resuming`: RevFFN does not calibrate).
        method_cls: the method's class when already looked up (`RunPlan.method`); None: `method_class(cfg.method)`.
    """
    torch.manual_seed(cfg.seed)
    if strategy is None:
        strategy = "ddp" if torch.distributed.is_available() and torch.distributed.is_initialized() else "none"
    method = (method_cls or method_class(cfg.method))(cfg)
    method.resuming = resuming
    overrides = cfg.model_config if model_config is None else model_config
    on_meta = hf is None and strategy == "fsdp" and method.prepares_on_meta() and sharded_loadable(cfg.model,
                                                                                                   overrides)
    if on_meta:  # built and converted without weights, sharded, then each rank reads its own shards
        hf = meta_hf(cfg.model, weights_dtype, **overrides)
        slots, mapping = parameter_slots(hf), conversion(hf)  # the HF model's names, before `prepare` moves them
    elif hf is None:
        hf = load_hf(cfg.model, dtype=weights_dtype, seed=cfg.seed, **overrides)
    model = method.prepare(hf)

    pending: list[str] = []  # the parameters the checkpoint does not hold: `after_load` sets them

    def read_shards(sharded: nn.Module) -> None:  # each rank its own rows, one layer of the checkpoint at a time
        materialize(sharded, device)
        pending[:] = mark_unloaded(sharded, slots, load_shards(slots, hf.config, cfg.model, weights_dtype, mapping))

    if strategy == "fsdp":  # each rank's shards on the device: moved there, or (`read_shards`) allocated there
        shard_model(model, method.fsdp_units(model), device, read_shards if on_meta else None)
        for frozen in method.frozen_copies():  # e.g. a teacher copy: sharded like the model, not whole per rank
            shard_model(frozen, method.fsdp_units(frozen), device)
    model = model.to(device)
    gather = strategy == "fsdp" and method.after_load_runs_model()
    if gather:  # the method may call the root's modules (embeddings, final norm, head) directly
        unshard_root(model)
    method.after_load(model)  # e.g. RevFFN's adapters, built on meta: their init and calibration
    if gather:
        model.reshard()
    if on_meta:
        check_loaded(model, pending)
    model.train()
    params = method.optimizer_parameters(model)
    autocast = functools.partial(torch.autocast, device.type, dtype=autocast_dtype) if autocast_dtype \
        else contextlib.nullcontext
    optimizer = build_optimizer(cfg, params, getattr(model, "partial_gradients", None))
    return Run(cfg, method, hf, model, params, optimizer, device, autocast, strategy,
               loading="sharded" if on_meta else "whole")


def restructure(run: Run, step: int) -> None:
    """The method's change of the model's structure before `step` (`Method.restructure`: RevFFN folds its P_down
    adapters at stage 2); the parameters it removed leave `run.params` and the optimizer, states included."""
    removed = run.method.restructure(run.model, step)
    if removed:
        ids = {id(p) for p in removed}
        run.params = [p for p in run.params if id(p) not in ids]
        drop_parameters(run.optimizer, removed)


def forward_module(run: Run) -> nn.Module:
    """The module the step's forward calls: `run.model`, or under DDP its wrapper for the parameters
    that require grad now. Every parameter that requires grad must get a gradient in every backward
    (`find_unused_parameters=False`: with the reversible stack's nested backward, the only exact
    setup); an MoE expert that got no token has one, zero, in the fused expert tensors. The wrapper
    broadcasts rank 0's parameters and buffers when built: every rank holds the same. Under FSDP the
    root is all-gathered first (`parallel.unshard_root`)."""
    if run.strategy == "fsdp":
        unshard_root(run.model)
    if run.strategy != "ddp":
        return run.model
    trainable = frozenset(id(p) for p in run.model.parameters() if p.requires_grad)
    if run.ddp is None or trainable != run.ddp_trainable:
        ids = [run.device.index] if run.device.type == "cuda" else None
        run.ddp = DDPModel(run.model, device_ids=ids, find_unused_parameters=False)
        if hasattr(run.model, "partial_gradients"):  # a chunked recompute's partial gradients fire no hook
            run.model.partial_gradients.hookless = True
        run.ddp_trainable = trainable
    return run.ddp


def train_step(run: Run, step: int, micro_batches: list[dict],
               forward_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
               after_backward: Callable[[], None] | None = None) -> StepResult:
    """One optimizer step at 0-based `step` over `micro_batches` (dicts of input_ids, attention_mask,
    labels; CPU tensors in the loop, so counting tokens needs no device sync).

    Args:
        forward_context: entered around each forward, inside autocast (the bench logs saved tensors).
        after_backward: called once after the last backward, before clipping (the bench counts grads).
    """
    restructure(run, step)
    cfg, method, model, optimizer = run.cfg, run.method, run.model, run.optimizer
    stage = method.set_trainable(model, step, optimizer)
    lr = lr_at(method.schedule_position(step), method.schedule_length(cfg.max_steps), cfg.learning_rate,
               cfg.warmup_steps, cfg.lr_scheduler_type, cfg.min_lr_ratio)
    set_lr(optimizer, lr)
    forward_model, world = forward_module(run), data_shard()[1]
    micro_batches = method.step_batches(model, step, micro_batches)
    n_total = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro_batches)
    n_inputs = sum(int(m["attention_mask"].sum()) for m in micro_batches)
    if run.distributed:  # the global batch's counts
        counts = torch.tensor([n_total, n_inputs], device=run.device)
        torch.distributed.all_reduce(counts)
        n_total, n_inputs = counts.tolist()
    loss_sum = torch.zeros((), device=run.device)
    for i, mb in enumerate(micro_batches):
        mb = {k: v.to(run.device, non_blocking=True) for k, v in mb.items()}
        last = i + 1 == len(micro_batches)
        with forward_model.no_sync() if run.strategy == "ddp" and not last else contextlib.nullcontext():
            with run.autocast(), forward_context():
                out, extra = method.forward(forward_model, mb, step)
            loss = out.loss_sum / (max(n_total, 1) / world)
            if isinstance(extra, TokenSum):
                loss = loss + extra.value / (max(n_inputs, 1) / world)
            elif extra is not None:
                loss = loss + extra / len(micro_batches)
            if out.aux_loss is not None and out.aux_loss.requires_grad:
                loss = loss + model.aux_loss_coef * out.aux_loss / len(micro_batches)
            loss.backward()
        loss_sum += out.loss_sum.detach().float()
    if run.distributed:
        torch.distributed.all_reduce(loss_sum)
    if after_backward is not None:
        after_backward()
    if isinstance(optimizer, InBackward):  # stepped and clipped per parameter during backward
        grad_norm = optimizer.grad_norm()
    elif isinstance(optimizer, Offloaded):  # the large parameters' gradients are on the host by now
        grad_norm = optimizer.clip_grad_norm(cfg.max_grad_norm)
    else:
        trainable = [p for p in run.params if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm if cfg.max_grad_norm > 0
                                                   else float("inf"))
        if hasattr(grad_norm, "full_tensor"):  # FSDP: the sharded gradients' norm, a DTensor
            grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    method.after_step(step, model, optimizer)
    aux = out.aux_loss.detach() if out.aux_loss is not None else None
    return StepResult(stage, lr, loss_sum, n_total, n_inputs, grad_norm, aux)

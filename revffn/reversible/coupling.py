"""Reversible coupling and the autograd Function that trains a stack of blocks without activations.

Each block maps two half-width streams (X_1, X_2) to (Y_1, Y_2):

    Y_1 = X_1 + F(X_2)
    Y_2 = X_2 + G(Y_1)

and is inverted exactly by

    X_2 = Y_2 - G(Y_1)
    X_1 = Y_1 - F(X_2)

`RevStackFunction.forward` runs all blocks under `no_grad` and saves only the last (Y_1, Y_2),
the compact routing records and, when dropout is active, per-sub-block RNG states.
`RevStackFunction.backward` walks the blocks in reverse; `RevBlock.backward_pass` rebuilds each
block's inputs from its outputs while back-propagating through F and G (minREV's scheme).

`run_stack(..., reversible=False)` is the plain-autograd twin: the same blocks and math, ordinary
backprop. It is the reference for every parity test and the path used for eval and `no_grad`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from revffn.reversible.replay import AutocastState, RNGState, RouterTap


@dataclass
class StackContext:
    """What every sub-block needs besides its stream: shared by all layers of one forward.

    `position_embeddings` (e.g. RoPE's (cos, sin)) and `masks` (one per attention kind) are inputs,
    not activations; they are saved once per step, not per layer. Either may be any pytree of
    tensors (and None): `tensors()` flattens them, with the aux accumulator's tensors at the end.
    """

    position_embeddings: object
    masks: dict[str, torch.Tensor | None]
    autocast: AutocastState
    aux: object | None = None  # a load-balancing accumulator (models.loss.SwitchAux): add/value/surrogate
    needs_rng: bool = False
    replay_routing: bool = True  # False only to demonstrate what replay prevents (tests)
    track_flips: bool = False  # count tokens whose rebuilt top-k differs from the record (debug)
    probe: Callable | None = None  # probe(layer_idx, X_1, X_2): sees every layer's inputs
    stats: dict = field(default_factory=dict)  # filled by RevStackFunction: record bytes/storages, routing flips

    def _inputs(self) -> tuple[list[torch.Tensor | None], TreeSpec]:
        return tree_flatten((self.position_embeddings, self.masks), is_leaf=lambda x: x is None)

    def tensors(self) -> list[torch.Tensor | None]:
        aux = self.aux.tensors() if self.aux is not None else []
        return [*self._inputs()[0], *aux]

    def with_tensors(self, tensors: list[torch.Tensor | None]) -> StackContext:
        """A copy whose tensors are `tensors` (same order as `tensors()`): lets the autograd Function
        keep them in save_for_backward and only plain Python state on ctx."""
        leaves, spec = self._inputs()
        position_embeddings, masks = tree_unflatten(list(tensors[: len(leaves)]), spec)
        aux = self.aux.with_tensors(tensors[len(leaves) :]) if self.aux is not None else None
        return replace(self, position_embeddings=position_embeddings, masks=masks, aux=aux)


class RevBlock(nn.Module):
    """One reversible layer. Subclasses define the sub-blocks `F` and `G`.

    Y_1 = X_1 + F(X_2);  Y_2 = X_2 + G(Y_1).   Inverse: X_2 = Y_2 - G(Y_1);  X_1 = Y_1 - F(X_2).
    """

    layer_idx: int = 0
    router_tap: RouterTap | None = None

    def F(self, X_2: torch.Tensor, sctx: StackContext) -> torch.Tensor:  # noqa: N802
        raise NotImplementedError

    def G(self, Y_1: torch.Tensor, sctx: StackContext) -> torch.Tensor:  # noqa: N802
        raise NotImplementedError

    def forward(self, X_1, X_2, sctx: StackContext, rng: list | None = None):
        if rng is not None:
            rng.append(RNGState.capture(X_2.device))
        f_X_2 = self.F(X_2, sctx)
        Y_1 = X_1 + f_X_2
        if rng is not None:
            rng.append(RNGState.capture(Y_1.device))
        g_Y_1 = self.G(Y_1, sctx)
        Y_2 = X_2 + g_Y_1
        if sctx.aux is not None and self.router_tap is not None and self.router_tap.logits is not None:
            sctx.aux.add(self.router_tap.logits)
        return Y_1, Y_2

    def backward_pass(self, Y_1, Y_2, dY_1, dY_2, sctx: StackContext, rng=None, d_aux=None):
        """Rebuild (X_1, X_2) from (Y_1, Y_2) and back-propagate (dY_1, dY_2) through the block.

        Param grads accumulate into `.grad`. Returns X_1, X_2, dX_1, dX_2.
        """
        with torch.enable_grad():
            Y_1 = Y_1.detach().requires_grad_(True)
            with _maybe_replay(rng, 1):
                g_Y_1 = self.G(Y_1, sctx)
            outputs, grads = [g_Y_1], [dY_2]
            if d_aux is not None and self.router_tap is not None and self.router_tap.logits is not None:
                outputs.append(sctx.aux.surrogate(self.router_tap.logits, d_aux))
                grads.append(None)
            torch.autograd.backward(outputs, grads)
        with torch.no_grad():
            X_2 = Y_2 - g_Y_1
            del g_Y_1, outputs  # G's output; its graph was freed by backward()
            dY_1 = dY_1 + Y_1.grad
            Y_1.grad = None

        with torch.enable_grad():
            X_2.requires_grad_(True)
            with _maybe_replay(rng, 0):
                f_X_2 = self.F(X_2, sctx)
            torch.autograd.backward(f_X_2, dY_1)
        with torch.no_grad():
            X_1 = Y_1.detach() - f_X_2
            del f_X_2  # F's output
            dX_2 = dY_2 + X_2.grad
            X_2.grad = None
        return X_1, X_2.detach(), dY_1, dX_2


def _maybe_replay(rng, i):
    return rng[i].replay() if rng else contextlib.nullcontext()


class RevStackFunction(torch.autograd.Function):
    """Autograd over the whole stack: saves (Y_1, Y_2) and the compact records, nothing per layer."""

    @staticmethod
    def forward(ctx, X_1, X_2, blocks, sctx: StackContext, *params):
        layout = []  # per block: (n_routing_records, n_rng_tensors, rng device)
        records: list[torch.Tensor] = []
        with torch.no_grad():
            for block in blocks:
                rng = [] if sctx.needs_rng else None
                with _recording(block.router_tap) as routing:
                    X_1, X_2 = block(X_1, X_2, sctx, rng)
                rng_tensors = [t for s in (rng or []) for t in s.tensors()]
                layout.append((len(routing), len(rng_tensors), rng[0].device if rng else None))
                records += routing + rng_tensors
            aux = sctx.aux.value() if sctx.aux is not None else X_1.new_zeros(())
        ctx.blocks, ctx.layout = blocks, layout
        ctx.sctx = sctx.with_tensors([None] * len(sctx.tensors()))  # tensors go through save_for_backward
        ctx.n_ctx = len(sctx.tensors())
        sctx.stats["record_bytes"] = sum(t.numel() * t.element_size() for t in records)
        sctx.stats["record_storages"] = {t.untyped_storage().data_ptr() for t in records}
        ctx.save_for_backward(X_1, X_2, *sctx.tensors(), *records)
        return X_1, X_2, aux

    @staticmethod
    def backward(ctx, dY_1, dY_2, d_aux):
        Y_1, Y_2, *rest = ctx.saved_tensors
        sctx = ctx.sctx.with_tensors(rest[: ctx.n_ctx])
        records = rest[ctx.n_ctx :]
        use_aux = sctx.aux is not None and sctx.aux.differentiable
        # split the flat records back into per-block lists
        per_block, i = [], 0
        for n_route, n_rng, dev in ctx.layout:
            routing = records[i : i + n_route]
            rng_t = records[i + n_route : i + n_route + n_rng]
            i += n_route + n_rng
            per_block.append((routing, _unflatten_rng(rng_t, dev)))

        for block, (routing, rng) in zip(reversed(ctx.blocks), reversed(per_block)):
            with _replaying(block.router_tap, routing, sctx):
                Y_1, Y_2, dY_1, dY_2 = block.backward_pass(
                    Y_1, Y_2, dY_1, dY_2, sctx, rng, d_aux if use_aux else None
                )
            if sctx.probe is not None:
                sctx.probe(block.layer_idx, Y_1, Y_2)
        n_params = len(ctx.needs_input_grad) - 4
        return (dY_1, dY_2, None, None, *([None] * n_params))


@contextlib.contextmanager
def _recording(tap: RouterTap | None):
    """The block's routing records (empty without a router)."""
    if tap is None:
        yield []
        return
    with tap.recording() as routing:
        yield routing


@contextlib.contextmanager
def _replaying(tap: RouterTap | None, routing: list[torch.Tensor], sctx: StackContext):
    """Replay the block's routing records; with `sctx.track_flips`, add the would-be flips to
    `sctx.stats["routing_flips"]`. A no-op without a router or with `sctx.replay_routing=False`."""
    if tap is None or not sctx.replay_routing:
        yield
        return
    with tap.replaying(routing, sctx.track_flips) as replay:
        yield
    if sctx.track_flips:
        sctx.stats["routing_flips"] = sctx.stats.get("routing_flips", 0) + int(replay.flips)


def _unflatten_rng(tensors, device):
    if not tensors:
        return None
    if device is None:  # CPU: one state per sub-block
        return [RNGState(t, None, None) for t in tensors]
    return [RNGState(tensors[0], tensors[1], device), RNGState(tensors[2], tensors[3], device)]


def run_stack(blocks, X_1, X_2, sctx: StackContext, reversible: bool):
    """Run `blocks` on the streams; returns (Y_1, Y_2, aux).

    reversible=True uses `RevStackFunction` (O(1) activations in depth); False is the plain twin.
    """
    if reversible:
        params = [p for b in blocks for p in b.parameters() if p.requires_grad]
        return RevStackFunction.apply(X_1, X_2, blocks, sctx, *params)
    for block in blocks:
        if sctx.probe is not None:
            sctx.probe(block.layer_idx, X_1, X_2)
        rng = None
        X_1, X_2 = block(X_1, X_2, sctx, rng)
    aux = sctx.aux.value() if sctx.aux is not None else X_1.new_zeros(())
    return X_1, X_2, aux

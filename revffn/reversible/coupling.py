"""Reversible coupling and the autograd Function that trains a stack of blocks without activations.

Each block maps two half-width streams (X_1, X_2) to (Y_1, Y_2):

    Y_1 = X_1 + F(X_2)
    Y_2 = X_2 + G(Y_1)

and is inverted exactly by

    X_2 = Y_2 - G(Y_1)
    X_1 = Y_1 - F(X_2)

`RevStackFunction.forward` runs all blocks under `no_grad` and saves only the last (Y_1, Y_2),
the compact routing records and the RNG state of each sub-block that drew random numbers.
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
    replay_routing: bool = True  # False only to demonstrate what replay prevents (tests)
    replay_rng: bool = True  # likewise, for the RNG records
    track_flips: bool = False  # count tokens whose rebuilt top-k differs from the record (debug)
    probe: Callable | None = None  # probe(layer_idx, X_1, X_2): sees every layer's inputs
    # filled by RevStackFunction: record_bytes (routing), rng_bytes, rng_sub_blocks [(layer_idx, "F"|"G")],
    # record_storages (routing and RNG: to exclude from activation counts), routing_flips
    stats: dict = field(default_factory=dict)

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
        """Y_1, Y_2. With a list `rng` (the reversible forward), append F's and G's RNG records:
        the `RNGState` from before the sub-block if it drew random numbers, else None."""
        f_X_2 = _watched(self.F, X_2, sctx, rng)
        Y_1 = X_1 + f_X_2
        g_Y_1 = _watched(self.G, Y_1, sctx, rng)
        Y_2 = X_2 + g_Y_1
        if sctx.aux is not None and self.router_tap is not None and self.router_tap.logits is not None:
            sctx.aux.add(self.router_tap.logits)
        return Y_1, Y_2

    def backward_pass(self, Y_1, Y_2, dY_1, dY_2, sctx: StackContext, rng=(None, None), d_aux=None):
        """Rebuild (X_1, X_2) from (Y_1, Y_2) and back-propagate (dY_1, dY_2) through the block.

        `rng`: F's and G's RNG records from the forward (None entries: nothing to replay). Param
        grads accumulate into `.grad`. Returns X_1, X_2, dX_1, dX_2.
        """
        with torch.enable_grad():
            Y_1 = Y_1.detach().requires_grad_(True)
            with _replaying_rng(rng[1]):
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
            with _replaying_rng(rng[0]):
                f_X_2 = self.F(X_2, sctx)
            torch.autograd.backward(f_X_2, dY_1)
        with torch.no_grad():
            X_1 = Y_1.detach() - f_X_2
            del f_X_2  # F's output
            dX_2 = dY_2 + X_2.grad
            X_2.grad = None
        return X_1, X_2.detach(), dY_1, dX_2


def _watched(sub_block, x, sctx: StackContext, rng: list | None):
    """`sub_block(x, sctx)`; with a list `rng`, append its RNG record (`RNGState.used_since`).

    Watching costs two reads of the generator state and one comparison per sub-block: ~10 us on
    CPU (the 5 KB mt19937 state, measured), far below any sub-block's own time; the CUDA state
    adds 16 bytes, read on the host without a device sync.
    """
    if rng is None:
        return sub_block(x, sctx)
    before = RNGState.capture(x.device)
    out = sub_block(x, sctx)
    rng.append(before.used_since())
    return out


def _replaying_rng(state: RNGState | None):
    return state.replay() if state is not None else contextlib.nullcontext()


class RevStackFunction(torch.autograd.Function):
    """Autograd over the whole stack: saves (Y_1, Y_2) and the compact records, nothing per layer.

    Records, per block: the router's top-k indices (`RouterTap`), and for each of F and G the RNG
    state from before it ran, only if it drew random numbers (zero bytes otherwise). Both are
    replayed in backward, so each sub-block is recomputed as the same function it was in forward.
    """

    @staticmethod
    def forward(ctx, X_1, X_2, blocks, sctx: StackContext, *params):
        routing_records: list[torch.Tensor] = []
        rng_records: list[torch.Tensor] = []
        layout = []  # per block: (n_routing_records, RNG slots of F and G or None)
        rng_sub_blocks = []  # (layer_idx, "F" | "G") of the sub-blocks that drew random numbers
        with torch.no_grad():
            for block in blocks:
                rng: list[RNGState | None] = []
                with _recording(block.router_tap) as routing:
                    X_1, X_2 = block(X_1, X_2, sctx, rng)
                layout.append((len(routing), [None if s is None else s.slots() for s in rng]))
                routing_records += routing
                rng_records += [t for s in rng if s is not None for t in s.tensors()]
                rng_sub_blocks += [(block.layer_idx, name) for name, s in zip("FG", rng) if s is not None]
            aux = sctx.aux.value() if sctx.aux is not None else X_1.new_zeros(())
        ctx.blocks, ctx.layout, ctx.n_routing = blocks, layout, len(routing_records)
        ctx.sctx = sctx.with_tensors([None] * len(sctx.tensors()))  # tensors go through save_for_backward
        ctx.n_ctx = len(sctx.tensors())
        sctx.stats["record_bytes"] = _nbytes(routing_records)
        sctx.stats["rng_bytes"], sctx.stats["rng_sub_blocks"] = _nbytes(rng_records), rng_sub_blocks
        sctx.stats["record_storages"] = {t.untyped_storage().data_ptr() for t in routing_records + rng_records}
        ctx.save_for_backward(X_1, X_2, *sctx.tensors(), *routing_records, *rng_records)
        return X_1, X_2, aux

    @staticmethod
    def backward(ctx, dY_1, dY_2, d_aux):
        Y_1, Y_2, *rest = ctx.saved_tensors
        sctx = ctx.sctx.with_tensors(rest[: ctx.n_ctx])
        routing_records = iter(rest[ctx.n_ctx : ctx.n_ctx + ctx.n_routing])
        rng_records = iter(rest[ctx.n_ctx + ctx.n_routing :])
        use_aux = sctx.aux is not None and sctx.aux.differentiable
        per_block = []  # (routing records, [F's, G's RNG state or None])
        for n_routing, slots in ctx.layout:
            rng = [None if s is None else RNGState.from_slots(s, rng_records) for s in slots]
            per_block.append(([next(routing_records) for _ in range(n_routing)],
                              rng if sctx.replay_rng else [None, None]))

        for block, (routing, rng) in zip(reversed(ctx.blocks), reversed(per_block)):
            with _replaying(block.router_tap, routing, sctx):
                Y_1, Y_2, dY_1, dY_2 = block.backward_pass(
                    Y_1, Y_2, dY_1, dY_2, sctx, rng, d_aux if use_aux else None
                )
            if sctx.probe is not None:
                sctx.probe(block.layer_idx, Y_1, Y_2)
        n_params = len(ctx.needs_input_grad) - 4
        return (dY_1, dY_2, None, None, *([None] * n_params))


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


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
        X_1, X_2 = block(X_1, X_2, sctx)
    aux = sctx.aux.value() if sctx.aux is not None else X_1.new_zeros(())
    return X_1, X_2, aux

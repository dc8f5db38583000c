"""Reversible coupling and the autograd Function that trains a stack of blocks without activations.

Each block maps two half-width streams (X_1, X_2) to (Y_1, Y_2):

    Y_1 = X_1 + F(X_2)
    Y_2 = X_2 + G(Y_1)

and is inverted exactly by

    X_2 = Y_2 - G(Y_1)
    X_1 = Y_1 - F(X_2)

`RevStackFunction.forward` runs all blocks under `no_grad` and saves only the last (Y_1, Y_2),
the compact indices of every choice each sub-block made (router top-k, indexer top-k, max ...)
and the RNG state of each sub-block that drew random numbers.
`RevStackFunction.backward` walks the blocks in reverse; `RevBlock.backward_pass` rebuilds each
block's inputs from its outputs while back-propagating through F and G (minREV's scheme). With
`StackContext.recompute_chunk_tokens`, a token-wise G is recomputed and back-propagated by chunks
of token rows, so its working set in backward is one chunk's (`RevBlock.g_token_wise`), and an F
that treats each sequence alone by chunks of whole sequences (`RevBlock.f_batch_wise`).

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

from revffn.reversible.replay import (
    AutocastState,
    RNGState,
    RouterTap,
    SubBlockRecord,
    recording_choices,
    replaying_choices,
)


class PartialGradients:
    """Whether the gradients being accumulated into `.grad` are partial: raised while a chunked recompute
    (`RevBlock`'s chunked G) adds a chunk that more chunks of the same backward will add to.

    One per model (`RevFFNForCausalLM.partial_gradients`), handed to each forward's `StackContext` and to
    what acts on a complete gradient: the optimizer stepped in backward (`training.optim.InBackward`) skips
    a parameter's hook while `active()`, and steps it on the last chunk.

    `hookless` (set under DDP, whose reducer marks a parameter ready at its first gradient hook and refuses
    a second): a partial chunk's parameter gradients are then computed by `torch.autograd.grad` and added
    into `.grad` directly, so that each parameter's hooks fire once, on its last chunk, with the complete
    gradient (`backprop`).
    """

    def __init__(self) -> None:
        self.depth = 0
        self.hookless = False

    @contextlib.contextmanager
    def open(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def active(self) -> bool:
        return self.depth > 0

    def backprop(self, outputs: list, grads: list, x: torch.Tensor, partial: bool) -> torch.Tensor:
        """`torch.autograd.backward(outputs, grads)`, parameter gradients accumulated into `.grad`; returns
        the gradient reaching `x` (a leaf). `partial`: more chunks of this backward will add to the same
        parameters (raised for the in-backward optimizer, or, `hookless`, added without firing a hook)."""
        if partial and self.hookless:
            leaves = [t for t in _graph_leaves(outputs) if t is not x]
            got = torch.autograd.grad(outputs, [x, *leaves], grads, allow_unused=True)
            for leaf, g in zip(leaves, got[1:]):
                if g is not None:
                    leaf.grad = g if leaf.grad is None else leaf.grad + g
            return got[0]
        with self.open() if partial else contextlib.nullcontext():
            torch.autograd.backward(outputs, grads)
        return x.grad


def _graph_leaves(outputs: list) -> list[torch.Tensor]:
    """The leaf tensors that require grad (parameters) in the autograd graph of `outputs`."""
    leaves, seen, todo = {}, set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # AccumulateGrad
            leaves[id(node.variable)] = node.variable
        todo.extend(n for n, _ in node.next_functions)
    return list(leaves.values())


@dataclass
class StackContext:
    """What every sub-block needs besides its stream: shared by all layers of one forward.

    `position_embeddings` (e.g. RoPE's (cos, sin)) and `masks` (one per attention kind) are inputs,
    not activations; they are saved once per step, not per layer. Either may be any pytree of
    tensors (and None): `tensors()` flattens them, with the aux accumulator's tensors at the end.
    With `per_layer_position`, `position_embeddings` is a dict keyed by layer type (RoPE with a
    different theta per layer type) and each block reads its own entry (`for_layer`), as it reads
    its own entry of `masks`.
    """

    position_embeddings: object
    masks: dict[str, torch.Tensor | None]
    autocast: AutocastState
    aux: object | None = None  # a load-balancing accumulator (conversion.loss.SwitchAux): add/value/surrogate/for_rows
    per_layer_position: bool = False  # position_embeddings is {layer type: embeddings}; see for_layer
    replay_routing: bool = True  # replay the recorded choices; False only to show what replay prevents (tests)
    replay_rng: bool = True  # likewise, for the RNG records
    track_flips: bool = False  # count choices the rebuilt input would have changed (debug)
    probe: Callable | None = None  # probe(layer_idx, X_1, X_2): sees every layer's inputs
    recompute_chunk_tokens: int = 0  # rows (of B*T) per chunk of a token-wise G's backward recompute; 0: whole
    cache: object | None = None  # a transformers Cache the token mixers extend (incremental decoding; plain twin only)
    partial: PartialGradients = field(default_factory=PartialGradients)  # raised by a chunked G's backward
    # filled by RevStackFunction: record_bytes (choice indices, router top-k included), rng_bytes,
    # rng_sub_blocks [(layer_idx, "F"|"G")], record_storages (choices and RNG: to exclude from
    # activation counts), routing_flips (choices the rebuilt input would have changed),
    # recompute_chunks {layer_idx: chunks} (the G sub-blocks the backward recomputed by chunks)
    stats: dict = field(default_factory=dict)

    def for_layer(self, position_key: str | None) -> StackContext:
        """The context as a block whose layer type is `position_key` sees it: with per-layer-type
        position embeddings, its own entry (every entry when `position_key` is None); else itself."""
        if not self.per_layer_position or position_key is None:
            return self
        return replace(self, position_embeddings=self.position_embeddings[position_key], per_layer_position=False)

    def batch_rows(self, rows: slice, batch: int, seq: int) -> StackContext | None:
        """The context of a sub-block recomputed on the sequences `rows` of a (batch, seq) stream alone
        (`RevBlock`'s chunked F): each mask and position embedding sliced to those sequences, where its
        leading dim is the batch (a 3-D or 4-D tensor with `batch` leading rows, or the 2-D (batch, seq)
        padding mask) and kept whole where it is 1 (broadcast over the batch). None when a leaf is
        anything else (another shape, a non-tensor mask such as a block mask): then F is recomputed whole."""
        if self.cache is not None or self.per_layer_position:
            return None

        def piece(x):
            if x is None:
                return None
            if not isinstance(x, torch.Tensor):
                raise LookupError
            if x.dim() in (3, 4) and x.shape[0] in (batch, 1):
                return x[rows] if x.shape[0] == batch else x
            if x.dim() == 2 and tuple(x.shape) == (batch, seq):
                return x[rows]
            raise LookupError

        leaves, spec = self._inputs()
        try:
            position_embeddings, masks = tree_unflatten([piece(x) for x in leaves], spec)
        except LookupError:
            return None
        return replace(self, position_embeddings=position_embeddings, masks=masks, aux=None)

    def token_rows(self, rows: slice) -> StackContext:
        """The context of a token-wise sub-block recomputed on the flattened token rows `rows` alone
        (`RevBlock`'s chunked G): the aux accumulator's per-token tensors (its row mask) sliced to
        them. Position embeddings and masks are per token too, but not by rows of B*T: they are left
        out, so a sub-block that reads them (it is not token-wise) fails instead of mixing sizes."""
        aux = self.aux.for_rows(rows) if self.aux is not None else None
        return replace(self, position_embeddings=None, masks={}, aux=aux)

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

    `g_token_wise`: a subclass whose G computes each token from that token alone (an MLP or a
    dropless MoE: no attention, no capacity shared between tokens) sets it, and then lets the
    backward recompute G by chunks of token rows (`StackContext.recompute_chunk_tokens`).
    `f_batch_wise`: likewise for an F that computes each sequence of the batch from that sequence
    alone (attention under per-sequence masks and positions): the backward recomputes it by chunks of
    whole sequences.
    """

    layer_idx: int = 0
    router_tap: RouterTap | None = None
    position_key: str | None = None  # with position embeddings per layer type: this block's entry
    g_token_wise: bool = False
    f_batch_wise: bool = False

    def F(self, X_2: torch.Tensor, sctx: StackContext) -> torch.Tensor:  # noqa: N802
        raise NotImplementedError

    def G(self, Y_1: torch.Tensor, sctx: StackContext) -> torch.Tensor:  # noqa: N802
        raise NotImplementedError

    def forward(self, X_1, X_2, sctx: StackContext, records: list | None = None):
        """Y_1, Y_2. With a list `records` (the reversible forward), append F's and G's
        `SubBlockRecord`: the indices of their choices and, if they drew random numbers, the RNG state."""
        sctx = sctx.for_layer(self.position_key)
        f_X_2 = _watched(self.F, X_2, sctx, records, (self.layer_idx, "F"))
        Y_1 = X_1 + f_X_2
        g_Y_1 = _watched(self.G, Y_1, sctx, records, (self.layer_idx, "G"))
        Y_2 = X_2 + g_Y_1
        logits = self.router_tap.take() if self.router_tap is not None else None
        if sctx.aux is not None and logits is not None:
            sctx.aux.add(logits)
        return Y_1, Y_2

    def first_half(self, X_1, X_2, sctx: StackContext) -> torch.Tensor:
        """Y_1 alone, G not run (calibration: a fit that needs only F's side)."""
        return X_1 + self.F(X_2, sctx.for_layer(self.position_key))

    def inverse(self, Y_1, Y_2, sctx: StackContext, records) -> tuple[torch.Tensor, torch.Tensor]:
        """(X_1, X_2) rebuilt from (Y_1, Y_2) as `backward_pass` rebuilds them (F's and G's `records` replayed),
        without gradients: what `rebuild_errors` compares with the forward's inputs."""
        sctx = sctx.for_layer(self.position_key)
        with torch.no_grad():
            with _replaying(records[1], sctx):
                X_2 = Y_2 - self.G(Y_1, sctx)
            with _replaying(records[0], sctx):
                X_1 = Y_1 - self.F(X_2, sctx)
        return X_1, X_2

    def backward_pass(self, Y_1, Y_2, dY_1, dY_2, sctx: StackContext, records, d_aux=None,
                      owned: tuple[bool, bool, bool, bool] = (False, False, False, False)):
        """Rebuild (X_1, X_2) from (Y_1, Y_2) and back-propagate (dY_1, dY_2) through the block.

        `records`: F's and G's `SubBlockRecord` from the forward, replayed while each is recomputed.
        Param grads accumulate into `.grad`. Returns X_1, X_2, dX_1, dX_2.

        `owned`: which of (Y_1, Y_2, dY_1, dY_2) are buffers no one else reads (`RevStackFunction.backward`:
        the stack's saved outputs, and below the top block every stream; autograd's incoming gradients are
        not). X_1 is then written into Y_1's buffer, X_2 into Y_2's, dX_1 into dY_1's and dX_2 into dY_2's,
        chunk by chunk: with all four owned the block's backward holds its four streams and one chunk's
        working set, two streams fewer than with separate results while G is recomputed, four while F is.
        """
        sctx = sctx.for_layer(self.position_key)
        if dY_2 is None:  # Y_2 reached no loss (autograd's undefined gradient): zero
            dY_2, owned = torch.zeros_like(Y_2), (*owned[:3], True)
        streams = (Y_1, Y_2, dY_1, dY_2)
        owned = tuple(o and t is not None for o, t in zip(owned, streams))
        mine = [t for o, t in zip(owned, streams) if o]
        if not _own_buffers(*mine) or any(_shares_storage(t, [u for u in streams if u is not t]) for t in mine):
            owned = (False,) * 4
        X_2, dY_1 = self._g_backward(Y_1, Y_2, dY_1, dY_2, sctx, records[1], d_aux, owned[1], owned[2])
        X_1, dX_2 = self._f_backward(Y_1, X_2, dY_1, dY_2, sctx, records[0], owned[0], owned[3])
        return X_1, X_2, dY_1, dX_2

    def _f_backward(self, Y_1, X_2, dY_1, dY_2, sctx: StackContext, record: SubBlockRecord,
                    into_y: bool, into_d: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """F(X_2) recomputed and dY_1 back-propagated through it: by chunks of whole sequences where
        `_f_chunks` allows (each chunk as many sequences as fit in `sctx.recompute_chunk_tokens` tokens, at
        least one), so only one chunk's graph is alive at a time, else at once. Returns X_1 = Y_1 - F(X_2)
        and dX_2 = dY_2 + the gradient F passes to X_2 (in Y_1's buffer with `into_y`, dY_2's with `into_d`)."""
        chunks = self._f_chunks(X_2, record, sctx)
        if chunks is None:
            f_X_2, d_f = self._f_recompute(X_2, dY_1, sctx, record)
            return _inverse_step(Y_1, f_X_2, dY_2, d_f, into_y, into_d, keep=(Y_1, X_2, dY_1, dY_2))
        X_1 = Y_1 if into_y else torch.empty_like(X_2)
        dX_2 = dY_2 if into_d else torch.empty_like(X_2)
        for i, (span, chunk_ctx) in enumerate(chunks):  # all but the last add to grads more chunks will add to
            f_X_2, d_f = self._f_recompute(X_2[span], dY_1[span], chunk_ctx, record, partial=i + 1 < len(chunks))
            _write_step(Y_1[span], f_X_2, dY_2[span], d_f, X_1[span], dX_2[span])
        sctx.stats.setdefault("f_recompute_chunks", {})[self.layer_idx] = len(chunks)
        return X_1, dX_2

    def _f_chunks(self, X_2: torch.Tensor, record: SubBlockRecord,
                  sctx: StackContext) -> list[tuple[slice, StackContext]] | None:
        """The chunks of F's recomputation (sequences, and the context sliced to them), or None for the
        whole batch: chunking is asked for and would split (more than `recompute_chunk_tokens` tokens in a
        batch of several sequences); F computes each sequence from that sequence alone (`f_batch_wise`); its
        record is empty (no choice and no random numbers: a chunk would make or draw its own); and every
        mask and position embedding slices by sequence (`StackContext.batch_rows`). Otherwise F is
        recomputed whole, silently."""
        n = sctx.recompute_chunk_tokens
        if not (self.f_batch_wise and n > 0 and X_2.dim() == 3 and X_2.shape[0] > 1 and X_2.shape[:2].numel() > n
                and not record.choices and record.rng is None):
            return None
        B, T = X_2.shape[:2]
        rows = max(1, n // T)
        if rows >= B:
            return None
        spans = [slice(a, min(a + rows, B)) for a in range(0, B, rows)]
        chunks = [(span, sctx.batch_rows(span, B, T)) for span in spans]
        return None if any(c is None for _, c in chunks) else chunks

    def _f_recompute(self, X_2, dY_1, sctx: StackContext, record: SubBlockRecord,
                     partial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """F(X_2) recomputed under `record`'s replay and dY_1 back-propagated through it; param grads
        accumulate into `.grad`. Returns F(X_2) and X_2's gradient, both detached."""
        with torch.enable_grad():
            X_2 = X_2.detach().requires_grad_(True)
            with _replaying(record, sctx):
                f_X_2 = self.F(X_2, sctx)
            grad = sctx.partial.backprop([f_X_2], [dY_1], X_2, partial)
        return f_X_2.detach(), grad

    def _g_backward(self, Y_1, Y_2, dY_1, dY_2, sctx: StackContext, record: SubBlockRecord, d_aux,
                    into_y: bool, into_d: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """G(Y_1) recomputed and dY_2 back-propagated through it: by chunks of
        `sctx.recompute_chunk_tokens` token rows where `_g_splits` allows, so only one chunk's graph
        is alive at a time, else at once. Returns X_2 = Y_2 - G(Y_1) and dY_1 + the gradient G passes
        to Y_1 (that gradient alone when dY_1 is None): in Y_2's buffer with `into_y`, dY_1's with `into_d`.

        Each chunk runs G on rows a..b of the flattened (B*T, width) stream, as a (1, b-a, width)
        sequence, replaying rows a..b of every recorded choice, with the context's per-token tensors
        (the load-balancing row mask) sliced to the rows: the load-balancing surrogate is a sum over
        tokens, so the chunks' surrogates add up to the whole batch's.
        """
        n = sctx.recompute_chunk_tokens
        if not self._g_splits(Y_1, record, n):
            g_Y_1, d_g = self._g_recompute(Y_1, dY_2, sctx, record, d_aux)
            return _inverse_step(Y_2, g_Y_1, dY_1, d_g, into_y, into_d, keep=(Y_1, Y_2, dY_1, dY_2))
        width = Y_1.shape[-1]
        X_2 = Y_2 if into_y else torch.empty_like(Y_2, memory_format=torch.contiguous_format)
        dY_1_out = dY_1 if into_d else torch.empty_like(X_2)
        Y_rows, Y_2_rows, dY_1_rows, dY_2_rows = (None if t is None else t.reshape(-1, width)
                                                   for t in (Y_1, Y_2, dY_1, dY_2))
        X_2_rows, dY_1_out_rows = X_2.view(-1, width), dY_1_out.view(-1, width)
        spans = [slice(a, min(a + n, len(Y_rows))) for a in range(0, len(Y_rows), n)]
        for i, rows in enumerate(spans):  # every chunk but the last adds to parameter grads more will follow
            g, grad = self._g_recompute(Y_rows[None, rows], dY_2_rows[None, rows], sctx.token_rows(rows),
                                        record.rows(rows), d_aux, partial=i + 1 < len(spans))
            _write_step(Y_2_rows[rows], g[0], None if dY_1 is None else dY_1_rows[rows], grad[0],
                        X_2_rows[rows], dY_1_out_rows[rows])
        sctx.stats.setdefault("recompute_chunks", {})[self.layer_idx] = len(spans)
        return X_2, dY_1_out

    def _g_splits(self, Y_1: torch.Tensor, record: SubBlockRecord, n: int) -> bool:
        """Whether G can be recomputed by chunks of `n` token rows, exactly: chunking is asked for and
        would split (0 < n < B*T); G is token-wise (`g_token_wise`); the stream is (B, T, width) with
        T > 1 (with T = 1 a choice on a (B, 1, ...) input would look like one on the flattened rows);
        and G's record splits into rows (`SubBlockRecord.splits_into_rows`: no RNG record, since a
        chunk would draw other numbers than the whole did, and every choice made within the rows).
        Otherwise the block's G is recomputed whole, silently: the same gradients, the larger set."""
        rows = Y_1.shape[:-1].numel()
        return (self.g_token_wise and 0 < n < rows and Y_1.dim() == 3 and Y_1.shape[1] > 1
                and record.splits_into_rows(rows))

    def _g_recompute(self, Y_1, dY_2, sctx: StackContext, record: SubBlockRecord,
                     d_aux, partial: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """G(Y_1) recomputed under `record`'s replay, and dY_2 (with the load-balancing surrogate's
        gradient, given `d_aux` and a router tap) back-propagated through it; param grads accumulate
        into `.grad`. Returns G(Y_1), detached (backward freed its graph), and Y_1's gradient."""
        with torch.enable_grad():
            Y_1 = Y_1.detach().requires_grad_(True)
            with _replaying(record, sctx):
                g_Y_1 = self.G(Y_1, sctx)
            logits = self.router_tap.take() if self.router_tap is not None else None
            outputs, grads = [g_Y_1], [dY_2]
            if d_aux is not None and logits is not None:
                outputs.append(sctx.aux.surrogate(logits, d_aux))
                grads.append(None)
            grad = sctx.partial.backprop(outputs, grads, Y_1, partial)
        return g_Y_1.detach(), grad


def _shares_storage(t: torch.Tensor, others) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(o is not None and o.untyped_storage().data_ptr() == ptr for o in others)


def _owns(buffer: torch.Tensor, other: torch.Tensor, keep) -> bool:
    """Whether `buffer` may take the result of an op with `other`: the same shape and dtype, not a view, and
    no storage shared with a tensor in `keep` (a sub-block's recomputed output or input gradient, which its
    backward has released), so that the backward allocates no stream for the result."""
    return (buffer.shape == other.shape and buffer.dtype == other.dtype and buffer._base is None
            and not _shares_storage(buffer, keep))


def _own_buffers(*streams: torch.Tensor) -> bool:
    """Whether the streams can each take a result in place, row by row: contiguous, not views, all of one shape
    and dtype."""
    return all(t.is_contiguous() and t._base is None and t.shape == streams[0].shape
               and t.dtype == streams[0].dtype for t in streams)


def _write_step(y, f, d, d_f, x_out, d_out) -> None:
    """One chunk of the inverse step: x_out = y - f and d_out = d + d_f (d_f alone when d is None). `x_out`
    may be `y` itself and `d_out` `d` itself (in place) or `f` and `d_f`: the same bits either way. Under
    `no_grad`: the saved outputs require grad, and a double backward (create_graph) runs with grad enabled."""
    with torch.no_grad():
        torch.sub(y, f, out=x_out)
        if d is None:
            if d_out is not d_f:
                d_out.copy_(d_f)
        else:
            torch.add(d_f, d, out=d_out)


def _inverse_step(y, f, d, d_f, into_y: bool, into_d: bool, keep) -> tuple[torch.Tensor, torch.Tensor]:
    """(y - f, d + d_f) for a sub-block recomputed whole: in y's buffer (`into_y`) and d's (`into_d`), else in
    the buffers of its own output f and input gradient d_f where it `_owns` them, else in new ones."""
    x_out = y if into_y else (f if _owns(f, y, keep) else torch.empty_like(y))
    d_out = d if into_d else (d_f if _owns(d_f, y, keep) else torch.empty_like(y))
    _write_step(y, f, d, d_f, x_out, d_out)
    return x_out, d_out


def _watched(sub_block, x, sctx: StackContext, records: list | None, where: tuple[int, str], choices: bool = True):
    """`sub_block(x, sctx)`; with a list `records`, append its `SubBlockRecord`: the indices of the
    choices it made (`recording_choices`; none with `choices=False`) and its RNG record (`RNGState.used_since`).

    Watching the RNG costs two reads of the generator state and one comparison per sub-block (the CPU
    generator's mt19937 state, and the CUDA state, read on the host without a device sync): far below any
    sub-block's own time (docs/engine.md). Recording choices routes every torch call
    of the sub-block through one Python dict lookup (`_Choice.of`).
    """
    if records is None:
        return sub_block(x, sctx)
    before, within_rows = RNGState.capture(x.device), []
    with recording_choices(within_rows) if choices else contextlib.nullcontext([]) as made:
        out = sub_block(x, sctx)
    records.append(SubBlockRecord(where, made, before.used_since(), tuple(within_rows)))
    return out


def _replaying_rng(record: SubBlockRecord, sctx: StackContext):
    """The sub-block's recompute draws the random numbers its forward drew (dropout, router jitter), unless
    `sctx.replay_rng` is off."""
    return record.rng.replay() if record.rng is not None and sctx.replay_rng else contextlib.nullcontext()


@contextlib.contextmanager
def _replaying(record: SubBlockRecord, sctx: StackContext):
    """Recompute a sub-block as the function it was in forward: its RNG state (unless
    `sctx.replay_rng` is off) and its choices (unless `sctx.replay_routing` is off); with
    `sctx.track_flips`, add the choices the rebuilt input would have changed to `stats["routing_flips"]`."""
    with _replaying_rng(record, sctx):
        if not sctx.replay_routing:
            yield
            return
        with replaying_choices(record.choices, sctx.track_flips) as replay:
            yield
    if sctx.track_flips:
        sctx.stats["routing_flips"] = sctx.stats.get("routing_flips", 0) + int(replay.flips)


class RevStackFunction(torch.autograd.Function):
    """Autograd over the whole stack: saves (Y_1, Y_2) and the compact records, nothing per layer.

    Records, per sub-block (F and G of each block): the indices of the index-choosing ops it made
    on values (top-k, sort, max with a dim, ...), and the RNG state from before it ran, only if it
    drew random numbers (zero bytes otherwise). Both are replayed in backward, so each sub-block is
    recomputed as the same function it was in forward.

    The blocks' parameters are not inputs of the Function: their gradients come from the nested
    `torch.autograd.backward` calls of `backward`, which accumulate into `.grad` (and fire each
    parameter's accumulate-grad hooks once, as DDP's reducer and the in-backward optimizer expect).
    Passed as inputs, the Function would also be an edge to every parameter: DDP then sees each one
    ready twice (an error), or with `static_graph` reduces before the nested grads land (silently
    wrong gradients). `anchor` (`run_stack`: a grad-requiring empty tensor) keeps the backward
    reachable when neither stream requires grad (frozen embeddings); its gradient is None.
    """

    @staticmethod
    def forward(ctx, X_1, X_2, blocks, sctx: StackContext, anchor):
        per_block: list[list[SubBlockRecord]] = []  # [F's, G's] record of every block
        with torch.no_grad():
            for block in blocks:
                per_block.append([])
                X_1, X_2 = block(X_1, X_2, sctx, per_block[-1])
            aux = sctx.aux.value() if sctx.aux is not None else X_1.new_zeros(())
        records = [r for block_records in per_block for r in block_records]
        ctx.blocks, ctx.layout = blocks, [[r.layout() for r in block_records] for block_records in per_block]
        ctx.sctx = sctx.with_tensors([None] * len(sctx.tensors()))  # tensors go through save_for_backward
        ctx.n_ctx = len(sctx.tensors())
        choices = [t for r in records for t in r.choices]
        rng = [t for r in records if r.rng is not None for t in r.rng.tensors()]
        sctx.stats["record_bytes"], sctx.stats["rng_bytes"] = _nbytes(choices), _nbytes(rng)
        sctx.stats["rng_sub_blocks"] = [r.where for r in records if r.rng is not None]
        sctx.stats["record_storages"] = {t.untyped_storage().data_ptr() for t in choices + rng}
        ctx.save_for_backward(X_1, X_2, *sctx.tensors(), *(t for r in records for t in r.tensors()))
        ctx.set_materialize_grads(False)  # a stream the loss does not read gets None, not a zero stream
        return X_1, X_2, aux

    @staticmethod
    def backward(ctx, dY_1, dY_2, d_aux):
        Y_1, Y_2, *rest = ctx.saved_tensors
        sctx = ctx.sctx.with_tensors(rest[: ctx.n_ctx])
        saved = iter(rest[ctx.n_ctx :])
        per_block = [[SubBlockRecord.from_layout(x, saved) for x in layouts] for layouts in ctx.layout]
        use_aux = sctx.aux is not None and sctx.aux.differentiable
        # The saved outputs are read by no one else once the graph above the stack has run (a second backward
        # through the same graph, retain_graph=True, then stops on autograd's in-place check); autograd's
        # incoming gradients are not this backward's to overwrite. Below the top block every stream is one of
        # this backward's buffers.
        owned = (True, True, False, False)
        for block, records in zip(reversed(ctx.blocks), reversed(per_block)):
            Y_1, Y_2, dY_1, dY_2 = block.backward_pass(
                Y_1, Y_2, dY_1, dY_2, sctx, records, d_aux if use_aux else None, owned=owned
            )
            owned = (True,) * 4
            if sctx.probe is not None:
                sctx.probe(block.layer_idx, Y_1, Y_2)
        return dY_1, dY_2, None, None, None


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rebuild_errors(blocks, X_1, X_2, sctx: StackContext) -> list[float]:
    """Per block, bottom to top: its inputs as the reversible backward rebuilds them from the top of the stack,
    against the forward's, as max |rebuilt - forward| / max |forward| over both streams.

    The rebuild is exact math; what it reads is rounding, compounded down the stack. Streams whose dtype rounds
    more than the sub-blocks' outputs can absorb drift on a deep model with massive activations (SmolLM2's 30
    layers in fp32: layer 0's input off by 0.59 of its own scale, its gradient 25 % off; docs/engine.md). Keeps
    every block's inputs: a probe for a small batch, not a training path."""
    inputs, records = [], []
    with torch.no_grad():
        for block in blocks:
            inputs.append((X_1, X_2))
            records.append([])
            X_1, X_2 = block(X_1, X_2, sctx, records[-1])
        errors = []
        for block, block_records, (x_1, x_2) in zip(reversed(blocks), reversed(records), reversed(inputs)):
            X_1, X_2 = block.inverse(X_1, X_2, sctx, block_records)
            scale = torch.maximum(x_1.abs().max(), x_2.abs().max()).clamp(min=torch.finfo(torch.float32).tiny)
            err = torch.maximum((X_1 - x_1).abs().max(), (X_2 - x_2).abs().max()) / scale
            errors.append(err.item())
    return errors[::-1]


def run_stack(blocks, X_1, X_2, sctx: StackContext, reversible: bool):
    """Run `blocks` on the streams; returns (Y_1, Y_2, aux).

    reversible=True uses `RevStackFunction` (O(1) activations in depth); False is the plain twin.
    """
    if reversible:
        anchor = torch.empty(0, device=X_1.device, requires_grad=torch.is_grad_enabled())
        return RevStackFunction.apply(X_1, X_2, blocks, sctx, anchor)
    for block in blocks:
        if sctx.probe is not None:
            sctx.probe(block.layer_idx, X_1, X_2)
        X_1, X_2 = block(X_1, X_2, sctx)
    aux = sctx.aux.value() if sctx.aux is not None else X_1.new_zeros(())
    return X_1, X_2, aux

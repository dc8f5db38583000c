"""The buffered coupling: a reversible stack that is the pretrained model to 2^-k, exactly invertible.

The additive coupling (`reversible.coupling`) must approximate each decoder layer with adapters, which a real
30-layer model does not survive (docs/conversion.md). This one keeps every layer whole. Each block's decoder layer
is h -> h + D(h), its update D(h) = F(h) + G(h + F(h)) (the block's attention branch F and MoE branch G with no
adapters: a pre-norm decoder layer exactly). On two streams (v, b), b the hidden state and v a velocity:

    v' = s * lam * v + D(b)        b' = b + v'

the heavy-ball recurrence of Maclaurin et al. (2015), "Gradient-based hyperparameter optimization through
reversible learning": each layer adds its pretrained update plus lam times the last velocity, lam = 0 being the
unconverted model. `sign` s picks the momentum: +1 (`positive`, the default) carries every update on, amplified
by 1 / (1 - lam); -1 (`negative`, the form before stop 50) takes lam times the last update back. The same bits
buy very different fidelity: on SmolLM2-135M-Instruct positive momentum costs +0.003 nats at 4 bits and -0.002
at 6, negative +0.028 and +0.004 (docs/conversion.md). The inverse is b = b' - v', then v = (v' - D(b)) / (s lam),
which in floating point multiplies every layer's rounding by 1/lam (stop 45's scaled coupling: 10^16 after 30
layers). As in MacKay et al. (2018), "Reversible recurrent neural networks", the streams are kept in fixed point
(int64, `FRAC` fraction bits), lam = 2^-k is an arithmetic shift, and the k low bits the shift drops are kept in a
buffer: k bits per coordinate per layer. Then the forward and the inverse are integer arithmetic and the rebuild is
bitwise, at any depth, provided D(b) is recomputed bitwise: from the bitwise input, with the forward's RNG state
(`reversible.replay.RNGState`) and deterministic kernels. The recompute then makes the forward's discrete choices
(router top-k) by itself, so unlike the additive coupling this one records none (`reversible.replay`'s choice records
exist for an input rebuilt only to rounding); a device whose kernels are not deterministic is caught at the bottom of
the stack: `RebuildError`.

The layers read the streams in float32 (`stream_values`; a float64 model's in float64) and their update is put
back on the grid from float32 (`to_fixed`: exact scaling, one rounding), so the fixed-point bookkeeping costs a few
passes over int64 and uint8 tensors a layer, in place where it can.

Memory: two int64 streams (16 bytes per coordinate, as float64 streams) plus k/8 bytes per coordinate per layer, not
flat in depth: at k = 4 a quarter of bf16 checkpoints of every layer input. The plain twin (`run_buffered_stack`,
reversible=False: eval, generation with a KV cache, parity tests) runs the same recurrence on float64 streams, each
snapped to the fixed-point grid (`snap`, with an identity gradient), its layers reading them cast to float32: below
2^21 float64 holds that grid exactly, so the twin computes the reversible forward's values bitwise and its gradients
are the reference for them.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import replace

import torch

from revffn.reversible.coupling import StackContext, _replaying_rng, _watched
from revffn.reversible.replay import SubBlockRecord

FRAC = 32  # fraction bits of the fixed-point streams: resolution 2^-32 (2.3e-10), range +-2^31
LIMIT = 2.0 ** 30  # largest |value| a layer may write; beyond it the int64 streams could overflow
BUFFER_BITS = (1, 2, 3, 4, 5, 6, 7, 8)
# SmolLM2-135M-Instruct, no training, positive momentum: +0.003 nats and 69 of 76 probe answers at 4 bits, -0.002
# and 72 at 6 (the base: 74; the bound, 90 % of it: 67); 6 bits a coordinate a layer are 3/8 of bf16
# checkpoints (docs/conversion.md)
DEFAULT_BUFFER_BITS = 6
# the momentum's sign s (`revffn.buffer_momentum`); directories and runs that predate the key ran `negative`
MOMENTUM_SIGNS = {"positive": 1, "negative": -1}
DEFAULT_MOMENTUM = "positive"


CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's deterministic workspace setting (PyTorch's reproducibility notes)
# What deterministic mode (warn_only) says on CUDA about kernels the rebuild does not depend on: SDPA's flash and
# memory-efficient backward accumulate the gradients with atomics (a gradient's last bits vary from run to run, as in
# any CUDA training; the rebuild needs the forward, and those kernels' forward is deterministic), and histc over float
# input (an MoE's expert ids cast to float to count tokens per expert: whole counts below 2^24 do not depend on the
# order they are added in; transformers' grouped_mm passes int ids on CUDA, which raise nothing). Any other kernel's
# alert still prints, and a recompute that is not bitwise raises `RebuildError`.
QUIET_NONDETERMINISM = (r"(Flash Attention|Memory Efficient attention) defaults to a non-deterministic algorithm",
                        r"_histc_cuda( with floating point input)? does not have a deterministic implementation")


def deterministic_kernels(device: torch.device) -> None:
    """What the bitwise recompute needs of a CUDA device, process-wide: deterministic algorithms (an MoE's index_add_
    accumulates with atomics otherwise; warn_only, so an op without a deterministic kernel warns rather than stops),
    without the NaN-fill of every `torch.empty` that deterministic mode adds (the recompute reads no memory it has
    not written; the fill would slow only the buffered coupling's runs), and cuBLAS's deterministic workspace
    (`CUBLAS_WORKSPACE_CONFIG`, which cuBLAS reads once, at the process's first matmul: `revffn.cli.main` sets it
    at start, before anything runs a model; here it is set for a process that did not start there); the alerts of
    kernels the rebuild does not depend on are not printed (`QUIET_NONDETERMINISM`). Elsewhere nothing to do: CPU
    kernels recompute bitwise."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.use_deterministic_algorithms(True, warn_only=True)
        for message in QUIET_NONDETERMINISM:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        with contextlib.suppress(ImportError):  # torch >= 2.2
            from torch.utils import deterministic

            deterministic.fill_uninitialized_memory = False


class RebuildError(RuntimeError):
    """The stack's inputs did not come back bitwise: a recomputed layer differed from its forward."""


def to_fixed(x: torch.Tensor, scratch: bool = False) -> torch.Tensor:
    """x on the fixed-point grid (round to nearest): computed in x's own dtype when that is float32, bfloat16 or
    float64, whose scaling by 2^FRAC is exact below `LIMIT` and whose rounding to an integer is exact, so the result
    is the float64 computation's bitwise at a third of its traffic; float16 (max 65504) goes through float32.
    `scratch`: x is a temporary the caller drops, scaled and rounded in place (one allocation, the int64 result,
    rather than three: on CPU each large block is a fresh mapping, `reports.bench.ALLOC_ENV`)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float64):
        x, scratch = x.float(), True
    x = x.mul_(2.0 ** FRAC) if scratch else x * 2.0 ** FRAC
    return x.round_().to(torch.int64)


def from_fixed(x: torch.Tensor) -> torch.Tensor:
    """float64 (exact up to 2^21; beyond, rounded alike in forward and backward)."""
    return x.to(torch.float64) * 2.0 ** -FRAC


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a layer reads the streams in: float64 for a float64 model, float32 otherwise (the branches cast
    to their weights' dtype themselves, as an HF layer's float32 residual stream is)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def stream_values(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fixed-point stream x as the layer reads it, in `compute_dtype` `dtype`: one rounding of the exact value
    (the int64 -> float cast rounds once, the scaling by 2^-FRAC is exact), which is the float64 twin's value cast
    to `dtype` wherever float64 holds the grid exactly (below 2^21)."""
    return x.to(dtype).mul_(2.0 ** -FRAC)  # x is int64: `to` copies, the scaling is in place


def snap(x: torch.Tensor, floor: bool = False) -> torch.Tensor:
    """float64 x rounded (or floored, as an arithmetic shift does) to the fixed-point grid, its gradient the
    identity's: the twin's counterpart of `to_fixed` / `>>`."""
    scaled = x * 2.0 ** FRAC
    grid = (torch.floor(scaled) if floor else torch.round(scaled)) * 2.0 ** -FRAC
    return x + (grid - x).detach()


_PLANES = 8  # a packed byte holds one bit of 8 coordinates, one from each eighth of the flattened tensor


def pack_low_bits(a: torch.Tensor, bits: int) -> torch.Tensor:
    """The `bits` low bits of every element of int64 `a`, as `bits` planes of ceil(numel / 8) bytes: byte i of plane
    j holds bit j of the elements i, i + n/8, ..., i + 7n/8 (n rounded up to a multiple of 8), so packing is a few
    passes over contiguous eighths rather than a reduction over groups of 8. Three allocations (the low bytes, the
    planes, one scratch), the rest in place."""
    low = a.reshape(-1).to(torch.uint8)  # the cast keeps the low 8 bits (mod 2^8)
    pad = (-low.numel()) % _PLANES
    if pad:
        low = torch.cat([low, low.new_zeros(pad)])
    eighths = low.view(_PLANES, -1)
    shifts = torch.arange(bits, device=a.device, dtype=torch.uint8)[:, None]
    packed = torch.empty(bits, eighths.shape[1], dtype=torch.uint8, device=a.device)
    bit = torch.empty_like(packed)
    torch.bitwise_right_shift(eighths[0].expand_as(packed), shifts, out=packed).bitwise_and_(1)  # plane j: bit j
    for i in range(1, _PLANES):  # plane j |= bit j of eighth i, at bit position i
        torch.bitwise_right_shift(eighths[i].expand_as(bit), shifts, out=bit)
        packed.bitwise_or_(bit.bitwise_and_(1).bitwise_left_shift_(i))
    return packed


def unpack_low_bits(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The low bits `pack_low_bits` kept, as a uint8 tensor of `shape` (one byte a coordinate, not eight)."""
    shifts = torch.arange(len(packed), device=packed.device, dtype=torch.uint8)[:, None]
    out = torch.empty(_PLANES, packed.shape[1], dtype=torch.uint8, device=packed.device)
    bit = torch.empty_like(packed)
    for i in range(_PLANES):  # eighth i: bit j of it from plane j's bit i
        torch.bitwise_right_shift(packed, i, out=bit)
        torch.sum(bit.bitwise_and_(1).bitwise_left_shift_(shifts), dim=0, dtype=torch.uint8, out=out[i])
    return out.view(-1)[: shape.numel()].view(shape)


def _spans(block, x: torch.Tensor, sctx: StackContext) -> list[tuple[slice | None, StackContext]]:
    """How a layer's update is computed, in forward and again in backward: [(None, sctx)] for the whole batch at
    once, or by chunks of whole sequences of at most `recompute_chunk_tokens` tokens (at least one), each with the
    context sliced to them (masks, position embeddings; the load-balancing row mask for the backward's surrogate).
    Chunks need a layer whose update treats each sequence alone (`f_batch_wise`: per-sequence masks and positions;
    `g_token_wise`) and a context that slices by sequence. The forward runs the same chunks as the backward so that
    the recompute is bitwise (a matmul over fewer rows may round otherwise), with each chunk's own records."""
    whole = [(None, sctx)]
    n = sctx.recompute_chunk_tokens
    if not (block.f_batch_wise and block.g_token_wise and n > 0 and x.dim() == 3 and x.shape[0] > 1
            and x.shape[:2].numel() > n):
        return whole
    B, T = x.shape[:2]
    per = max(1, n // T)
    if per >= B:
        return whole
    spans = []
    for start in range(0, B, per):
        rows = slice(start, min(start + per, B))
        cctx = sctx.batch_rows(rows, B, T)
        if cctx is None:
            return whole
        aux = sctx.aux.for_rows(slice(rows.start * T, rows.stop * T)) if sctx.aux is not None else None
        spans.append((rows, replace(cctx, aux=aux)))
    return spans


def _piece(t: torch.Tensor, rows: slice | None) -> torch.Tensor:
    return t if rows is None else t[rows]


def attention_kernels(device: torch.device):
    """The attention kernels a layer may use on `device`, the same in the forward (no grad, `layer_update`) and in
    the backward's recompute (grad, `invert_layer`): on CUDA, PyTorch's flash, memory-efficient or math SDPA, not
    cuDNN's. PyTorch 2.11+ prefers cuDNN attention on Hopper, whose forward is another execution plan when the
    logsumexp is kept for a backward (so not shown to be bitwise the no-grad one), and whose backward gave NaN with
    an attention mask at some lengths (pytorch/pytorch#196678). Elsewhere nothing changes. On an H100 (stop 58) the
    tiny check rebuilt bitwise under it; not yet a real model."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def layer_update(block, x: torch.Tensor, sctx: StackContext, records: list | None = None) -> torch.Tensor:
    """D(x) = F(x) + G(x + F(x)): the decoder layer's update, its branches as the block runs them, by `_spans`
    (under `attention_kernels`). With `records`, one [F's, G's] `SubBlockRecord` pair a span is appended (the RNG
    state each drew from; no choices). Adds the router's logits to the load-balancing sum."""
    with attention_kernels(x.device):
        return _layer_update(block, x, sctx, records)


def _layer_update(block, x: torch.Tensor, sctx: StackContext, records: list | None) -> torch.Tensor:
    spans = _spans(block, x, sctx)
    d = x if len(spans) == 1 else torch.empty_like(x)
    logits = []
    for rows, cctx in spans:
        recs = [] if records is not None else None
        xr = _piece(x, rows)
        f = _watched(block.F, xr, cctx, recs, (block.layer_idx, "F"), choices=False)
        g = _watched(block.G, xr + f, cctx, recs, (block.layer_idx, "G"), choices=False)
        if block.router_tap is not None:
            logits.append(block.router_tap.take())
        if rows is None:
            d = f + g
        else:  # (not `out=`: the plain twin runs this under autograd)
            d[rows] = f + g
        if records is not None:
            records.append(recs)
    if sctx.aux is not None and logits and logits[0] is not None:
        sctx.aux.add(torch.cat(logits) if len(logits) > 1 else logits[0])
    return d


def invert_layer(block, v: torch.Tensor, b: torch.Tensor, sctx: StackContext, records: list, packed: torch.Tensor,
                 bits: int, sign: int, dtype: torch.dtype, grads: tuple[torch.Tensor, torch.Tensor] | None = None,
                 d_aux=None):
    """In place, the layer's output (v, b) becomes its input: b = b - v, then its update D(b) recomputed span by
    span under each span's records (`_spans`, as the forward ran it) on the stream read in `dtype` (`stream_values`),
    s v = ((v - D(b)) << bits) + the dropped bits.
    With `grads` (g_v, g_b), the gradients w.r.t. the output, back-propagate through the layer (param grads
    accumulate into `.grad`, every span but the last partial, `PartialGradients`; the load-balancing surrogate's
    given `d_aux`) and return those w.r.t. its input, in the same two buffers:

        g_new = g_v + g_b (v' feeds b' = b + v');   g_v <- s lam g_new;   g_b <- g_b + J^T g_new
    """
    b -= v
    low = unpack_low_bits(packed, v.shape)
    if grads is not None:
        g_v, g_b = grads
        g_v += g_b  # g_new
    spans = _spans(block, b, sctx)
    for i, ((rows, cctx), recs) in enumerate(zip(spans, records)):
        at = slice(None) if rows is None else rows
        with torch.enable_grad() if grads is not None else torch.no_grad(), attention_kernels(b.device):
            x = stream_values(b[at], dtype).requires_grad_(grads is not None)
            with _replaying_rng(recs[0], cctx):
                f = block.F(x, cctx)
            with _replaying_rng(recs[1], cctx):
                g = block.G(x + f, cctx)
            logits = block.router_tap.take() if block.router_tap is not None else None
            d = f + g
            if grads is not None:
                outputs, gs = [d], [g_v[at]]
                if d_aux is not None and logits is not None:
                    outputs.append(cctx.aux.surrogate(logits, d_aux))
                    gs.append(None)
                grad = sctx.partial.backprop(outputs, gs, x, partial=i + 1 < len(spans))
                if grad is not None:
                    g_b[at] += grad
        rebuilt = v[at]  # a view: the three steps in place
        rebuilt.sub_(to_fixed(d.detach(), scratch=True)).bitwise_left_shift_(bits).add_(low[at])
    if sign < 0:
        v.neg_()
    if len(spans) > 1:
        sctx.stats.setdefault("recompute_chunks", {})[block.layer_idx] = len(spans)
    if grads is not None:
        g_v *= sign * 2.0 ** -bits
        return g_v, g_b
    return None


def _lose_bits(v: torch.Tensor, bits: int, sign: int) -> torch.Tensor:
    """In place, v becomes s v, the value the layer shifts; returns its `bits` low bits, which the shift drops."""
    if sign < 0:
        v.neg_()
    return pack_low_bits(v, bits)


def _largest(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float64 scalar (NaN if any is), without the temporary of x.abs()."""
    lo, hi = x.aminmax()
    return torch.maximum(-lo.to(torch.float64), hi.to(torch.float64))


def _step(sv: torch.Tensor, b: torch.Tensor, d: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output streams (v', b') from s v (`_lose_bits`), its input b and update d, in place (d used
    up): v' = (s v >> bits) + d, b' = b + v'."""
    v_new = sv.bitwise_right_shift_(bits).add_(to_fixed(d, scratch=True))
    return v_new, b.add_(v_new)


class BufferedStackFunction(torch.autograd.Function):
    """Autograd over the stack on fixed-point streams: saves the top (v, b), each layer's dropped bits and the
    branches' RNG states where they drew. The blocks' parameters are not inputs (their gradients accumulate from the
    nested backward calls, as in `RevStackFunction`); `anchor` keeps the backward reachable when h does not require
    grad."""

    @staticmethod
    def forward(ctx, h, blocks, sctx: StackContext, bits: int, sign: int, anchor):
        records, lost = [], []
        worst = torch.zeros((), dtype=torch.float64, device=h.device)
        with torch.no_grad():
            v, b = torch.zeros(h.shape, dtype=torch.int64, device=h.device), to_fixed(h)
            cdt = compute_dtype(h.dtype)
            for block in blocks:
                lost.append(_lose_bits(v, bits, sign))
                records.append([])
                d = layer_update(block, stream_values(b, cdt), sctx.for_layer(block.position_key), records[-1])
                worst = torch.maximum(worst, _largest(d))
                v, b = _step(v, b, d, bits)
            worst = torch.maximum(worst, _largest(b) * 2.0 ** -FRAC)
            aux = sctx.aux.value() if sctx.aux is not None else h.new_zeros(())
        ctx.shape, ctx.h_dtype, ctx.device = h.shape, h.dtype, h.device
        ctx.diverged = not worst.item() < LIMIT  # one sync a forward; NaN and inf included
        if ctx.diverged:  # beyond the fixed-point range the int64 streams hold garbage: the output is NaN, so the
            # loss is, and the training loop stops as on any diverged run
            return torch.full_like(h, float("nan")), torch.full_like(aux, float("nan"))
        flat = [r for spans in records for pair in spans for r in pair]
        ctx.blocks, ctx.bits, ctx.sign = blocks, bits, sign
        ctx.layout = [[[r.layout() for r in pair] for pair in spans] for spans in records]
        ctx.sctx = sctx.with_tensors([None] * len(sctx.tensors()))
        ctx.n_ctx = len(sctx.tensors())
        # the dropped bits are held by the node itself, not saved: the backward frees each layer's as it rebuilds
        # that layer (save_for_backward would keep them all to the end of the stack's backward, where the step's
        # peak is). Saved-tensor hooks do not see them: `held_bytes` counts them for the measurements.
        ctx.lost = lost
        choices = [t for r in flat for t in r.choices]
        rng = [t for r in flat if r.rng is not None for t in r.rng.tensors()]
        sctx.stats["record_bytes"] = sum(t.numel() * t.element_size() for t in choices)
        sctx.stats["rng_bytes"] = sum(t.numel() * t.element_size() for t in rng)
        sctx.stats["buffer_bytes"] = sctx.stats["held_bytes"] = sum(t.numel() for t in lost)
        sctx.stats["record_storages"] = {t.untyped_storage().data_ptr() for t in choices + rng}  # (the buffer counts)
        ctx.save_for_backward(v, b, *sctx.tensors(), *(t for r in flat for t in r.tensors()))
        ctx.set_materialize_grads(False)
        return from_fixed(b).to(h.dtype), aux

    @staticmethod
    def backward(ctx, d_out, d_aux):
        if ctx.diverged:
            return torch.full(ctx.shape, float("nan"), dtype=ctx.h_dtype, device=ctx.device), *[None] * 5
        v, b, *rest = ctx.saved_tensors
        lost, ctx.lost = ctx.lost, None  # (popped layer by layer below: each freed once its layer is rebuilt)
        sctx = ctx.sctx.with_tensors(rest[: ctx.n_ctx])
        saved = iter(rest[ctx.n_ctx :])
        per_block = [[[SubBlockRecord.from_layout(x, saved) for x in pair] for pair in spans] for spans in ctx.layout]
        use_aux = sctx.aux is not None and sctx.aux.differentiable and d_aux is not None
        # the gradient streams in float32 (float64 for a float64 model), as an ordinary backward accumulates them
        gdt = compute_dtype(ctx.h_dtype)
        g_b = d_out.to(gdt, copy=True) if d_out is not None else torch.zeros(ctx.shape, dtype=gdt, device=v.device)
        g_v = torch.zeros_like(g_b)
        for block, records in zip(reversed(ctx.blocks), reversed(per_block)):
            packed = lost.pop()
            # the saved streams are this backward's own buffers: each layer's input is rebuilt into them
            g_v, g_b = invert_layer(block, v, b, sctx.for_layer(block.position_key), records, packed, ctx.bits,
                                    ctx.sign, gdt, (g_v, g_b), d_aux if use_aux else None)
            if sctx.probe is not None:
                sctx.probe(block.layer_idx, from_fixed(v), from_fixed(b))
        if bool(v.any()):  # v starts at 0: a recompute that was not bitwise leaves it nonzero (x 2^k a layer)
            raise RebuildError("the buffered coupling did not rebuild the stack's input bitwise: a decoder layer "
                               "recomputed in backward differed from its forward (a nondeterministic kernel). Fix: "
                               "torch.use_deterministic_algorithms(True), or revffn.coupling=additive.")
        return g_b.to(ctx.h_dtype), None, None, None, None, None


def run_buffered_stack(blocks, h: torch.Tensor, sctx: StackContext, reversible: bool, bits: int,
                       sign: int = MOMENTUM_SIGNS[DEFAULT_MOMENTUM]):
    """Run `blocks` on the hidden state h (B, T, d); returns (the top b in h's dtype, aux).

    reversible=True uses `BufferedStackFunction` (fixed point, bit buffer); False is the plain twin: the same
    recurrence on float64 streams snapped to the fixed-point grid (`snap`), with ordinary autograd (the reference of
    the parity tests, and eval's path, with a KV cache for decoding)."""
    if reversible:
        anchor = torch.empty(0, device=h.device, requires_grad=torch.is_grad_enabled())
        return BufferedStackFunction.apply(h, blocks, sctx, bits, sign, anchor)
    lam, cdt = sign * 2.0 ** -bits, compute_dtype(h.dtype)
    v, b = torch.zeros(h.shape, dtype=torch.float64, device=h.device), snap(h.to(torch.float64))
    for block in blocks:
        if sctx.probe is not None:
            sctx.probe(block.layer_idx, v, b)
        d = layer_update(block, b.to(cdt), sctx.for_layer(block.position_key))
        v = snap(lam * v, floor=True) + snap(d.to(torch.float64))
        b = b + v
    aux = sctx.aux.value() if sctx.aux is not None else h.new_zeros(())
    return b.to(h.dtype), aux


def buffered_rebuild_errors(blocks, h: torch.Tensor, sctx: StackContext, bits: int,
                            sign: int = MOMENTUM_SIGNS[DEFAULT_MOMENTUM]) -> list[float]:
    """Per block, bottom to top: max |rebuilt - forward| of its fixed-point inputs (v, b), the rebuild as the
    backward runs it (choices replayed), relative to the stream scale: 0.0 wherever the recompute is bitwise."""
    inputs, records, lost = [], [], []
    with torch.no_grad():
        v, b = torch.zeros(h.shape, dtype=torch.int64, device=h.device), to_fixed(h)
        cdt = compute_dtype(h.dtype)
        for block in blocks:
            inputs.append((v.clone(), b.clone()))  # `_lose_bits` and `_step` work in place
            lost.append(_lose_bits(v, bits, sign))
            records.append([])
            d = layer_update(block, stream_values(b, cdt), sctx.for_layer(block.position_key), records[-1])
            v, b = _step(v, b, d, bits)
        errors = []
        for block, recs, packed, (v_0, b_0) in zip(reversed(blocks), reversed(records), reversed(lost),
                                                   reversed(inputs)):
            invert_layer(block, v, b, sctx.for_layer(block.position_key), recs, packed, bits, sign, cdt)
            scale = max(float(b_0.abs().max()), float(v_0.abs().max()), 1.0)
            errors.append(max(float((v - v_0).abs().max()), float((b - b_0).abs().max())) / scale)
    return errors[::-1]

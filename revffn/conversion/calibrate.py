"""Calibrated adapter init: ridge least squares, layer by layer, so the converted streams track the
original model's hidden states in the original coordinates.

For layer l the teacher (the HF layer in its original wiring, `conversion.teacher`) gives

    h_l (layer input),  A_l = Attn(norm(h_l)),  a_l = h_l + A_l,  M_l = MoE(norm(a_l)),  h_{l+1} = a_l + M_l

and the converted block, on its own streams X_1, X_2 (the already calibrated layers below l), is
fitted adapter by adapter. Half-width streams (first half [:h], second half [h:], h = d/2):

    P_up_attn:   X_2                         -> h_l
    P_down_attn: attention output (of F)     -> a_l[:h] - X_1           (so Y_1 tracks a_l[:h])
    P_up_moe:    Y_1                         -> a_l
    P_down_moe:  MoE output (of G)           -> h_{l+1}[h:] - X_2       (so Y_2 tracks h_{l+1}[h:])

Full-width streams have no P_up, and Y_1, Y_2 track the whole a_l and h_{l+1}:

    P_down_attn: attention output (of F)     -> a_l - X_1
    P_down_moe:  MoE output (of G)           -> h_{l+1} - X_2

With the skip adapters (`revffn.adapter_skip`, the default) P_down_attn and P_skip_attn are one fit on
[attention output, X_2], and P_down_moe and P_skip_moe one on [MoE output, Y_1]: the skip lets Y_1 pick
up what the previous MoE wrote into the other half (and Y_2 what the attention wrote), which the
attention and MoE outputs alone cannot predict.

Each fit streams over the calibration batches and accumulates XᵀX and XᵀY (and the targets' squared
norm, for the residual) in fp64: O(d²) per adapter, whatever the number of tokens. Between passes
each batch's layer inputs (h_l, X_1, X_2) are kept on the host for the current layer only (3·d values
per token, never × layers), with the teacher layer's outputs (A_l, h_{l+1}): the teacher runs once
per layer. A pass runs only the side of the block its fit reads (F alone for the attention side), and
the advance to the next layer reuses the last pass's MoE output, so the converted MoE runs once per
layer and so does the teacher's (full width: two passes and an advance per layer). `keep_states=False`
keeps nothing and reruns each batch through layers 0..l-1 instead: memory flat in the tokens, at a
compute cost quadratic in depth. The solve is ridge
with lambda = `ridge` × mean(diag XᵀX).

`mode="sequential"` (default) makes one pass per adapter: each adapter sees the inputs its block
really produces with the adapters fitted before it. `mode="one_pass"` makes one pass per layer and
feeds P_down_attn, P_up_moe and P_down_moe the teacher's quantities (A_l, a_l[:h], M_l) instead;
on `builtin:base` (without skips) it scores 3.02 on `builtin:retention_test` against 2.84 (docs/conversion.md).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

import torch

from revffn.conversion.convert import local_rows, write_full
from revffn.conversion.teacher import teacher_context, teacher_layer

ADAPTERS = ("p_up_attn", "p_down_attn", "p_up_moe", "p_down_moe")  # one fit each (P_down_*: with its skip)
SKIP_OF = {"p_down_attn": "p_skip_attn", "p_down_moe": "p_skip_moe"}
MODES = ("sequential", "one_pass")
Batches = Callable[[], Iterable[tuple[torch.Tensor, torch.Tensor | None]]]  # a fresh iterator per pass


class RidgeFit:
    """Y ≈ X W for a stream of (X, Y) row blocks: XᵀX, XᵀY and ‖Y‖² accumulated in fp64."""

    def __init__(self, d_in: int, d_out: int, device: torch.device):
        kw = dict(dtype=torch.float64, device=device)
        self.xtx, self.xty = torch.zeros(d_in, d_in, **kw), torch.zeros(d_in, d_out, **kw)
        self.yy = torch.zeros((), **kw)
        self.rows = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.xtx, self.xty, self.yy))

    def add(self, X: torch.Tensor, Y: torch.Tensor) -> None:
        """X (n, d_in), Y (n, d_out): rows of one batch (real tokens only)."""
        X, Y = X.double(), Y.double()
        self.xtx += X.T @ X
        self.xty += X.T @ Y
        self.yy += (Y * Y).sum()
        self.rows += X.shape[0]

    def reduce(self, reduce: Callable[[torch.Tensor], None]) -> None:
        """Sum the accumulators over processes (`reduce`: an in-place all-reduce)."""
        rows = torch.tensor(float(self.rows), dtype=torch.float64, device=self.xtx.device)
        for t in (self.xtx, self.xty, self.yy, rows):
            reduce(t)
        self.rows = int(rows.item())

    def solve(self, ridge: float, rows: slice | None = None,
              reduce: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, float]:
        """(W (d_out, d_in): an nn.Linear weight, relative residual ‖XWᵀ - Y‖² / ‖Y‖² on the accumulated rows).

        `rows`: only those rows of W (the outputs a rank's shard of the weight holds, `local_rows`); the residual
        is then this rank's part of it, summed over the ranks by `reduce`. (XᵀX + λI) is factored once (Cholesky)
        and every output solved on its own, so each row equals the one solved with all the others."""
        lam = ridge * self.xtx.diagonal().mean().clamp(min=1e-12)
        A = self.xtx + lam * torch.eye(self.xtx.shape[0], dtype=self.xtx.dtype, device=self.xtx.device)
        B = self.xty if rows is None else self.xty[:, rows]
        L, info = torch.linalg.cholesky_ex(A)
        W = torch.cholesky_solve(B, L) if info.item() == 0 else torch.linalg.solve(A, B)  # (d_in, outputs)
        # ‖XW - Y‖² = ‖Y‖² - 2 Σ W∘XᵀY + Σ W∘(XᵀX W), and XᵀX W = XᵀY - λW
        explained = (W * B).sum() + lam * (W * W).sum()
        if reduce is not None:
            reduce(explained)
        rss = self.yy - explained
        return W.T.contiguous(), float(rss / self.yy.clamp(min=1e-30))


@contextlib.contextmanager
def _capture_inputs(modules: dict[str, torch.nn.Module]):
    """name -> the first positional input of each module's most recent call."""
    seen: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.__setitem__(n, args[0]))
               for n, m in modules.items()]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _capture_outputs(modules: dict[str, torch.nn.Module]):
    """name -> the (first) output of each module's most recent call."""
    seen: dict[str, torch.Tensor] = {}

    def hook(mod, args, out, n):
        seen[n] = out[0] if isinstance(out, tuple) else out

    handles = [m.register_forward_hook(lambda mod, a, o, n=n: hook(mod, a, o, n)) for n, m in modules.items()]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


class _LayerInputs:
    """Per calibration batch, the teacher's h_l and the converted streams X_1, X_2 at the current layer l.

    keep=True holds them on the host, one layer at a time (2·d values per token, never × layers), with the
    teacher layer's outputs (A_l, h_{l+1}, and M_l in one_pass mode: 2·d or 3·d more), computed in the
    layer's first pass and reused by its other passes and the advance: one teacher layer forward per layer
    and batch. keep=False holds nothing and reruns each batch through layers 0..l-1 instead: memory flat in
    the tokens, at l extra layer forwards (teacher and converted) per batch and pass.
    """

    def __init__(self, model, batches: Batches, keep: bool, keep_mlp: bool = True):
        self.model, self.batches, self.keep, self.layer = model, batches, keep, 0
        self.keep_mlp = keep_mlp  # M_l is an input only in one_pass mode: else not kept (None from the cache)
        self.kept: list[tuple[torch.Tensor, ...]] | None = None
        self.teacher_kept: list[tuple[torch.Tensor, ...]] = []

    def _start(self, input_ids, attention_mask):
        h, position_ids, sctx = teacher_context(self.model, input_ids, attention_mask)
        sctx.aux = None  # no load-balancing bookkeeping in calibration
        return h, position_ids, sctx

    def __iter__(self):
        """(attention_mask, sctx, position_ids, h, X_1, X_2) per batch, at the current layer."""
        blocks = list(self.model.blocks)
        if self.keep and self.kept is not None:
            for (input_ids, attention_mask), (h, X_1, X_2) in zip(self.batches(), self.kept):
                _, position_ids, sctx = self._start(input_ids, attention_mask)
                device = input_ids.device
                yield attention_mask, sctx, position_ids, h.to(device), X_1.to(device), X_2.to(device)
            return
        for input_ids, attention_mask in self.batches():
            h, position_ids, sctx = self._start(input_ids, attention_mask)
            X_1, X_2 = self.model.split(h)
            for prev in blocks[: self.layer]:  # keep=False: the prefix, teacher and converted, again
                X_1, X_2 = prev(X_1, X_2, sctx)
                h = teacher_layer(prev, h, sctx, position_ids)
            yield attention_mask, sctx, position_ids, h, X_1, X_2

    def teacher(self, i: int, h: torch.Tensor, sctx, position_ids) -> tuple[torch.Tensor, ...]:
        """(A_l, M_l, h_{l+1}): the current teacher layer's attention output, MoE (MLP) output (None unless
        `keep_mlp`) and output on batch `i` (whose input is `h`); keep=True runs it in the layer's first pass only."""
        if self.keep and i < len(self.teacher_kept):
            return tuple(t if t is None else t.to(h.device) for t in self.teacher_kept[i])
        block, spec = self.model.blocks[self.layer], self.model.spec
        with _capture_outputs({"attn": getattr(block.base_layer, spec.attn),
                               "mlp": getattr(block.base_layer, spec.mlp)}) as t:
            h_next = teacher_layer(block, h, sctx, position_ids)
        out = (t["attn"], t["mlp"] if self.keep_mlp else None, h_next)
        if self.keep:
            self.teacher_kept.append(tuple(x if x is None else x.cpu() for x in out))
        return out

    def advance(self, held: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Move to the next layer, the current block being fitted. `held`: per batch, (Y_1, P_down_moe's input)
        from the pass that fitted P_down_moe last; Y_2 then needs only G's adapters (`g_from_branch`), not the
        block again."""
        if self.keep:
            block = self.model.blocks[self.layer]
            kept = []
            for i, (_, sctx, position_ids, h, X_1, X_2) in enumerate(self):
                h_next = self.teacher(i, h, sctx, position_ids)[2]
                if held is not None:
                    Y_1, x = (t.to(X_2.device) for t in held[i])
                    Y_2 = X_2 + block.g_from_branch(x, Y_1, sctx.for_layer(block.position_key))
                else:
                    Y_1, Y_2 = block(X_1, X_2, sctx)
                kept.append((h_next.cpu(), Y_1.cpu(), Y_2.cpu()))
            self.kept, self.teacher_kept = kept, []
        self.layer += 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for state in (self.kept or []) + self.teacher_kept for t in state
                   if t is not None)


def _fitted(block, name: str) -> list[torch.nn.Linear]:
    """The Linears one fit sets: the adapter, and its skip when it is a P_down and the block has one."""
    skip = getattr(block, SKIP_OF.get(name, ""), None)
    return [getattr(block, name)] + ([skip] if skip is not None else [])


def _skip_features(skip: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """What a skip's weight multiplies: the stream itself, or the features a skip module declares."""
    features = getattr(skip, "features", None)
    return x if features is None else features(x)


def _layer_pass(model, inputs: _LayerInputs, fits: dict[str, RidgeFit], one_pass: bool,
                hold: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
    """One pass over the calibration set: accumulate `fits` (adapter name -> RidgeFit) of the current layer. A
    sequential pass runs only the side of the block its fits read (F alone for P_up_attn / P_down_attn).
    hold: return, per batch, (Y_1, P_down_moe's input) on the host, for `_LayerInputs.advance`."""
    block = model.blocks[inputs.layer]
    needs_g = any(n in fits for n in ("p_up_moe", "p_down_moe"))
    needs_f = needs_g or "p_down_attn" in fits
    held = [] if hold else None
    for i, (attention_mask, sctx, position_ids, h, X_1, X_2) in enumerate(inputs):
        t_attn, t_mlp, h_next = inputs.teacher(i, h, sctx, position_ids)
        a = h + t_attn
        a_target, h_target = model.stream_targets(a, h_next)  # what Y_1 and Y_2 track
        if one_pass:  # the teacher's attention output, post-attention state and MoE output as inputs
            inputs_of = {"p_down_attn": t_attn, "p_up_moe": a_target, "p_down_moe": t_mlp}
        else:  # what the converted block really feeds each adapter, the ones fitted before it in place
            with _capture_inputs({n: getattr(block, n) for n in ("p_down_attn", "p_down_moe")}) as s:
                Y_1 = block(X_1, X_2, sctx)[0] if needs_g else block.first_half(X_1, X_2, sctx) if needs_f else None
            inputs_of = {"p_down_attn": s.get("p_down_attn"), "p_up_moe": Y_1, "p_down_moe": s.get("p_down_moe")}
            if held is not None:
                held.append((Y_1.cpu(), s["p_down_moe"].cpu()))
        if block.p_skip_attn is not None and "p_down_attn" in fits:  # the skip's input beside the branch output
            inputs_of["p_down_attn"] = torch.cat([inputs_of["p_down_attn"].double(),
                                                 _skip_features(block.p_skip_attn, X_2).double()], dim=-1)
        if block.p_skip_moe is not None and "p_down_moe" in fits:
            skip_in = _skip_features(block.p_skip_moe, inputs_of["p_up_moe"])
            inputs_of["p_down_moe"] = torch.cat([inputs_of["p_down_moe"].double(), skip_in.double()], dim=-1)
        targets = {"p_up_attn": (X_2, h), "p_up_moe": (inputs_of["p_up_moe"], a)}
        if "p_down_attn" in fits:  # (the differences only for the fits of this pass)
            targets["p_down_attn"] = (inputs_of["p_down_attn"], a_target - X_1)
        if "p_down_moe" in fits:
            targets["p_down_moe"] = (inputs_of["p_down_moe"], h_target - X_2)
        rows = slice(None) if attention_mask is None else attention_mask.reshape(-1).bool()
        for name, fit in fits.items():
            X, Y = targets[name]
            fit.add(X.reshape(-1, X.shape[-1])[rows], Y.reshape(-1, Y.shape[-1])[rows])
    return held


@torch.no_grad()
def calibrate(model, batches: Batches, ridge: float = 1e-3, mode: str = "sequential", keep_states: bool = True,
              log: Callable[[str], None] | None = None, progress: Callable[[int, int], None] | None = None,
              reduce: Callable[[torch.Tensor], None] | None = None) -> dict:
    """Fit every adapter of `model` (a RevFFNForCausalLM, in place) by streaming ridge least squares.

    Args:
        batches: called once per pass; yields (input_ids (B, T), attention_mask (B, T) or None).
        ridge: lambda as a fraction of the mean diagonal of XᵀX.
        mode: ``sequential`` (one pass per adapter) or ``one_pass`` (one pass per layer; see the module doc).
        keep_states: hold each batch's layer inputs on the host between passes (2-3·d values per token), the
            teacher layer's outputs (2-3·d more) and before an advance the last pass's Y_1 and MoE output (never
            × depth) rather than recomputing them (memory flat in tokens, compute quadratic in depth).
        log: called with one line per fitted adapter (its relative residual).
        progress: called as progress(passes done, passes in all) after every pass over the calibration set
            (one per fit and one per advance to the next layer): a progress bar's feed.
        reduce: sums a tensor over the processes in place (an all-reduce), when each process passes over its own
            share of the calibration rows: every fit's XᵀX, XᵀY, ‖Y‖² and row count are summed before the solve,
            so every process solves the same system, the one of all rows (data-parallel calibration).
    Returns:
        {"residuals": {"layers.L.p_up_attn": rel, ...}, "passes", "rows", "accumulator_bytes" (the largest
        set of fits held at once), "kept_bytes" (the host states, keep_states), "wall_s", ...}.
    """
    if mode not in MODES:
        raise ValueError(f"calibrate: mode must be one of {MODES}, got {mode!r}")
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    residuals, passes, acc_bytes, rows, kept_bytes = {}, 0, 0, 0, 0
    inputs = _LayerInputs(model, batches, keep_states, keep_mlp=mode == "one_pass")
    plan = [[n for n in ADAPTERS if getattr(block, n) is not None] for block in model.blocks]  # full width: no P_up
    total = sum(1 if mode == "one_pass" else len(fitted) for fitted in plan) + len(plan) - 1
    for l, (block, fitted) in enumerate(zip(model.blocks, plan)):
        with _gathered(block.base_layer):  # under FSDP2: gathered once for all its passes
            for group in [fitted] if mode == "one_pass" else [(n,) for n in fitted]:
                sets = {n: _fitted(block, n) for n in group}
                fits = {n: RidgeFit(sum(m.in_features for m in sets[n]), getattr(block, n).out_features,
                                    getattr(block, n).weight.device) for n in group}
                last = keep_states and group == (fitted[-1],) == ("p_down_moe",)  # the layer's last fit
                held = _layer_pass(model, inputs, fits, mode == "one_pass", hold=last)
                kept_bytes = max(kept_bytes, inputs.nbytes() + sum(t.numel() * t.element_size()
                                                                   for pair in held or () for t in pair))
                if reduce is not None:
                    for fit in fits.values():
                        fit.reduce(reduce)
                passes += 1
                if progress is not None:
                    progress(passes + l, total)
                acc_bytes = max(acc_bytes, sum(f.nbytes for f in fits.values()))
                for name, fit in fits.items():
                    rows = _shared_rows([m.weight for m in sets[name]])  # FSDP2: each rank solves its own rows
                    weight, rel = fit.solve(ridge, rows, reduce if rows is not None else None)
                    for layer, w in zip(sets[name], weight.split([m.in_features for m in sets[name]], dim=1)):
                        if rows is None:
                            write_full(layer.weight, w)
                        else:
                            layer.weight.to_local().copy_(w)
                    residuals[f"layers.{l}.{name}"] = rel
                    rows = fit.rows
                    if log is not None:
                        log(f"calibrate layer {l} {name}: relative residual {rel:.4f} ({fit.rows} tokens)")
            if l + 1 < len(model.blocks):
                inputs.advance(held)
                kept_bytes = max(kept_bytes, inputs.nbytes())
                if progress is not None:
                    progress(passes + l + 1, total)
    model.train(was_training)
    return {"residuals": residuals, "passes": passes, "rows": rows, "accumulator_bytes": acc_bytes,
            "kept_bytes": kept_bytes, "mode": mode, "keep_states": keep_states, "ridge": ridge,
            "wall_s": round(time.perf_counter() - t0, 2)}


def _shared_rows(weights: list[torch.Tensor]) -> slice | None:
    """The rows of the fit's output this rank holds in every one of `weights` (P_down and its skip, sharded
    alike by FSDP2), or None: the whole fit (plain weights, or shards that differ)."""
    rows = [local_rows(w) for w in weights]
    return rows[0] if all(r == rows[0] for r in rows) else None


@contextlib.contextmanager
def _gathered(layer: torch.nn.Module):
    """FSDP2: the decoder layer's sharded units all-gathered once for all the passes over it (each call would
    gather and free them again: ~12 all-gathers of each a layer), freed after. Not the adapters: the fits write them.
    Unsharded models: nothing."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in layer.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(True, recurse=False)

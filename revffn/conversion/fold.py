"""Fold the full-width P_down adapters into the branches' last linear maps (`revffn.fold_adapters`).

At full stream width each branch ends in a d x d adapter:

    F(X_2) = P_down_attn( attn_branch(X_2) ) + P_skip_attn(X_2)
    G(Y_1) = P_down_moe( mlp_branch(Y_1) )   + P_skip_moe(Y_1)

The attention branch ends in the mixer's output projection (o_proj) and the MoE branch in a sum of down
projections (each expert's, the shared expert's), each scaled by a router or gate weight that does not
depend on them. So P_down can be multiplied into them (W <- P W, b <- P b): the same function, 2 d^2 fewer
parameters a layer to train and keep AdamW moments for, and two d x d matmuls fewer per token in the
forward, the backward's recompute and its backward. The skips read the stream, not the branch: they stay.

Stage 1 (the heal) trains P_down against frozen weights, so the method folds at the start of stage 2
(`RevFFNMethod.restructure`). A branch folds only where the spec's layout allows it (no post-norm or
dropout after the projections) and where every output map is found by name (`OUT_NAMES`) with one
unambiguous output axis of size d; `fold_adapters` then checks each branch's output on a probe before and
after, and undoes that branch's fold unless it is exact to float rounding. Under FSDP2 the parameters are
DTensors: each fold all-gathers W and P, and every rank writes back its own shard.
"""

from __future__ import annotations

import torch
from torch import nn

from revffn.archs.spec import get_path
from revffn.conversion.convert import full_value, write_full

OUT_NAMES = ("o_proj", "out_proj", "dense", "wo", "down_proj", "w2")  # the last linear map of a branch


def _out_maps(module: nn.Module, d: int) -> list[tuple[nn.Module, str, str]] | None:
    """(owner, parameter name, how) for every output map of `module` found by name: "rows" (W is (d, in), y = W x),
    "cols" (W is (..., in, d), y = x W), "bias" (a (d,) bias of a rows map). None: a candidate without an output
    axis of size d (no fold)."""
    found = []
    for path, sub in module.named_modules():
        if path.rsplit(".", 1)[-1] not in OUT_NAMES:
            continue
        if isinstance(sub, nn.Linear):
            if sub.out_features != d:
                return None
            found.append((sub, "weight", "rows"))
            if sub.bias is not None:
                found.append((sub, "bias", "bias"))
    for path, p in module.named_parameters(recurse=True):
        owner_path, _, name = path.rpartition(".")
        owner = get_path(module, owner_path) if owner_path else module
        if name not in OUT_NAMES or isinstance(owner, nn.Linear) or p.ndim != 3:
            continue  # a fused expert tensor: (E, d, in) or (E, in, d)
        rows, cols = p.shape[1] == d, p.shape[2] == d
        if not (rows or cols):
            return None
        # (E, d, d): HF's layout, F.linear's (out, in), is "rows"; `fold_adapters`' check undoes a wrong guess
        found.append((owner, name, "rows" if rows else "cols"))
    return found


def _fold_branch(P: torch.Tensor, maps: list[tuple[nn.Module, str, str]]) -> None:
    P = full_value(P).float()
    for owner, name, how in maps:
        t = getattr(owner, name)
        w = full_value(t).float()
        # rows: (d, d) @ (d, in), or batched over experts (E, d, in); cols (..., in, d) and a (d,) bias: x P^T
        new = torch.matmul(P, w) if how == "rows" else torch.matmul(w, P.T)
        write_full(t.data, new.to(t.dtype))


def foldable(block) -> dict[str, list]:
    """{adapter name: its branch's output maps} for the branches of `block` (an `HFRevBlock`) that can fold."""
    if block.stream_width != "full" or block.branch_dropout:
        return {}
    spec, layer = block.spec, block.base_layer
    out = {}
    if block.p_down_attn is not None and spec.attn_post_norm is None:
        if maps := _out_maps(get_path(layer, block.mixer), block.p_down_attn.weight.shape[0]):
            out["p_down_attn"] = maps
    if block.p_down_moe is not None and spec.mlp_post_norm is None:
        mlp = [get_path(layer, spec.mlp)]
        if spec.shared_mlp and (shared := get_path(layer, spec.shared_mlp, None)) is not None:
            mlp.append(shared)
        parts = [_out_maps(m, block.p_down_moe.weight.shape[0]) for m in mlp]
        if all(parts):
            out["p_down_moe"] = [m for part in parts for m in part]
    return out


def fold_adapters(model, only: list | None = None, tol: float = 1e-4) -> tuple[list[nn.Parameter], list]:
    """Fold every foldable P_down of `model` (a full-width `RevFFNForCausalLM`) into its branch's output maps and
    remove it (the block's adapter becomes None: the identity). Each branch is checked on a probe (8 random
    stream rows at the embeddings' scale): its output before and after must agree to `tol` (relative), or that
    branch's fold is undone. `only`: fold exactly these [layer, adapter] pairs (a resumed run repeating its
    first fold; no check). Returns (the parameters removed, for the optimizer to drop; the [layer, adapter]
    pairs folded)."""
    embed = get_path(model.hf, model.spec.embed).weight
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 8, model.config.hidden_size, generator=g) * float(full_value(embed).detach().float().std()))
    x = x.to(device=embed.device, dtype=embed.dtype)
    removed, folded = [], []
    with torch.no_grad():
        sctx = model._context(x, None, torch.arange(8, device=x.device).unsqueeze(0))  # as the forward: embeddings
        x = x.to(model.stream_dtype)
        sctx.aux = None
        for i, block in enumerate(model.blocks):
            for adapter, maps in foldable(block).items():
                if only is not None and [i, adapter] not in only:
                    continue
                branch = block.F if adapter == "p_down_attn" else block.G
                before = branch(x, sctx) if only is None else None
                saved = [(getattr(owner, name), full_value(getattr(owner, name)).detach().clone())
                         for owner, name, _ in maps] if only is None else []
                module = getattr(block, adapter)
                _fold_branch(module.weight, maps)
                setattr(block, adapter, None)
                if only is None:
                    after = branch(x, sctx)
                    err = (after - before).abs().max() / before.abs().max().clamp(min=1e-30)
                    if not torch.isfinite(err) or err > tol:
                        for t, value in saved:
                            write_full(t.data, value)
                        setattr(block, adapter, module)
                        continue
                removed.extend(module.parameters())
                folded.append([i, adapter])
    return removed, folded


def unfold(model) -> None:
    """Give every folded branch its P_down back as the identity (exact): the layout `revffn convert` writes and
    loads, for export."""
    for block in model.blocks:
        for adapter in ("p_down_attn", "p_down_moe"):
            if getattr(block, adapter) is None:
                like = block.p_skip_attn.weight if block.p_skip_attn is not None else next(
                    block.base_layer.parameters())
                d = model.config.hidden_size
                eye = nn.Linear(d, d, bias=False, device=like.device, dtype=like.dtype)
                with torch.no_grad():
                    eye.weight.copy_(torch.eye(d, dtype=like.dtype, device=like.device))
                setattr(block, adapter, eye)

"""Convert an HF MoE causal LM into a RevFFN reversible model.

Every decoder layer becomes an `HFRevBlock` on two streams (X_1, X_2). At the paper's half width
(`stream_width="half"`) each stream is d/2 wide:

    F(X_2) = P_down_attn( SelfAttention( input_layernorm( P_up_attn(X_2) ) ) )
    G(Y_1) = P_down_moe( MoE( post_attention_layernorm( P_up_moe(Y_1) ) ) )

The pretrained norms, attention (RoPE, causal and padding masks) and MoE block (router, experts,
shared expert) run unchanged at full width d; the spec names them where they differ (post-norms,
a hybrid stack's other token mixers, branch multipliers: `archs.layout`), and `convert` refuses
a model with anything the spec does not use. Only the projection adapters P_up (d/2 -> d) and
P_down (d -> d/2) are new. The HF decoder layer stays reachable as `block.base_layer` (as PEFT
keeps `base_layer`), in place inside the HF model, so its parameter names only gain `base_layer.`.

The embedding output is split along features into X_1, X_2; at the end concat(Y_1, Y_2) feeds
the pretrained final norm and LM head (embedding and logit multipliers applied where the spec
names them). At full width (`stream_width="full"`, training's and `revffn convert`'s default) both
streams are d wide and start as the embedding output, there is no P_up, and Y_2 feeds the head
(`HFRevBlock`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import masking_utils

from revffn.archs.architectures import spec_for
from revffn.archs.layout import (
    CACHE_KWARGS,
    attn_branch,
    cache_kwarg,
    check_convertible,
    logits_transform,
    mlp_branch,
)
from revffn.archs.spec import ArchSpec, config_value, get_path
from revffn.conversion.loss import CHUNK_TOKENS, SwitchAux, causal_lm_loss, head_logits
from revffn.errors import UserError
from revffn.reversible.buffered import (
    BUFFER_BITS,
    DEFAULT_BUFFER_BITS,
    MOMENTUM_SIGNS,
    buffered_rebuild_errors,
    run_buffered_stack,
)
from revffn.reversible.coupling import PartialGradients, RevBlock, StackContext, rebuild_errors, run_stack
from revffn.reversible.replay import AutocastState, RouterTap

ADAPTER_INITS = ("calibrated", "coordinate", "zero", "random")
STREAM_WIDTHS = ("half", "full")
# additive: Y_1 = X_1 + F(X_2), Y_2 = X_2 + G(Y_1) with adapters (`HFRevBlock`); buffered: every decoder layer whole
# on fixed-point streams with a bit buffer (`reversible.buffered`), the pretrained model to 2^-buffer_bits
COUPLINGS = ("additive", "buffered")
# the streams' dtypes: float32 (the default), bfloat16 (half the bytes, inexact), float64 (twice the bytes: exact
# reconstruction on a deep pretrained model whose fp32 streams are not, docs/engine.md)
STREAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
AUTO = "auto"  # revffn.stream_dtype's default: float32, or float64 where float32's rebuild drifts (`pick_stream_dtype`)
# float32 streams rebuild a layer's input to this fraction of the stream scale or better, else float64. Measured
# (`rebuild_errors`, 2 x 64 random tokens, coordinate init): the tiny presets <= 1.4e-5, builtin:base 3.0e-3 (its
# reversible gradient 2.5e-4 off the plain twin's; 5.8e-3 calibrated), builtin:smollm2-moe 0.19, builtin:smollm2
# 0.59 (gradient 25 % off). Between the toy base and the real models, 5x from either
AUTO_REBUILD_TOL = 3e-2
ADAPTER_PREFIXES = ("p_up_attn", "p_down_attn", "p_up_moe", "p_down_moe", "p_skip_attn", "p_skip_moe")
LINEAR_MASK = "linear_attention"  # the mask key of linear-attention / SSM / convolution layers (2-D padding mask)


def init_adapters(block: HFRevBlock, how: str) -> None:
    """Initialise the projection adapters of a block (the skips, if the block has them, start at 0 for
    every init, so F and G are the adapters-only ones until calibration or training moves them).

    Half-width streams (`stream_width="half"`, the paper's):

    - ``coordinate``: keep each stream in the pretrained model's coordinates. X_2 holds
      features d/2..d of the embedding, so P_up_attn writes X_2 back into those coordinates of the
      d-wide input (zeros elsewhere); F's output is added to X_1, so P_down_attn reads the first
      d/2 coordinates of the attention output, exactly the ones the pretrained residual would have
      added to them. Likewise P_up_moe places Y_1 at coordinates 0..d/2 and P_down_moe reads
      d/2..d. concat(Y_1, Y_2) therefore stays in the basis the final norm and LM head were trained
      on, every sub-block sees real (if half-masked) features, and the RMSNorm removes the scale
      lost to the zeros. The converted model starts as a "half-information" copy of the
      pretrained one rather than from noise.
    - ``zero``: P_up as in ``coordinate``, P_down = 0, so F = G = 0 and the model is exactly the
      pretrained embedding -> final norm -> head at step 0 (the zero-init-residual recipe; like
      LoRA's B = 0). Safe, but it throws the layers away until P_down learns.
    - ``random``: Kaiming-uniform P_up and P_down (nn.Linear's default), scaled by 1/sqrt(2L)
      on P_down so the residual streams do not grow with depth. For ablation.
    - ``calibrated``: ``coordinate`` here; `revffn.conversion.calibrate.calibrate` then fits every
      adapter to the original model's hidden states on calibration text (it needs data, so the
      method or `revffn convert` runs it after conversion).

    Full-width streams (`stream_width="full"`) have no P_up (the identity): ``coordinate`` and
    ``calibrated`` start with P_down = I (Y_1 = X_1 + Attn(X_2), Y_2 = X_2 + MoE(Y_1)), ``zero`` with
    P_down = 0, ``random`` as above.
    """
    if how not in ADAPTER_INITS:
        raise UserError(f"unknown adapter init {how!r}. Fix: revffn.adapter_init must be one of "
                        f"{', '.join(ADAPTER_INITS)}.")
    if block.p_down_attn.weight.is_meta:  # no values yet (sharded loading: `Method.after_load` calls this again)
        return
    # each weight computed whole, then written (a sharded one gets its rows)
    values = {m: torch.zeros(m.weight.shape, dtype=m.weight.dtype, device=_value_device(m.weight))
              for m in block.adapters()}
    with torch.no_grad():
        if how == "random":
            scale = 1.0 / math.sqrt(2 * max(block.num_layers, 1))
            for m in (block.p_up_attn, block.p_down_attn, block.p_up_moe, block.p_down_moe):
                if m is not None:
                    nn.init.kaiming_uniform_(values[m], a=math.sqrt(5))
            values[block.p_down_attn].mul_(scale)
            values[block.p_down_moe].mul_(scale)
        elif block.stream_width == "full":
            if how != "zero":
                for m in (block.p_down_attn, block.p_down_moe):
                    values[m].copy_(torch.eye(values[m].shape[0], device=values[m].device))
        else:
            d, h = block.p_up_attn.out_features, block.p_up_attn.in_features
            eye = torch.eye(h, device=values[block.p_up_attn].device)  # (transformers may make meta the default)
            values[block.p_up_attn][h:d] = eye  # X_2 -> its own coordinates d/2..d
            values[block.p_up_moe][:h] = eye  # Y_1 -> its own coordinates 0..d/2
            if how != "zero":
                values[block.p_down_attn][:, :h] = eye  # attention output 0..d/2 -> X_1
                values[block.p_down_moe][:, h:d] = eye  # MoE output d/2..d -> X_2
        for m, value in values.items():
            write_full(m.weight, value)


def _value_device(t: torch.Tensor) -> torch.device:
    """Where a weight's full value is computed: its device, or the host for a sharded (DTensor) one."""
    return torch.device("cpu") if hasattr(t, "device_mesh") else t.device


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole of `t`: a DTensor all-gathered (a collective: every rank calls it), else `t`."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def write_full(t: torch.Tensor, value: torch.Tensor) -> None:
    """t <- value (in place, no grad): a DTensor gets its local shard of the whole `value` (every rank computed the
    same; cut locally, no collective), a meta tensor nothing."""
    if t.is_meta:
        return
    if hasattr(t, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        mesh, placements, t = t.device_mesh, t.placements, t.to_local()
        value = distribute_tensor(value.to(t.device, t.dtype), mesh, placements, src_data_rank=None).to_local()
    with torch.no_grad():
        t.copy_(value)


def local_rows(t: torch.Tensor) -> slice | None:
    """The rows of `t`'s whole value this rank holds: a slice for a DTensor sharded by rows (FSDP2's Shard(0) on
    one mesh dimension: torch.chunk's split, ceil(n / world) rows a rank, none past the last), None for any other
    tensor (plain, replicated, or sharded otherwise)."""
    placements = getattr(t, "placements", None)
    if placements is None or len(placements) != 1 or getattr(placements[0], "dim", None) != 0:
        return None
    n, mesh = t.shape[0], t.device_mesh
    chunk = -(-n // mesh.size())
    start = min(n, mesh.get_local_rank() * chunk)
    stop = min(n, start + chunk)
    return slice(start, stop) if t.to_local().shape[0] == stop - start else None


class HFRevBlock(RevBlock):
    """An HF decoder layer as a reversible block: F = attention (token-mixer) branch, G = MoE (or MLP)
    branch, each between its projection adapters (`layout.attn_branch` / `layout.mlp_branch` at width d):

        F(X_2) = P_down_attn( attn_branch( P_up_attn(X_2) ) )  [+ P_skip_attn(X_2)]
        G(Y_1) = P_down_moe( mlp_branch( P_up_moe(Y_1) ) )     [+ P_skip_moe(Y_1)]

    With full-width streams (`stream_width="full"`; `revffn.stream_width`) both streams are d wide,
    there is no P_up (the branch reads its stream as it is), and P_down and the skips are d x d:

        F(X_2) = P_down_attn( attn_branch(X_2) ) + P_skip_attn(X_2)
        G(Y_1) = P_down_moe( mlp_branch(Y_1) )   + P_skip_moe(Y_1)

    (Stage 2 may fold P_down into the branch's last linear maps: `conversion.fold`; the adapter is then None.)
    Each branch then sees every coordinate of the model's residual, massive-activation dimensions
    included, which the half-width streams split between them (docs/conversion.md: on SmolLM2 the
    half-width conversion loses +8 nats, the full-width one far less).

    `adapters=False` (the buffered coupling, `reversible.buffered`): no P_down either, F and G are the layer's own
    attention and MoE branches (at full width, no P_up): the block's decoder layer exactly, as F and G.

    The skips (`skip=True`; `revffn.adapter_skip`) are (half) d/2 x d/2 linear maps, one per branch. F still
    depends on X_2 alone and G on Y_1 alone, so the block stays exactly invertible. They give back the
    residual path the split cuts: without them X_1 only ever receives attention outputs and X_2 only
    MoE outputs, so neither half can carry the other branch's update to the next layer (the calibration
    residuals with and without them: docs/conversion.md).

    A layer whose token mixer is one of `spec.mixers` (linear attention, SSM, convolution) takes the
    2-D padding mask, under the `linear_attention` mask key, as in HF.

    G is token-wise (norm, router, experts, shared expert, per token; HF's MoE blocks are dropless),
    so the reversible backward may recompute it by chunks of tokens (`recompute_chunk_tokens`). F treats
    each sequence alone (its masks and position embeddings are per sequence), so the backward may
    recompute it by chunks of whole sequences, as many as fit in `recompute_chunk_tokens` tokens.
    """

    g_token_wise = True
    f_batch_wise = True

    def __init__(self, base_layer: nn.Module, spec: ArchSpec, layer_idx: int, num_layers: int,
                 hidden_size: int, mask_key: str, tap: RouterTap | None, config=None, skip: bool = False,
                 stream_width: str = "half", adapters: bool = True):
        super().__init__()
        if stream_width not in STREAM_WIDTHS:
            raise UserError(f"unknown stream width {stream_width!r}. Fix: revffn.stream_width must be one of "
                            f"{', '.join(STREAM_WIDTHS)}.")
        if hidden_size % 2 and stream_width == "half":
            raise UserError(f"hidden_size={hidden_size} is odd; half-width RevFFN splits it into two equal streams. "
                            f"Fix: revffn.stream_width=full.")
        self.stream_width = stream_width
        self.base_layer = base_layer
        self.spec = spec
        self.mixer = spec.mixer_name(base_layer) or spec.attn
        if self.mixer in spec.mixers:
            mask_key = LINEAR_MASK
        self.layer_idx, self.num_layers, self.mask_key = layer_idx, num_layers, mask_key
        self.branch_scale = float(config_value(config, spec.branch_scale_key, 1.0))
        self.branch_dropout = float(config_value(config, spec.branch_dropout_key, 0.0))
        self.router_tap = tap
        ref = next(base_layer.parameters())
        d = hidden_size
        h = d // 2 if stream_width == "half" else d  # a stream's width
        kw = dict(bias=False, device=ref.device, dtype=ref.dtype)
        up = (lambda: nn.Linear(h, d, **kw)) if stream_width == "half" else (lambda: None)  # full: the identity
        down = (lambda: nn.Linear(d, h, **kw)) if adapters else (lambda: None)  # None: the branch's own output
        self.p_up_attn, self.p_down_attn = up(), down()
        self.p_up_moe, self.p_down_moe = up(), down()
        self.p_skip_attn = nn.Linear(h, h, **kw) if skip else None
        self.p_skip_moe = nn.Linear(h, h, **kw) if skip else None

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the branches compute in: the layer's weights' (the adapters', while they exist)."""
        return self.p_skip_attn.weight.dtype if self.p_skip_attn is not None else next(
            self.base_layer.parameters()).dtype

    def adapters(self) -> list[nn.Linear]:
        """The projection adapters this block adds to its HF layer (half width: 4, or 6 with the skips;
        full width: 2, or 4)."""
        return [m for m in (self.p_up_attn, self.p_down_attn, self.p_up_moe, self.p_down_moe, self.p_skip_attn,
                            self.p_skip_moe) if m is not None]

    def F(self, X_2: torch.Tensor, sctx: StackContext) -> torch.Tensor:  # noqa: N802
        mask = sctx.masks[self.mask_key]
        if self.mask_key == LINEAR_MASK and mask is not None and mask.ndim != 2:
            raise UserError(f"cannot convert model_type={self.spec.model_type!r}: layer {self.layer_idx}'s token "
                            f"mixer `{self.mixer}` needs the 2-D padding mask, but the converted model built a "
                            f"{mask.ndim}-D one for `{LINEAR_MASK}` layers. Fix: train without padding (pack the "
                            f"sequences), or use a revffn version that builds the linear-attention mask.")
        with sctx.autocast():
            x_in = X_2.to(self.weight_dtype)
            x_up = x_in if self.p_up_attn is None else self.p_up_attn(x_in)
            x = attn_branch(self.base_layer, self.spec, self.mixer, x_up, sctx.position_embeddings,
                            mask, self.branch_scale, self.branch_dropout, sctx.cache)
            out = x if self.p_down_attn is None else self.p_down_attn(x)  # None: folded into the branch
            if self.p_skip_attn is not None:
                out = out + self.p_skip_attn(x_in)
            return out.to(X_2.dtype)

    def G(self, Y_1: torch.Tensor, sctx: StackContext) -> torch.Tensor:  # noqa: N802
        with sctx.autocast():
            y_in = Y_1.to(self.weight_dtype)
            y_up = y_in if self.p_up_moe is None else self.p_up_moe(y_in)
            x = mlp_branch(self.base_layer, self.spec, y_up, self.branch_scale, self.branch_dropout)
            return self._g_adapters(x, y_in).to(Y_1.dtype)

    def _g_adapters(self, x: torch.Tensor, y_in: torch.Tensor) -> torch.Tensor:
        out = x if self.p_down_moe is None else self.p_down_moe(x)
        if self.p_skip_moe is not None:
            out = out + self.p_skip_moe(y_in)
        return out

    def g_from_branch(self, x: torch.Tensor, Y_1: torch.Tensor, sctx: StackContext) -> torch.Tensor:
        """G(Y_1) from its branch's output x (P_down_moe's input, computed from this Y_1 before): only the adapters
        run, as G runs them. Calibration advances a layer this way after fitting P_down_moe on the same x."""
        with sctx.autocast():
            return self._g_adapters(x, Y_1.to(self.weight_dtype)).to(Y_1.dtype)


@dataclass
class DebugOptions:
    """Debug and measurement knobs of `RevFFNForCausalLM` (`model.debug`); the defaults train.

    Attributes:
        routing_replay: reuse, in the reversible backward, every choice the forward's sub-blocks made
            on values (router top-k wherever the router lives, indexer top-k, max / argmax / sort;
            `reversible.replay`). False only to show what replay prevents (tests).
        rng_replay: re-run each sub-block that drew random numbers (dropout, router jitter, any op)
            from its recorded RNG state in the reversible backward. False only as the negative
            control of the RNG tests: the recomputation then draws fresh noise and the gradients
            are wrong. The states are recorded either way (`last_stack_stats["rng_bytes"]`).
        track_routing_flips: count the choices (a token's top-k, a row's max ...) that the rebuilt
            input would have made differently; read `model.routing_flips()` after backward.
        stack_scope: a context-manager factory entered around the decoder stack only, e.g. the
            saved-tensor hooks of `memory.measure.saved_bytes_of_stack`.
    """

    routing_replay: bool = True
    rng_replay: bool = True
    track_routing_flips: bool = False
    stack_scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


@dataclass
class RevFFNOutput:
    """What `RevFFNForCausalLM.forward` returns (HF-style attribute access)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None
    n_tokens: torch.Tensor | None = None
    cache: object | None = None  # the transformers Cache, extended by this call (`use_cache`)


def _mask_fn_kwargs(fn, config, embeds, attention_mask, position_ids, cache=None) -> dict:
    """Keyword arguments for transformers' mask builders across 5.x signature changes."""
    params = inspect.signature(fn).parameters
    kw = {"config": config, "attention_mask": attention_mask, "position_ids": position_ids}
    kw["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = embeds
    if name := next((n for n in CACHE_KWARGS if n in params), None):  # the newest name only (5.25 keeps both)
        kw[name] = cache
    if "cache_position" in params:
        past = cache.get_seq_length() if cache is not None else 0
        kw["cache_position"] = torch.arange(past, past + embeds.shape[1], device=embeds.device)
    return kw


def _mask_for(layer_type: str, config, embeds, attention_mask, position_ids, cache=None):
    """The mask HF gives layers of `layer_type`: its builder in transformers' layer-pattern table
    (causal, sliding-window, chunked; the raw 2-D padding mask for linear-attention / SSM / conv
    layers), a causal mask for a type the table does not know. A dict entry builds a dict of masks.
    With a `cache`, the queries are the new tokens and the keys everything cached before them too
    (`attention_mask` then covers both, as in HF)."""
    table = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    fn = table.get(layer_type, masking_utils.create_causal_mask)
    if isinstance(fn, dict):
        return {k: f(**_mask_fn_kwargs(f, config, embeds, attention_mask, position_ids, cache)) for k, f in fn.items()}
    return fn(**_mask_fn_kwargs(fn, config, embeds, attention_mask, position_ids, cache))


# Decoder-layer forward inputs a reversible block gives (or that do not matter in training).
LAYER_INPUTS = frozenset(("self", "hidden_states", "attention_mask", "position_ids", "position_embeddings",
                          "past_key_values", "past_key_value", "cache", "use_cache", "cache_position",
                          "output_attentions", "output_router_logits"))
# Inputs that carry state from an earlier layer only in the layers a config list marks:
# name -> (config key, marking value). Elsewhere the layer computes the state itself.
CROSS_LAYER_INPUTS = {"prev_topk_indices": ("indexer_types", "shared")}


def check_layer_inputs(layer: nn.Module, layer_idx: int, config) -> None:
    """Refuse a decoder layer that needs an input other than its hidden states, masks and position
    embeddings: state handed from an earlier layer (reused DSA top-k indices, a previous router's
    hidden states) or an extra per-layer input. A reversible block is rebuilt from its own output
    alone, so it cannot receive it.

    Raises:
        UserError: naming the layer, the input and why.
    """
    model_type = getattr(config, "model_type", "?")
    for name, p in inspect.signature(layer.forward).parameters.items():
        if name in LAYER_INPUTS or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if name in CROSS_LAYER_INPUTS:
            key, marked = CROSS_LAYER_INPUTS[name]
            values = getattr(config, key, None) or ()
            if not (layer_idx < len(values) and values[layer_idx] == marked):
                continue  # this layer computes it itself
            why = (f"config.{key}[{layer_idx}] is {marked!r}: the layer reuses `{name}` computed by an earlier "
                   f"layer")
        else:
            why = f"its forward takes `{name}`, an input beside the hidden states, masks and position embeddings"
        raise UserError(f"cannot convert model_type={model_type!r}: decoder layer {layer_idx} needs state or inputs "
                        f"a reversible block cannot give it ({why}). A reversible block is recomputed from its "
                        f"own output alone. Fix: none in revffn yet; this architecture is not supported.")


@dataclass(frozen=True)
class RopePlan:
    """How `_context` calls the model-level rotary embedding.

    - no rotary module (`module` None): position_embeddings is None (NoPE, or attention that
      computes its own);
    - `keys` None: one call, `rotary(x, position_ids)`, shared by every layer;
    - `keys`: one call per key, `rotary(x, position_ids, layer_type=key)`, as a dict. With
      `per_layer` each block reads its own layer type's entry (Gemma3 / Laguna style); without,
      every block gets the whole dict (DeepSeek-V4: rope keys that are not layer types).
    - `axes`: a multi-axis (M-RoPE) rotary, one row of position ids per axis (`mrope_section`); text
      positions are the same on every axis, so (B, T) ids are broadcast to (axes, B, T), as the HF text
      model does before its rotary (transformers 5.17's Qwen3.5-MoE rotary reads only the 3-D form).
    """

    module: nn.Module | None
    keys: tuple[str, ...] | None = None
    per_layer: bool = False
    axes: int = 0

    @classmethod
    def of(cls, hf_model: nn.Module, spec: ArchSpec) -> RopePlan:
        rotary = get_path(hf_model, spec.rotary, None) if spec.rotary else None
        if rotary is None:
            return cls(None)
        if "layer_type" not in inspect.signature(rotary.forward).parameters:
            return cls(rotary, axes=len(getattr(rotary, "mrope_section", None) or ()))
        types = tuple(getattr(hf_model.config, "layer_types", None) or ())
        own = tuple(getattr(rotary, "layer_types", None) or sorted(set(types)))
        if types and set(types) <= set(own):
            return cls(rotary, tuple(sorted(set(types))), per_layer=True)
        return cls(rotary, own)

    def __call__(self, embeds: torch.Tensor, position_ids: torch.Tensor):
        if self.module is None:
            return None
        if self.keys is None:
            if self.axes and position_ids.ndim == 2:
                position_ids = position_ids[None].expand(self.axes, -1, -1)
            return self.module(embeds, position_ids)
        return {k: self.module(embeds, position_ids, layer_type=k) for k in self.keys}


class RevFFNForCausalLM(nn.Module):
    """A converted model. `reversible=False` switches training to the plain-autograd twin.

    Attributes:
        hf: the HF model, its decoder layers replaced in place by `HFRevBlock`s.
        reversible: use the reversible backward when training with grad enabled.
        stream_dtype: dtype of the residual streams X_1, X_2, Y_1, Y_2 (fp32 by default).
        aux_loss_coef: weight of the router load-balancing loss (0 disables it).
        chunk_tokens: rows per chunk of the head + cross-entropy (`conversion.loss.causal_lm_loss`).
        recompute_chunk_tokens: rows (of the flattened B*T) per chunk of the MoE branch G's
            recomputation in the reversible backward, so its working set is one chunk's (0: the
            whole batch at once). A block whose G drew random numbers (dropout, router jitter) or
            made a choice not per token is recomputed whole (`RevBlock._g_splits`). The attention
            branch F is recomputed by chunks of whole sequences of at most as many tokens (at least
            one sequence; `RevBlock._f_chunks`).
        debug: `DebugOptions` (routing replay, flip counting, a scope around the decoder stack).
        last_stack_stats: what the last reversible forward's stack reported (routing and RNG record
            bytes and storages, the sub-blocks that drew random numbers, routing flips once its
            backward ran with `debug.track_routing_flips`).
    """

    def __init__(self, hf_model: nn.Module, spec: ArchSpec, adapter_init: str = "coordinate",
                 stream_dtype: torch.dtype = torch.float32, aux_loss_coef: float | None = None,
                 chunk_tokens: int = CHUNK_TOKENS, adapter_skip: bool = False, stream_width: str = "half",
                 coupling: str = "additive", buffer_bits: int = DEFAULT_BUFFER_BITS,
                 buffer_momentum: str = "negative"):
        super().__init__()
        if coupling not in COUPLINGS:
            raise UserError(f"unknown coupling {coupling!r}. Fix: revffn.coupling must be one of "
                            f"{', '.join(COUPLINGS)}.")
        if buffer_bits not in BUFFER_BITS:
            raise UserError(f"buffer_bits={buffer_bits}: the buffered coupling keeps 1 to 8 bits a coordinate a "
                            "layer. Fix: revffn.buffer_bits between 1 and 8 (the default 6: SmolLM2 within 0.01 "
                            "nats).")
        self.hf, self.spec = hf_model, spec
        if buffer_momentum not in MOMENTUM_SIGNS:
            raise UserError(f"buffer_momentum={buffer_momentum!r}. Fix: revffn.buffer_momentum must be one of "
                            f"{', '.join(MOMENTUM_SIGNS)}.")
        self.coupling, self.buffer_bits, self.buffer_momentum = coupling, buffer_bits, buffer_momentum
        if coupling == "buffered":  # whole layers: no adapters, the hidden state is one d-wide stream of values
            adapter_skip, stream_width, adapter_init = False, "full", "coordinate"
        self.adapter_skip, self.stream_width = adapter_skip, stream_width
        self.reversible = True
        self.stream_dtype = stream_dtype
        config = hf_model.config
        self.aux_loss_coef = (getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if aux_loss_coef is None \
            else aux_loss_coef
        self.chunk_tokens = chunk_tokens
        self.recompute_chunk_tokens = 0
        self.partial_gradients = PartialGradients()  # every forward's StackContext.partial; InBackward reads it
        self.debug = DebugOptions()
        self.last_stack_stats: dict = {}
        layers = get_path(hf_model, spec.layers)
        if any(isinstance(layer, RevBlock) for layer in layers):
            raise UserError("this model is already converted to RevFFN.")
        for i, layer in enumerate(layers):  # inputs a reversible block cannot give first, then the layout
            check_layer_inputs(layer, i, config)
        check_convertible(hf_model, spec)
        n_exp = spec.num_experts(config)
        self.num_experts, self.top_k = n_exp, spec.top_k(config)
        self.embed_scale = float(config_value(config, spec.embed_scale_key, 1.0))
        self.logits_scale, self.logits_softcap = logits_transform(spec, config)
        self.rope = RopePlan.of(hf_model, spec)
        for i, layer in enumerate(layers):
            router = get_path(layer, f"{spec.mlp}.{spec.router}", None)
            tap = RouterTap(router, spec.router_logits_index) if isinstance(router, nn.Module) and n_exp else None
            block = HFRevBlock(layer, spec, i, len(layers), config.hidden_size, self._mask_key(i), tap, config,
                               skip=adapter_skip, stream_width=stream_width, adapters=coupling == "additive")
            block.position_key = config.layer_types[i] if self.rope.per_layer else None
            if coupling == "additive":  # (buffered: F and G are the layer's own branches)
                init_adapters(block, adapter_init)
            layers[i] = block

    # -- structure ------------------------------------------------------------------------------
    @property
    def config(self):
        return self.hf.config

    @property
    def blocks(self) -> nn.ModuleList:
        return get_path(self.hf, self.spec.layers)

    def _mask_key(self, i: int) -> str:
        config = self.hf.config
        types = getattr(config, "layer_types", None)
        if types:
            return types[i]
        if self.spec.sliding_window_all_layers and getattr(config, "sliding_window", None):
            return "sliding_attention"
        return "full_attention"

    def routers(self) -> list[nn.Module]:
        return [b.router_tap.router for b in self.blocks if b.router_tap is not None]

    def router_trainable(self) -> bool:
        return any(p.requires_grad for r in self.routers() for p in r.parameters())

    # -- streams ----------------------------------------------------------------------------------
    def split(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two streams (X_1, X_2) a d-wide hidden state starts: its two halves (half width), or
        two copies of it (full width), in the stream dtype."""
        h = h.to(self.stream_dtype)
        return h.chunk(2, dim=-1) if self.stream_width == "half" else (h, h)

    def merge(self, Y_1: torch.Tensor, Y_2: torch.Tensor) -> torch.Tensor:
        """The d-wide hidden state the final norm reads: concat(Y_1, Y_2) (half width), or Y_2 (full
        width: calibration fits Y_2 to the layer's output and Y_1 to its post-attention state)."""
        return torch.cat([Y_1, Y_2], dim=-1) if self.stream_width == "half" else Y_2

    def stream_targets(self, a: torch.Tensor, h_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a block's (Y_1, Y_2) track, given the teacher's post-attention state a_l and layer
        output h_{l+1} (calibration, the heal's hidden-state loss): (a_l[:d/2], h_{l+1}[d/2:]) at half
        width, (a_l, h_{l+1}) at full width."""
        if self.stream_width == "full":
            return a, h_next
        half = a.shape[-1] // 2
        return a[..., :half], h_next[..., half:]

    # -- forward ----------------------------------------------------------------------------------
    @property
    def supports_cache(self) -> bool:
        """Whether every block's token mixer takes a transformers KV cache (`forward(cache=...)`)."""
        return all(cache_kwarg(get_path(b.base_layer, b.mixer)) for b in self.blocks)

    def _context(self, embeds, attention_mask, position_ids, cache=None) -> StackContext:
        """Masks, rotary embeddings and the load-balancing accumulator of one forward; with a `cache`,
        `embeds` are the new tokens, `attention_mask` (B, cached + new) covers the cached ones too, and
        no load-balancing loss is accumulated (decoding trains nothing)."""
        config = self.hf.config
        masks = {key: _mask_for(key, config, embeds, attention_mask, position_ids, cache)
                 for key in sorted({b.mask_key for b in self.blocks})}
        position_embeddings = self.rope(embeds, position_ids)
        aux = None
        if self.aux_loss_coef > 0 and self.spec.aux_loss and self.num_experts and cache is None:  # decoding: no loss
            row_mask = None if attention_mask is None else attention_mask.reshape(-1).to(torch.float32)
            aux = SwitchAux(self.num_experts, self.top_k, row_mask,
                            differentiable=self.router_trainable() and torch.is_grad_enabled())
        return StackContext(position_embeddings, masks, AutocastState.capture(embeds.device), aux,
                            per_layer_position=self.rope.per_layer, cache=cache, partial=self.partial_gradients)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_logits: bool = True, probe=None,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0, cache=None,
                use_cache: bool = False) -> RevFFNOutput:
        """Args: input_ids (B, T); attention_mask (B, T) 1 for tokens, 0 for padding; labels (B, T)
        with -100 where no loss is taken (shifted inside). `return_logits=False` skips the
        (B, T, V) logits (the training loop's path: the loss is computed in chunks).

        Incremental decoding, as HF's: `cache` (a transformers `DynamicCache`) holds the keys and values
        of the tokens before input_ids, which are then only the new ones; attention_mask (B, cached + T)
        covers both; position_ids default to the positions after the cached ones. `use_cache` starts a
        cache when none is given; `out.cache` is the extended one. The plain twin only: the reversible
        backward recomputes F, which would extend the cache twice.

        Raises:
            ValueError: a cache with the reversible path (training with grad), or with a token mixer
                that takes none (`supports_cache`).
        """
        hf, spec = self.hf, self.spec
        reversible = self.reversible and self.training and torch.is_grad_enabled()
        if cache is None and use_cache and not reversible and self.supports_cache:
            from transformers import DynamicCache

            cache = DynamicCache(config=hf.config)
        if cache is not None and (reversible or not self.supports_cache):
            raise ValueError("a KV cache needs the plain twin (eval, or no grad) and token mixers that take one "
                             "(`supports_cache`). Fix: model.eval(), or run without a cache.")
        sctx, X_1, X_2 = self._stack_inputs(input_ids, attention_mask, position_ids, cache)
        sctx.probe = probe
        sctx.recompute_chunk_tokens = self.recompute_chunk_tokens
        with self.debug.stack_scope():
            if self.coupling == "buffered":
                top, aux = run_buffered_stack(list(self.blocks), X_2, sctx, reversible, self.buffer_bits,
                                              MOMENTUM_SIGNS[self.buffer_momentum])
            else:
                Y_1, Y_2, aux = run_stack(list(self.blocks), X_1, X_2, sctx, reversible)
                top = self.merge(Y_1, Y_2)
        self.last_stack_stats = sctx.stats
        norm, head = get_path(hf, spec.final_norm), get_path(hf, spec.head)
        with sctx.autocast():
            hidden = norm(top.to(norm.weight.dtype))
            out = RevFFNOutput(aux_loss=aux if sctx.aux is not None else None, cache=cache)
            if labels is not None:
                loss_sum, n_tokens = causal_lm_loss(hidden, head, labels, self.chunk_tokens,
                                                   self.logits_scale, self.logits_softcap)
                out.loss_sum, out.n_tokens = loss_sum, n_tokens
                out.loss = loss_sum / n_tokens.clamp(min=1)
                if out.aux_loss is not None:
                    if sctx.aux.differentiable:
                        out.loss = out.loss + self.aux_loss_coef * aux
                    else:
                        out.aux_loss = aux.detach()
            if return_logits:
                out.logits = head_logits(hidden[:, -logits_to_keep:] if logits_to_keep else hidden, head,
                                         self.logits_scale, self.logits_softcap)
        return out

    def _stack_inputs(self, input_ids, attention_mask, position_ids, cache=None):
        """(StackContext, X_1, X_2) the blocks start from: the embeddings (times granite's embedding_multiplier),
        the masks and rotary at `position_ids` (default: the positions after a cache's tokens), the streams."""
        embeds = get_path(self.hf, self.spec.embed)(input_ids)
        if self.embed_scale != 1.0:  # granite's embedding_multiplier
            embeds = embeds * self.embed_scale
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(past, past + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        sctx = self._context(embeds, attention_mask, position_ids, cache)
        sctx.replay_routing, sctx.track_flips = self.debug.routing_replay, self.debug.track_routing_flips
        sctx.replay_rng = self.debug.rng_replay
        return (sctx, *self.split(embeds))

    def rebuild_errors(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[float]:
        """Per layer, how far the reversible backward's rebuilt input is from the forward's on this batch, in the
        streams' dtype, relative to the stream scale (`reversible.coupling.rebuild_errors`)."""
        with torch.no_grad():
            sctx, X_1, X_2 = self._stack_inputs(input_ids, attention_mask, None)
            sctx.aux = None  # nothing trains: no load-balancing sum
            if self.coupling == "buffered":
                return buffered_rebuild_errors(list(self.blocks), X_2, sctx, self.buffer_bits,
                                               MOMENTUM_SIGNS[self.buffer_momentum])
            return rebuild_errors(list(self.blocks), X_1, X_2, sctx)

    def routing_flips(self) -> int:
        """Choices (a token's top-k, a row's max ...) that the rebuilt input would have made
        differently from the record, summed over the sub-blocks, in the last reversible backward
        (0 unless `debug.track_routing_flips` was set for it)."""
        return int(self.last_stack_stats.get("routing_flips", 0))

    def adapter_parameters(self):
        return [p for n, p in self.named_parameters() if n.rsplit(".", 2)[-2] in ADAPTER_PREFIXES]


def stream_name(model: RevFFNForCausalLM) -> str:
    """The name (a key of STREAM_DTYPES) of the streams `model` runs, as revffn.json records it."""
    return next(name for name, dtype in STREAM_DTYPES.items() if dtype == model.stream_dtype)


def pick_stream_dtype(model: RevFFNForCausalLM, seed: int = 0, reduce=None) -> dict:
    """`stream_dtype: auto`: set `model.stream_dtype` to float32, or to float64 where float32 streams rebuild some
    layer's input (`RevFFNForCausalLM.rebuild_errors`, 2 x 64 random tokens of `seed`, eval mode: the same tokens
    whatever the run's seed, so every seed of a study picks alike) further than
    `AUTO_REBUILD_TOL` of the stream scale. float64 streams rebuild every input bitwise on the models measured (the
    sub-blocks compute in their own dtype from the same inputs) at twice the stream bytes (docs/engine.md).
    `reduce` (a tensor's max across processes, in place) keeps every process of a job on one choice.
    Returns the choice and the measured float32 error."""
    model.stream_dtype = torch.float32
    device = next(model.parameters()).device
    ids = torch.randint(3, model.hf.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(seed))
    was_training = model.training
    model.eval()
    try:
        errors = model.rebuild_errors(ids.to(device))
    finally:
        model.train(was_training)
    worst = torch.tensor(max(errors), dtype=torch.float64, device=device)
    if reduce is not None:
        reduce(worst)
    chosen = "float64" if not worst.item() <= AUTO_REBUILD_TOL else "float32"  # NaN: float64
    model.stream_dtype = STREAM_DTYPES[chosen]
    return {"stream_dtype": chosen, "float32_rebuild_error": worst.item(),
            "worst_layer": max(range(len(errors)), key=errors.__getitem__), "tolerance": AUTO_REBUILD_TOL}


def describe_streams(streams: dict) -> str:
    """One line on `pick_stream_dtype`'s choice, as training, `revffn convert` and `revffn check` print it."""
    return (f"stream_dtype auto: float32 streams rebuild the layer inputs to {streams['float32_rebuild_error']:.2g} "
            f"of the stream scale (tolerance {streams['tolerance']:g}): {streams['stream_dtype']} streams")


def convert(hf_model: nn.Module, *, adapter_init: str = "coordinate", stream_dtype: torch.dtype = torch.float32,
            aux_loss_coef: float | None = None, reversible: bool = True,
            adapter_skip: bool = False, stream_width: str = "half", coupling: str = "additive",
            buffer_bits: int = DEFAULT_BUFFER_BITS, buffer_momentum: str = "negative") -> RevFFNForCausalLM:
    """Convert an HF MoE causal LM (in place) into a `RevFFNForCausalLM`.

    Args:
        hf_model: an HF `*ForCausalLM` (qwen2_moe, qwen3_moe, mixtral, olmoe, or any with the
            standard decoder-layer layout).
        adapter_init: ``coordinate`` | ``zero`` | ``random`` | ``calibrated`` (see `init_adapters`).
        stream_dtype: residual stream dtype; keep fp32 with bf16 weights (see README).
        aux_loss_coef: router load-balancing loss weight; default: the HF config's.
        reversible: start in reversible mode (False: plain-autograd twin).
        adapter_skip: add the d/2 x d/2 skip adapters to F and G (`HFRevBlock`). False (here, so that
            a `final/` written before the skips existed, whose copied modeling file calls `convert`
            without it, still builds its own structure): the four adapters of the paper only. Training
            (`revffn.adapter_skip`) and `revffn convert` turn it on by default.
        stream_width: ``half`` (the paper's two d/2 streams) or ``full`` (two d-wide streams; `HFRevBlock`).
            ``half`` here, for the same reason as `adapter_skip`.
        coupling: ``additive`` (the adapters' coupling above) or ``buffered`` (every decoder layer whole on
            fixed-point streams, `reversible.buffered`: no adapters; adapter_init, adapter_skip and stream_width
            do not apply), with `buffer_bits` (k: lam = 2^-k, k bits a coordinate a layer kept for the backward)
            and `buffer_momentum` (``positive`` | ``negative``: the sign of lam, `reversible.buffered`). ``negative``
            here, for the same reason as `adapter_skip` (a directory's copied modeling file from before the key
            calls `convert` without it); training (`revffn.buffer_momentum`), `revffn convert` and `revffn check`
            default to ``positive`` (`DEFAULT_MOMENTUM`).
    Raises:
        UserError: unsupported architecture or odd hidden size.
    """
    if adapter_init not in ADAPTER_INITS:
        raise UserError(f"unknown adapter init {adapter_init!r}. Fix: use one of {', '.join(ADAPTER_INITS)}.")
    if stream_width not in STREAM_WIDTHS:
        raise UserError(f"unknown stream_width {stream_width!r}. Fix: use one of {', '.join(STREAM_WIDTHS)}.")
    model = RevFFNForCausalLM(hf_model, spec_for(hf_model), adapter_init, stream_dtype, aux_loss_coef,
                              adapter_skip=adapter_skip, stream_width=stream_width, coupling=coupling,
                              buffer_bits=buffer_bits, buffer_momentum=buffer_momentum)
    model.reversible = reversible
    model.train(hf_model.training)
    return model

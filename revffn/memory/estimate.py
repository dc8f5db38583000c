"""Analytic training-memory model: peak ~ static + activations + logits + overhead, per method.

Needs only an HF config (never weights). Bytes, per training step:

- static: ``weights`` (all params), ``grads`` and ``optimizer_states`` (trainable params only). torch's
  AdamW keeps its two states in the parameter dtype (bf16 params: bf16 states); peft keeps LoRA/DoRA
  adapters in fp32 on a bf16 model, so their weights, grads and states are fp32.
- ``activations``: peak bytes held for backward, parameters excluded, unique storages. It is
  ``activations_forward`` (what a `saved_tensors_hooks` log around the forward counts) plus, for
  methods that recompute (``ckpt``, ``revffn``), ``recompute_working_set``: the tensors one layer
  saves while its backward re-runs it. ``revffn`` includes ``routing_records`` (also reported).
- ``logits``: one chunk of the chunked cross-entropy (`revffn.models.loss`), logits and their grad.
- ``overhead``: a fixed 5% of the rest.

Per-layer saved tensors (`revffn.memory.saved`) follow transformers 5.x modules as they run (RMSNorm
in fp32, SDPA, grouped_mm experts) and depend on what needs a gradient: frozen weights keep less
(lora, dora, refta, hift), peft's parameter adapters keep the materialised W + BA of every expert.
Checked against what `revffn bench` measures, for every method on the tiny presets, fp32 and bf16
(`tests/memory/test_estimate_agreement.py`: within 0.2%).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from revffn.errors import UserError, closest
from revffn.memory.saved import Grad, aux_saved, hift_saved, layer_saved, outside_saved
from revffn.reversible.replay import compact_index_dtype

METHODS = ("full", "ckpt", "revffn", "lora", "dora", "hift", "refta")
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}  # states per trainable param, in the param dtype
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
OVERHEAD = 0.05
CHUNK_TOKENS = 1024
_COMMON_OPTS = {"padded", "attn_implementation"}
_METHOD_OPTS = {
    "full": set(), "ckpt": set(), "hift": {"group_size"}, "refta": {"rank"},
    "revffn": {"freeze_router", "stage", "stream_dtype"}, "lora": {"rank"}, "dora": {"rank"},
}


@dataclass(frozen=True)
class _Dims:
    model_type: str
    d: int
    layers: int
    heads: int
    kv: int
    hd: int
    vocab: int
    tied: bool
    experts: int
    top_k: int
    moe_inter: int
    dense_inter: int
    shared_inter: int  # qwen2_moe shared expert / glm4 n_shared_experts * moe_inter; 0 if none
    shared_gate: bool
    moe: tuple[bool, ...]  # per layer: MoE (True) or dense MLP
    qk_norm: str  # "", "head" (per head dim) or "full" (OLMoE: over all heads)
    bias_qkv: bool
    bias_o: bool
    router: str  # "softmax" or "sigmoid_group" (glm4 / deepseek-style)
    norm_topk: bool
    groups: tuple[int, int]  # (n_group, topk_group) of a sigmoid_group router
    partial_rope: bool
    rope_dim: int  # width of RoPE cos/sin
    attn_impl: str
    attn_dropout: float
    aux: bool  # router load-balancing loss on (router_aux_loss_coef > 0)
    peft_rewrites: bool  # peft (transformers 5) retargets MLP Linear names (gate_proj, ...) to fused weights


def _peft_rewrites(model_type: str) -> bool:
    try:
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN
    except ImportError:  # pragma: no cover - older transformers: no mapping, nothing rewritten
        return False
    return model_type in _MODEL_TO_CONVERSION_PATTERN or model_type == "mixtral"


def _dims(config) -> _Dims:
    c, mt = config, config.model_type
    d, L, H = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
    E = next((n for k in ("num_experts", "num_local_experts", "n_routed_experts")
              if isinstance(n := getattr(c, k, None), int) and n > 0), 0)
    if getattr(c, "first_k_dense_replace", None) is not None:
        moe = tuple(E > 0 and i >= c.first_k_dense_replace for i in range(L))
    else:
        only, step = set(getattr(c, "mlp_only_layers", None) or []), getattr(c, "decoder_sparse_step", 1) or 1
        moe = tuple(E > 0 and i not in only and (i + 1) % step == 0 for i in range(L))
    shared, gate = getattr(c, "shared_expert_intermediate_size", 0) or 0, True
    moe_inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    if not shared and getattr(c, "n_shared_experts", None):
        shared, gate = moe_inter * c.n_shared_experts, False
    qk = {"qwen3_moe": "head", "olmoe": "full"}.get(mt, "head" if getattr(c, "use_qk_norm", False) else "")
    rope = getattr(c, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor") or getattr(c, "partial_rotary_factor", None) or 1.0
    hd = getattr(c, "head_dim", None) or d // H
    return _Dims(
        model_type=mt, d=d, layers=L, heads=H, kv=getattr(c, "num_key_value_heads", None) or H,
        hd=hd, vocab=c.vocab_size,
        tied=bool(getattr(c, "tie_word_embeddings", False)), experts=E,
        top_k=getattr(c, "num_experts_per_tok", 0) or 0, moe_inter=moe_inter, dense_inter=c.intermediate_size,
        shared_inter=shared, shared_gate=gate and shared > 0, moe=moe, qk_norm=qk,
        bias_qkv=bool(getattr(c, "qkv_bias", False) or getattr(c, "attention_bias", False)),
        bias_o=bool(getattr(c, "attention_bias", False)) and mt != "glm4_moe",
        router="sigmoid_group" if getattr(c, "n_group", None) else "softmax",
        norm_topk=bool(getattr(c, "norm_topk_prob", mt == "mixtral")),
        groups=(getattr(c, "n_group", 1) or 1, getattr(c, "topk_group", 1) or 1), partial_rope=factor < 1.0,
        rope_dim=int(hd * factor),
        attn_impl=getattr(c, "_attn_implementation", None) or "sdpa",
        attn_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0),
        aux=E > 0 and float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0) > 0, peft_rewrites=_peft_rewrites(mt),
    )


# -- parameters ---------------------------------------------------------------------------------
def _attn_params(m: _Dims) -> int:
    q, kv = m.heads * m.hd, m.kv * m.hd
    return 2 * m.d * q + 2 * m.d * kv + (q + 2 * kv) * m.bias_qkv + m.d * m.bias_o


def _norm_params(m: _Dims) -> int:
    qk = {"head": 2 * m.hd, "full": (m.heads + m.kv) * m.hd}.get(m.qk_norm, 0)
    return 2 * m.d + qk


def _layer_parts(m: _Dims, i: int) -> dict[str, int]:
    parts = {"attention": _attn_params(m), "norms": _norm_params(m), "router": 0, "experts": 0,
             "shared_expert": 0, "dense_mlp": 0, "adapters_revffn": 2 * m.d * m.d}  # 4 x (d/2 x d)
    if m.moe[i]:
        parts["router"] = m.experts * m.d
        parts["experts"] = m.experts * 3 * m.d * m.moe_inter
        parts["shared_expert"] = 3 * m.d * m.shared_inter + m.d * m.shared_gate
    else:
        parts["dense_mlp"] = 3 * m.d * m.dense_inter
    return parts


def count_params(config) -> dict[str, int]:
    """Parameter counts by part, from the config. ``total`` is the base model (without
    ``adapters_revffn``, the 4 d/2 x d adapters per layer that RevFFN adds)."""
    m = _dims(config)
    out = {"embed": m.vocab * m.d, "head": 0 if m.tied else m.vocab * m.d}
    for i in range(m.layers):
        for k, v in _layer_parts(m, i).items():
            out[k] = out.get(k, 0) + v
    out["norms"] += m.d  # final norm
    out["total"] = sum(v for k, v in out.items() if k != "adapters_revffn")
    return out


# -- adapter targets ------------------------------------------------------------------------------
def _lora_targets(m: _Dims, i: int, dora: bool) -> list[tuple[int, int, int]]:
    """Layer i's matrices that peft adapts by default: (fan_in, fan_out, copies). DoRA adapts only
    Linear modules (not the fused experts, nor MLP Linears that peft retargets to their weights)."""
    q, kv = m.heads * m.hd, m.kv * m.hd
    mats = [(m.d, q, 1), (m.d, kv, 1), (m.d, kv, 1), (q, m.d, 1)]
    inter = m.dense_inter if not m.moe[i] else m.shared_inter
    if inter and not (dora and m.peft_rewrites):
        mats += [(m.d, inter, 1)] * 2 + [(inter, m.d, 1)]
    if m.moe[i] and not dora:
        mats += [(m.d, 2 * m.moe_inter, m.experts), (m.moe_inter, m.d, m.experts)]
    return mats


def _lora_trainable(m: _Dims, rank: int, dora: bool) -> int:
    return sum(copies * (rank * (fan_in + fan_out) + (fan_out if dora else 0))
               for i in range(m.layers) for fan_in, fan_out, copies in _lora_targets(m, i, dora))


# -- trainable parameters of the other methods --------------------------------------------------
def _refta_trainable(m: _Dims, rank: int) -> int:
    q, kv = m.heads * m.hd, m.kv * m.hd
    mats = [(m.d, q), (m.d, kv), (m.d, kv), (q, m.d)]
    shared_a = sum(rank * fan_in for fan_in, _ in set(mats))  # one A per distinct (in, out) shape
    return shared_a + m.layers * sum(fan_out * rank + rank * rank for _, fan_out in mats)


def _hift_groups(m: _Dims, counts: dict[str, int], group_size: int) -> list[int]:
    units = [counts["embed"]]
    units += [sum(v for k, v in _layer_parts(m, i).items() if k != "adapters_revffn") for i in range(m.layers)]
    units.append(counts["head"] + m.d)  # final norm + head (its weight is the embedding's when tied)
    return [sum(units[j : j + group_size]) for j in range(0, len(units), group_size)]


# -- the estimate ---------------------------------------------------------------------------------
def _dtype_bytes(dtype: str, what: str = "dtype") -> int:
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise UserError(f"unknown {what} {dtype!r}. Fix: use one of {', '.join(DTYPE_BYTES)}.")
    return DTYPE_BYTES[key]


def estimate(config, method: str, batch: int, seq: int, dtype: str = "float32", optimizer: str = "adamw",
             **method_options) -> dict:
    """Estimated bytes of one training step of `method` on `config` (see the module docstring).

    Options: ``padded`` (True: an attention mask is passed, as the training loop does),
    ``attn_implementation`` (``sdpa`` | ``eager``; default the config's); revffn: ``freeze_router``
    (True), ``stage`` (2: all but the router; 1: adapters only), ``stream_dtype`` (``float32``);
    lora/dora/refta: ``rank`` (16); hift: ``group_size`` (1).
    """
    if method not in METHODS:
        raise UserError(f"unknown method {method!r}.{closest(method, METHODS)} Fix: use one of {', '.join(METHODS)}.")
    unknown = set(method_options) - _COMMON_OPTS - _METHOD_OPTS[method]
    if unknown:
        raise UserError(f"unknown option(s) {', '.join(sorted(unknown))} for method {method!r}. Allowed: "
                        f"{', '.join(sorted(_COMMON_OPTS | _METHOD_OPTS[method]))}.")
    if optimizer not in OPTIMIZER_STATES:
        raise UserError(f"unknown optimizer {optimizer!r}. Fix: use one of {', '.join(OPTIMIZER_STATES)}.")
    if batch < 1 or seq < 2:
        raise UserError(f"batch={batch}, seq={seq}: need batch >= 1 and seq >= 2.")
    for key in ("rank", "group_size", "stage"):
        value = method_options.get(key, 1)
        if not isinstance(value, int) or value < 1 or (key == "stage" and value > 2):
            raise UserError(f"option {key}={value!r}: need a positive integer{' (1 or 2)' if key == 'stage' else ''}.")
    m, s, opts = _dims(config), _dtype_bytes(dtype), dict(method_options)
    B, T, N = batch, seq, batch * seq
    padded, impl = bool(opts.get("padded", True)), opts.get("attn_implementation", m.attn_impl)
    counts = count_params(config)
    base = total_params = trainable = counts["total"]
    layers = [layer_saved(m, i, B, T, s, padded, impl) for i in range(m.layers)]
    outside = outside_saved(m, B, T, s)
    aux_all = aux_saved(m, N, sum(m.moe))  # the unconverted model's load-balancing loss, router trainable
    act_fwd, working, records, adapter_bytes = outside + sum(layers) + aux_all, 0, 0, 0
    notes = [f"attention: {impl}" + (" (no T x T probabilities kept)" if impl != "eager" else
                                     " (B x heads x T x T probabilities kept in fp32)")
             + (", padded batches: mask given, k/v repeated to all heads" if padded else ", no attention mask")]
    mask_bool = B * T * T if padded else 0
    if method == "ckpt":
        # layer inputs and the mask are the checkpoints' inputs; RoPE cos/sin ride in a tuple (not kept)
        act_fwd = outside - 2 * T * m.rope_dim * s + m.layers * N * m.d * s + mask_bool + aux_all
        working = max(layers)
        notes.append("ckpt: one (B, T, d) boundary state per layer kept; one layer's saved tensors while "
                     "its backward recomputes it")
    elif method == "revffn":
        stream = _dtype_bytes(opts.get("stream_dtype", "float32"), "stream_dtype")
        idx = compact_index_dtype(max(m.experts, 2)).itemsize
        records = sum(m.moe) * N * m.top_k * idx
        act_fwd = outside + mask_bool + 2 * N * (m.d // 2) * stream + records
        adapters = counts["adapters_revffn"]
        total_params = base + adapters
        freeze = opts.get("freeze_router", True)
        trainable = adapters if opts.get("stage", 2) == 1 else total_params - (counts["router"] if freeze else 0)
        aux = 0 if freeze else N * m.experts * 4  # load-balancing surrogate on the trainable router
        extra = N * m.d * s + 2 * N * m.d * s  # P_up inputs (two d/2 halves), P_down inputs (two d-wide)
        working = max(layers[i] + extra + aux * m.moe[i] for i in range(m.layers))
        notes.append(f"revffn: two {stream}-byte d/2 streams + routing records ({idx} byte/token/choice, "
                     f"{records} bytes) kept; one layer's working set (full width, + adapters) in backward")
        notes.append(f"revffn: {adapters} adapter params; " + ("stage 1: adapters only trainable"
                     if opts.get("stage", 2) == 1 else "router frozen" if freeze else "router trainable"))
    elif method in ("lora", "dora", "refta"):
        rank = opts.get("rank", 16)
        trainable = _refta_trainable(m, rank) if method == "refta" else _lora_trainable(m, rank, method == "dora")
        total_params = base + trainable
        cast = method != "refta" and s != 4  # peft keeps adapters in fp32 on a bf16 model
        adapter_bytes = 4 if cast else s
        g = Grad(w=False, router=False, adapter=method, rank=rank, rewritten=m.peft_rewrites, cast=cast)
        act_fwd = outside_saved(m, B, T, s, embed=False, final_w=False) + sum(
            layer_saved(m, i, B, T, s, padded, impl, replace(g, inp=i > 0)) for i in range(m.layers))
        if method == "refta":
            notes.append(f"refta: rank {rank}; shared A per input width, per-layer B and core on q/k/v/o; "
                         "activations: the frozen model's (what input gradients need) + 2 (rows x rank) per "
                         "projection")
        else:
            notes.append(f"{method}: rank {rank} on q/k/v/o, shared-expert and dense MLP projections"
                         + (", every expert's gate_up and down (W + BA materialised per forward and kept)"
                            if method == "lora" else " (not the fused experts: peft's ParamWrapper refuses DoRA)")
                         + "; activations: the frozen model's (what input gradients need) + the adapters'")
        if method == "dora":
            notes.append("dora: + magnitude vectors; activations also keep the base and LoRA outputs per "
                         "targeted matrix and its weight-norm path (an in x in identity through A)")
    elif method == "hift":
        size = opts.get("group_size", 1)
        groups = _hift_groups(m, counts, size)
        trainable = max(groups)
        act_fwd = hift_saved(m, B, T, s, padded, impl, size)
        notes.append(f"hift: {len(groups)} groups of {size} unit(s) (embedding, each layer, norm+head); grads "
                     "and optimizer states for the largest group only (all params are trained in turn); "
                     "activations: the largest over groups (the active group's, plus what input gradients need "
                     "in the frozen layers above it)")
    weights = (total_params - trainable) * s + trainable * adapter_bytes if adapter_bytes else total_params * s
    a = adapter_bytes or s
    grads = trainable * a
    states = trainable * OPTIMIZER_STATES[optimizer] * a  # torch AdamW keeps its states in the param dtype
    if s != 4:
        notes.append(f"{dtype}: {s}-byte weights, grads and optimizer states ({optimizer}, states like the params)")
    logits = min(B * (T - 1), CHUNK_TOKENS) * m.vocab * 4 * 2
    notes.append(f"logits: chunked CE, one {min(B * (T - 1), CHUNK_TOKENS)}-token chunk of fp32 logits + grad")
    activations = act_fwd + working
    rest = weights + grads + states + activations + logits
    overhead = int(round(OVERHEAD * rest))
    notes.append("overhead: a fixed 5% of the rest (allocator, workspaces, stream grads); nothing else")
    return {
        "weights": weights, "grads": grads, "optimizer_states": states, "activations": activations,
        "logits": logits, "overhead": overhead, "total": rest + overhead,
        "activations_forward": act_fwd, "recompute_working_set": working, "routing_records": records,
        "trainable_params": trainable, "total_params": total_params, "notes": notes,
        "method": method, "model": getattr(config, "name_or_path", "") or m.model_type, "dtype": dtype,
        "optimizer": optimizer, "batch": B, "seq": T,
    }


# -- sizes and formatting -----------------------------------------------------------------------
_UNITS = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30,
          "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes in "80GB", "80 GiB", "512mib" (GB = 10^9, GiB = 2^30; case-insensitive)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise UserError(f"--gpu-mem {text!r} is not a size. Fix: give a number and a unit, e.g. 80GB, 80GiB, "
                        f"24000MiB (units: GB, GiB, MB, MiB, TB, TiB).")
    return int(float(match.group(1)) * _UNITS[unit])


def fits(total_bytes: int, gpu_mem: str) -> bool:
    """Whether `total_bytes` fits in `gpu_mem` (e.g. "80GB")."""
    return total_bytes <= parse_size(gpu_mem)


def _gib(n: int) -> str:
    return f"{n / 2**30:10.2f}" if n >= 2**30 / 100 or n == 0 else f"{n / 2**30:10.4f}"


def format_estimate(est: dict, gpu_mem: str | None = None) -> str:
    """A readable breakdown in GiB; with `gpu_mem`, whether it fits."""
    lines = [f"memory estimate: {est.get('model', '?')}, method {est.get('method', '?')}, batch {est.get('batch')} "
             f"x seq {est.get('seq')}, {est.get('dtype')}, {est.get('optimizer')}",
             f"  {'part':<30}{'GiB':>10}"]
    for key in ("weights", "grads", "optimizer_states", "activations", "logits", "overhead"):
        lines.append(f"  {key:<30}{_gib(est[key])}")
        if key == "activations":
            for sub in ("recompute_working_set", "routing_records"):
                if est.get(sub):
                    lines.append(f"    {'incl. ' + sub.replace('_', ' '):<28}{_gib(est[sub])}")
    lines.append(f"  {'total':<30}{_gib(est['total'])}")
    lines.append(f"  trainable params {est['trainable_params'] / 1e9:.3f}B of {est['total_params'] / 1e9:.3f}B")
    if gpu_mem is not None:
        ok = fits(est["total"], gpu_mem)
        lines.append(f"  fits on this GPU ({gpu_mem}): {'yes' if ok else 'no'}"
                     + ("" if ok else f" (needs {math.ceil(est['total'] / 2**30)} GiB)"))
    lines += [f"  note: {n}" for n in est.get("notes", [])]
    return "\n".join(lines)

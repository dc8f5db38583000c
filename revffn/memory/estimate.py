"""Analytic training-memory model: peak ~ static + activations + logits + overhead, per method.

Needs only an HF config (never weights). Bytes, per training step:

- static: ``weights`` (all params), ``grads`` and ``optimizer_states`` (trainable params only). torch's
  AdamW keeps its two states in the parameter dtype (bf16 params: bf16 states); peft keeps LoRA/DoRA
  adapters in fp32 on a bf16 model, so their weights, grads and states are fp32.
- ``activations``: peak bytes held for backward, parameters excluded, unique storages. It is
  ``activations_forward`` (what a `saved_tensors_hooks` log around the forward counts) plus, for
  methods that recompute (``ckpt``, ``revffn``), ``recompute_working_set``: the tensors one layer
  saves while its backward re-runs it. ``revffn`` includes ``routing_records`` (also reported).
- ``logits``: one chunk of the chunked cross-entropy (`revffn.conversion.loss`), logits and their grad.
- ``overhead``: a fixed 5% of the rest.

Every term is per GPU; ``batch`` is the per-GPU batch. Data-parallel (``distributed``, over ``world_size``
GPUs) changes only the static terms and adds the buffers of the strategy:

- ``ddp``: each rank holds the whole model, its gradients and optimizer states, and ``grad_buckets``:
  DDP's flat copy of the trainable gradients (torch's default ``gradient_as_bucket_view=False``).
- ``fsdp`` (FSDP2 ``fully_shard`` on each decoder layer, then the root: embedding, final norm, head):
  weights, grads and optimizer states are each 1/``world_size`` (rounded up), plus ``gathered_params``
  (the root's, which FSDP2 keeps unsharded from forward to backward, and two decoder layers': the
  current and the prefetched next) and ``unsharded_grads`` (the root's, reduce-scattered when the
  backward ends, and one layer's). A unit's share of the weight and gradient bytes is its share of
  the base model's parameters (`unit_params`), so a method's adapters count with their units (a
  teacher copy too: an overestimate, as the teacher's layers are gathered in its own forward).

The shared parts live here: the model geometry (`Dims`), parameter counts, the bytes each layer saves when
everything trains (`MemoryContext`), and the static / logits / overhead arithmetic. Each method's own part
(what trains, what its forward keeps) is its class's `memory_terms` (`revffn.methods`), with its options in
`estimate_keys()` (the SCHEMA keys named in `ESTIMATE_KEYS`, then estimator-only `ESTIMATE_OPTIONS`);
`estimate` takes the class, since this package sits below the methods and never imports them (resolve a name
with `revffn.methods.method_class`).

Per-layer saved tensors (`revffn.memory.saved`) follow transformers 5.x modules as they run (RMSNorm
in fp32, SDPA, grouped_mm experts) and depend on what needs a gradient: frozen weights keep less
(lora, dora, refta, hift), peft's parameter adapters keep the materialised W + BA of every expert.
Checked against what `revffn bench` measures, for every registered method on the tiny presets, fp32
and bf16 (`tests/memory/test_estimate_agreement.py`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace
from typing import Protocol

from revffn.archs.spec import meta_params
from revffn.errors import UserError, unread
from revffn.memory.saved import Grad, aux_saved, ffn_saved, layer_saved, outside_saved
from revffn.schema import Key, check_value, coerce

OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0}  # states per trainable param, in the param dtype
# bytes per trainable param of the optimizer states that are not in the param dtype: torchao's block-wise
# quantized AdamW (two states of 1 byte / half a byte, one fp32 scale per block of 256 / 128) and torch's
# Adafactor (factored: see `_adafactor_bytes`)
QUANTIZED_STATE_BYTES = {"adamw8bit": 2 * (1 + 4 / 256), "adamw4bit": 2 * (0.5 + 4 / 128)}
OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adafactor")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float64": 8, "fp64": 8}
OVERHEAD = 0.05
DISTRIBUTED = ("none", "ddp", "fsdp")
MAX_GPUS = 1024  # the most GPUs `gpus_needed` tries
CHUNK_TOKENS = 1024
MEASURE = ("measure it instead: revffn bench --model ... --layers 2 builds the model, and a few of its layers "
           "show what each costs.")  # the fix where the estimate does not cover a config
COMMON_OPTIONS = {  # every method's estimator options (a method adds its own: `estimate_keys()`)
    "padded": Key(bool, True, "an attention mask is given (as the training loop does): k/v repeated to all heads"),
    "attn_implementation": Key((str, type(None)), None, "sdpa | eager (null: the config's)"),
    "optimizer": Key((str, type(None)), None, "adamw | adamw8bit | adamw4bit | adafactor (null: the `optimizer` "
                     "argument)"),
    "optimizer_in_backward": Key(bool, False, "each parameter stepped as its gradient completes: one tensor's "
                                 "gradient held at a time"),
    "offload": Key(str, "none", "none | cpu: optimizer states (and gradients, as produced) in host memory",
                   choices=("none", "cpu")),
    "loss": Key(str, "chunked", "chunked (revffn's cross-entropy, a chunk of logits at a time) | hf (transformers' "
                "own, as Trainer runs it: the whole (B, T, V) logits, and their fp32 log-softmax saved)",
                choices=("chunked", "hf")),
}


@dataclass(frozen=True)
class Dims:
    """The model geometry the estimate needs, read from an HF config (`dims`)."""

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
    """Whether peft moves a shared-expert or dense-MLP Linear target (`mlp.shared_expert.gate_proj`, as
    `methods.peft_common.peft_names` passes it) to the fused experts: peft 0.21 did for the model types whose
    experts transformers fuses; from 0.22 a target that matches only Linear modules stays one."""
    try:
        import peft
        from packaging.version import Version
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN
    except ImportError:  # pragma: no cover - older transformers: no mapping, nothing rewritten
        return False
    if Version(peft.__version__) >= Version("0.22"):
        return False
    return model_type in _MODEL_TO_CONVERSION_PATTERN or model_type == "mixtral"


def dims(config) -> Dims:
    """The geometry of `config`, a decoder config of transformers' usual fields.

    Raises:
        UserError: naming the model type and the field, where the config lacks one (dbrx's `ffn_config`,
            moshi's audio decoder, ...) or holds another kind of value: a traceback before.
    """
    try:
        m = _dims(config)
    except AttributeError as e:
        raise UserError(f"{config.model_type}: the memory estimate reads a decoder config's usual fields, and this "
                        f"one has no {e.name!r}. Fix: {MEASURE}") from None
    except TypeError as e:
        raise UserError(f"{config.model_type}: the memory estimate reads a decoder config's usual fields, and one "
                        f"of this one's is not a number ({e}). Fix: {MEASURE}") from None
    other = [f.name for f in fields(Dims) if f.type == "int" and type(getattr(m, f.name)) is not int]
    if other:  # gpt_neo's intermediate_size None, gemma3n's per-layer lists
        raise UserError(f"{config.model_type}: the memory estimate reads a decoder config's usual fields, and the "
                        "geometry it reads from this one is not all numbers: "
                        f"{', '.join(f'{k}={getattr(m, k)!r}' for k in other)}. Fix: {MEASURE}")
    return m


def _dims(config) -> Dims:
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
    return Dims(
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
def _attn_params(m: Dims) -> int:
    q, kv = m.heads * m.hd, m.kv * m.hd
    return 2 * m.d * q + 2 * m.d * kv + (q + 2 * kv) * m.bias_qkv + m.d * m.bias_o


def _norm_params(m: Dims) -> int:
    qk = {"head": 2 * m.hd, "full": (m.heads + m.kv) * m.hd}.get(m.qk_norm, 0)
    return 2 * m.d + qk


def layer_params(m: Dims, i: int) -> dict[str, int]:
    """Layer i's parameter counts by part (``adapters_revffn``: the 4 d/2 x d adapters RevFFN adds;
    ``adapters_revffn_skip``: its 2 d/2 x d/2 skips, `revffn.adapter_skip`)."""
    parts = {"attention": _attn_params(m), "norms": _norm_params(m), "router": 0, "experts": 0,
             "shared_expert": 0, "dense_mlp": 0, "adapters_revffn": 2 * m.d * m.d,  # 4 x (d/2 x d)
             "adapters_revffn_skip": m.d * m.d // 2}  # 2 x (d/2 x d/2)
    if m.moe[i]:
        parts["router"] = m.experts * m.d
        parts["experts"] = m.experts * 3 * m.d * m.moe_inter
        parts["shared_expert"] = 3 * m.d * m.shared_inter + m.d * m.shared_gate
    else:
        parts["dense_mlp"] = 3 * m.d * m.dense_inter
    return parts


def count_params(config) -> dict[str, int]:
    """Parameter counts by part, from the config. ``total`` is the base model (without
    ``adapters_revffn`` and ``adapters_revffn_skip``, what RevFFN adds per layer)."""
    m = dims(config)
    out = {"embed": m.vocab * m.d, "head": 0 if m.tied else m.vocab * m.d}
    for i in range(m.layers):
        for k, v in layer_params(m, i).items():
            out[k] = out.get(k, 0) + v
    out["norms"] += m.d  # final norm
    out["total"] = sum(v for k, v in out.items() if not k.startswith("adapters_revffn"))
    return out


def unit_params(m: Dims, counts: dict[str, int]) -> list[int]:
    """Base-model parameters of the units that train or shard together: the embedding, each decoder
    layer, the final norm + head (the head's weight is the embedding's when tied)."""
    layers = [sum(v for k, v in layer_params(m, i).items() if not k.startswith("adapters_revffn"))
              for i in range(m.layers)]
    return [counts["embed"], *layers, counts["head"] + m.d]


def load_buffer_params(m: Dims, world_size: int) -> int:
    """The most elements a rank holds beyond its shards while it loads shard by shard (`models.sharded.load_shards`):
    every tensor, the per-expert ones included, is read straight into the rank's shards; only a checkpoint stored in
    another dtype, or shards on a GPU, pass through a host buffer, one tensor at a time: the rank's rows of the
    largest one (the embedding, or a dense MLP's projection) or one expert's matrix (an expert is never split
    between ranks)."""
    rows = -(-max(m.vocab, m.dense_inter if not all(m.moe) else 0) // world_size) * m.d
    return max(rows, m.d * m.moe_inter if any(m.moe) else 0)


# -- what a method's terms are computed from, and what they are -----------------------------------
@dataclass(frozen=True)
class MemoryContext:
    """The shared parts of one estimate, computed once by `estimate` and handed to the method's
    `memory_terms`. Sizes are bytes; ``s`` is bytes per weight (the training dtype)."""

    m: Dims
    B: int  # batch
    T: int  # sequence length
    s: int
    padded: bool  # an attention mask is given
    impl: str  # attention implementation: sdpa | eager
    counts: dict[str, int]  # `count_params`
    layers: tuple[int, ...]  # what each decoder layer saves for backward when everything trains
    ffn: tuple[int, ...]  # the MLP / MoE part of `layers` (`saved.ffn_saved`); the rest is attention's
    outside: int  # what the embedding, RoPE, final norm and loss save when everything trains
    aux: int  # the load-balancing loss's saved tensors, every router trainable

    @property
    def N(self) -> int:  # tokens per step
        return self.B * self.T

    @property
    def mask_bytes(self) -> int:
        """The (B, T, T) bool mask every layer shares, when padded."""
        return self.B * self.T * self.T if self.padded else 0

    @property
    def full_activations(self) -> int:
        """The forward's saved bytes of full fine-tuning: every layer, outside and the aux loss."""
        return self.outside + sum(self.layers) + self.aux

    def adapted_activations(self, g: Grad) -> int:
        """The forward's saved bytes with the base frozen and adapters `g` in every layer: what the
        input gradients need (not in the first layer: the embedding's output needs none) plus the
        adapters' own tensors."""
        m = self.m
        return outside_saved(m, self.B, self.T, self.s, embed=False, final_w=False) + sum(
            layer_saved(m, i, self.B, self.T, self.s, self.padded, self.impl, replace(g, inp=i > 0))
            for i in range(m.layers))


@dataclass(frozen=True)
class MemoryTerms:
    """A method's part of the estimate (`Method.memory_terms`): what trains and what its forward keeps."""

    trainable: int  # params with grads and optimizer states (the peak over the method's steps)
    activations_forward: int  # bytes the forward saves for backward (routing records included)
    extra_params: int = 0  # params the method adds to the base model (adapters)
    recompute_working_set: int = 0  # one layer's saved tensors while backward recomputes it
    routing_records: int = 0  # part of activations_forward, also reported
    trainable_bytes: int | None = None  # bytes per trainable param (weight, grad, state); None: ``s``
    notes: tuple[str, ...] = field(default_factory=tuple)
    loads_whole: bool = False  # the options make each process load the whole model even under FSDP (a teacher copy)


class MemoryMethod(Protocol):
    """What `estimate` needs of a method class (`revffn.methods.base.Method` has it)."""

    name: str
    DISTRIBUTED: tuple[str, ...]  # the data-parallel strategies that train it
    META_PREPARE: bool  # prepares a model without weights: under FSDP each rank loads only its shards

    def estimate_keys(self) -> dict[str, Key]: ...

    def memory_terms(self, ctx: MemoryContext, **options) -> MemoryTerms: ...


def dtype_bytes(dtype: str, what: str = "dtype") -> int:
    key = str(dtype).removeprefix("torch.").lower()
    if key not in DTYPE_BYTES:
        raise UserError(f"unknown {what} {dtype!r}. Fix: use one of {', '.join(DTYPE_BYTES)}.")
    return DTYPE_BYTES[key]


def context(config, batch: int, seq: int, s: int, padded: bool = True, impl: str | None = None) -> MemoryContext:
    """The shared parts of an estimate of `config` (everything trainable)."""
    m = dims(config)
    impl = impl or m.attn_impl
    return MemoryContext(
        m=m, B=batch, T=seq, s=s, padded=padded, impl=impl, counts=count_params(config),
        layers=tuple(layer_saved(m, i, batch, seq, s, padded, impl) for i in range(m.layers)),
        ffn=tuple(ffn_saved(m, i, batch, seq, s) for i in range(m.layers)),
        outside=outside_saved(m, batch, seq, s),
        aux=aux_saved(m, batch * seq, sum(m.moe)),  # the unconverted model's load-balancing loss
    )


def _options(method: MemoryMethod, given: dict) -> dict:
    """`given` checked against the common and the method's options, defaults filled in."""
    keys = {**COMMON_OPTIONS, **method.estimate_keys()}
    unknown = sorted(set(given) - set(keys))
    if unknown:
        raise UserError(f"--option: unknown option(s) {', '.join(map(repr, unknown))} for method {method.name!r}. "
                        f"Fix: one of {', '.join(sorted(keys))}.")
    given = {k: coerce(v, keys[k]) for k, v in given.items()}  # `--option distill_coef=1`: an int for a float
    problems = [f"{p} ({k}: {keys[k].help})" for k, v in given.items() if (p := check_value(f"option {k}", v, keys[k]))]
    if problems:
        raise UserError(" ".join(problems))
    unused = method.unused_options({k: v for k, v in given.items() if k in method.SCHEMA}) \
        if hasattr(method, "unused_options") else {}
    if unused:  # (as training refuses it: `Method.unused_options`), the first one named
        k, (reads, has) = next(iter(unused.items()))
        reads, has = (text.replace(f"{method.name}.", "") for text in (reads, has))
        raise UserError(unread(f"--option {k}={given[k]}", reads, f"this estimate has {has}",
                               f"drop it, or --option {reads}"))
    return {k: given.get(k, key.default) for k, key in keys.items()}


# -- what the estimate covers ---------------------------------------------------------------------
LAYOUT_TOLERANCE = 0.02  # the counted parameters may differ from the built model's by this share (a bias, a norm)
_covered: set[str] = set()  # configs checked already (`estimate` runs many times for one in `gpus_needed`)


def check_layout(config) -> None:
    """Refuse a config whose layers are not the ones this estimate models: the parameters it counts
    (`count_params`) against those of the model transformers builds from the config on the meta device (nothing
    allocated). On the tiny configs of the 80 model types revffn converts, the count is exact for 23 (qwen2_moe,
    qwen3_moe, mixtral, olmoe, glm4_moe, granitemoe, llama, mistral, gemma, ...), within the tolerance for 20 more,
    and 0.42-1.32x for 37 (laguna, dots3, jamba, llama4_text, deepseek_v3's MLA, ...), whose bytes it would model on
    layers they do not have. At full size the experts dominate the count (DeepSeek-V3 1.004x, Qwen3-Next 0.992x:
    estimated) where Jamba's Mamba layers do not (1.79x: refused). A config transformers cannot build on the meta
    device is not checked.

    Raises:
        UserError: naming the model type and both counts, with `revffn bench`, which measures, as the fix.
    """
    key = config.to_json_string(use_diff=False)
    if key in _covered:
        return
    counted = count_params(config)["total"]
    try:
        built = meta_params(config)
    except Exception:  # (not a causal LM transformers builds from this config alone)
        built = counted
    if abs(counted / built - 1) > LAYOUT_TOLERANCE:
        raise UserError(f"{config.model_type}: the model has {built:,} parameters, and the memory estimate's layout "
                        f"of its config counts {counted:,} ({counted / built:.2f}x): its layers are not the ones the "
                        f"estimate models, so its bytes would be wrong. Fix: {MEASURE}")
    _covered.add(key)


# -- the estimate ---------------------------------------------------------------------------------
def estimate(config, method: MemoryMethod, batch: int, seq: int, dtype: str = "float32", optimizer: str = "adamw",
             world_size: int = 1, distributed: str = "none", **options) -> dict:
    """Estimated bytes per GPU of one training step of `method` on `config` (see the module docstring).

    Args:
        method: the method's class (`revffn.methods.method_class(name)`).
        batch: sequences per GPU.
        world_size, distributed: data-parallel GPUs and strategy (``none`` | ``ddp`` | ``fsdp``).
        options: ``padded`` (True: an attention mask is passed, as the training loop does),
            ``attn_implementation`` (``sdpa`` | ``eager``; default the config's), and the method's
            ``estimate_keys()`` (revffn: ``freeze_router``, ``stage``, ``stream_dtype``, ``stream_width``,
            ``adapter_skip``, ``distill_coef``, ``recompute_chunk_tokens``; lora, dora, refta: ``r``; hift:
            ``group_size``).

    Raises:
        UserError: an unknown option, optimizer or dtype, a bad batch or sequence length, or a data-parallel
            setup that training refuses.
    """
    if not hasattr(method, "memory_terms"):
        raise TypeError(f"estimate: method must be a method class, got {method!r}; resolve a name with "
                        "revffn.methods.method_class.")
    opts = _options(method, options)
    optimizer = opts.pop("optimizer") or optimizer
    in_backward, offload, loss = opts.pop("optimizer_in_backward"), opts.pop("offload"), opts.pop("loss")
    if optimizer not in OPTIMIZER_STATES and optimizer not in OPTIMIZERS:
        raise UserError(f"unknown optimizer {optimizer!r}. Fix: use one of "
                        f"{', '.join(dict.fromkeys((*OPTIMIZERS, *OPTIMIZER_STATES)))}.")
    if batch < 1 or seq < 2:
        raise UserError(f"batch={batch}, seq={seq}: need batch >= 1 and seq >= 2.")
    _check_data_parallel(method, world_size, distributed, in_backward, offload, optimizer)
    check_layout(config)
    s = dtype_bytes(dtype)
    ctx = context(config, batch, seq, s, opts.pop("padded"), opts.pop("attn_implementation"))
    unchunked = distributed == "fsdp" and bool(opts.get("recompute_chunk_tokens"))
    if unchunked:  # training recomputes each branch whole under FSDP2 (`training.parallel.shard_model`)
        opts["recompute_chunk_tokens"] = 0
    terms = method.memory_terms(ctx, **opts)
    B, T, m = ctx.B, ctx.T, ctx.m
    notes = [f"attention: {ctx.impl}" + (" (no T x T probabilities kept)" if ctx.impl != "eager" else
                                         " (B x heads x T x T probabilities kept in fp32)")
             + (", padded batches: mask given, k/v repeated to all heads" if ctx.padded else ", no attention mask"),
             *terms.notes]
    if unchunked:
        notes.append("fsdp: the backward recomputes each branch whole (FSDP2 reduce-scatters a unit's gradient after "
                     "each call, so recompute_chunk_tokens does not apply)")
    total_params, trainable = ctx.counts["total"] + terms.extra_params, terms.trainable
    a = terms.trainable_bytes or s
    weights = (total_params - trainable) * s + trainable * a
    grads = trainable * a
    if optimizer in QUANTIZED_STATE_BYTES:
        states = int(trainable * QUANTIZED_STATE_BYTES[optimizer])
        notes.append(f"{optimizer} (torchao): {QUANTIZED_STATE_BYTES[optimizer]:.3f} bytes of states per trainable "
                     "param (block-wise quantized; tensors under 4096 elements keep fp32 states, not counted)")
    elif optimizer == "adafactor":
        states = min(_adafactor_bytes(m), trainable * 4)
        notes.append("adafactor (torch): factored second moment, fp32 row and column statistics per matrix "
                     "(a vector per 1-D param), no first moment")
    else:
        states = trainable * OPTIMIZER_STATES[optimizer] * a  # torch AdamW keeps its states in the param dtype
    largest = min(_largest_tensor(m), trainable)  # the one gradient held when they are freed as produced
    if in_backward:
        grads = largest * a
        notes.append(f"optimizer_in_backward: each parameter stepped and its gradient freed as soon as it is "
                     f"complete; at most one tensor's gradient is held ({largest / 1e6:.1f}M elements, the largest "
                     "trainable one)")
    if offload == "cpu":
        notes.append(f"offload cpu: {states / 2**30:.2f} GiB of optimizer states in host memory (not counted), "
                     "gradients moved to the host as produced (one tensor's on the device)")
        states, grads = 0, largest * a
    # the loading route (`training.step.build_run`): under FSDP, for a method that prepares a model without weights,
    # each rank holds its shards, read straight into them, plus one tensor's host buffer where the checkpoint's
    # dtype is another or the shards are on a GPU (`models.sharded`); otherwise every process builds, converts and
    # prepares the whole model on its host
    sharded_load = distributed == "fsdp" and method.META_PREPARE and not terms.loads_whole
    if sharded_load:
        host_load = math.ceil(total_params * s / world_size) + load_buffer_params(m, world_size) * s
        notes.append(f"host memory while loading: {host_load / 2**30:.2f} GiB per process, its 1/{world_size} of "
                     "the weights plus, where the checkpoint is stored in another dtype or the shards are on a GPU, "
                     "one tensor's rows read into a host buffer: the model is built on the meta device and each "
                     "rank reads only its rows and its experts, straight into its shards")
    else:
        host_load = total_params * s
        notes.append(f"host memory while loading: {host_load / 2**30:.2f} GiB per process, the whole model (and any "
                     "teacher copy) built on the host before it " + ("is sharded" if distributed == "fsdp" else
                                                                   "moves to the device"))
    if world_size > 1:
        notes[-1] += f"; {world_size} processes on one node: {world_size * host_load / 2**30:.2f} GiB"
    buckets = gathered = unsharded = 0
    if distributed == "ddp":
        buckets = trainable * a
        notes.append(f"ddp over {world_size} GPU(s): each holds the whole model, its gradients and optimizer "
                     "states, and DDP's gradient buckets, a flat copy of the trainable gradients "
                     "(gradient_as_bucket_view=False, torch's default); NCCL's own buffers not counted")
    elif distributed == "fsdp":
        gathered, unsharded = _fsdp_unsharded(m, ctx.counts, weights, trainable * a)
        weights, grads, states = (-(-x // world_size) for x in (weights, grads, states))
        notes.append(f"fsdp over {world_size} GPU(s) (FSDP2 fully_shard per decoder layer, then the root: "
                     f"embedding, final norm, head): weights, grads and optimizer states 1/{world_size} each; "
                     "unsharded while in use: the root's and two layers' parameters (current + prefetched), the "
                     "root's and one layer's gradients (before their reduce-scatter); NCCL's own buffers not "
                     "counted")
    if s != 4:
        notes.append(f"{dtype}: {s}-byte weights and grads" + (
            f", {optimizer} states like the params" if optimizer in OPTIMIZER_STATES and offload != "cpu" else ""))
    act_fwd, working = terms.activations_forward, terms.recompute_working_set
    if loss == "hf":  # the head's output whole, upcast; cross-entropy saves its fp32 log-softmax
        logits = B * T * m.vocab * (s + 4)
        act_fwd += B * T * m.vocab * 4
        notes.append("loss hf: transformers' cross-entropy on the whole batch: the (B, T, V) logits and their fp32 "
                     "log-softmax (saved for backward), then its gradient")
    else:
        logits = min(B * (T - 1), CHUNK_TOKENS) * m.vocab * 4 * 2
        notes.append(f"logits: chunked CE, one {min(B * (T - 1), CHUNK_TOKENS)}-token chunk of fp32 logits + grad")
    activations = act_fwd + working
    rest = weights + grads + states + buckets + gathered + unsharded + activations + logits
    overhead = int(round(OVERHEAD * rest))
    notes.append("overhead: a fixed 5% of the rest (allocator, workspaces, stream grads); nothing else")
    return {
        "weights": weights, "grads": grads, "optimizer_states": states, "grad_buckets": buckets,
        "gathered_params": gathered, "unsharded_grads": unsharded, "activations": activations,
        "logits": logits, "overhead": overhead, "total": rest + overhead,
        "activations_forward": act_fwd, "recompute_working_set": working, "routing_records": terms.routing_records,
        "trainable_params": trainable, "total_params": total_params, "notes": notes,
        "method": method.name, "model": getattr(config, "name_or_path", "") or m.model_type, "dtype": dtype,
        "optimizer": optimizer, "optimizer_in_backward": in_backward, "offload": offload, "batch": B, "seq": T,
        "world_size": world_size, "distributed": distributed, "host_load_bytes": host_load,
        "host_load_route": "sharded" if sharded_load else "whole",
    }


FSDP_OPTIMIZERS = ("adamw", "adafactor")  # the optimizers training shards (`training.parallel.pick_distributed`)


def _check_data_parallel(method: MemoryMethod, world_size: int, distributed: str, in_backward: bool,
                         offload: str, optimizer: str) -> None:
    """Refuse, all problems at once, what data-parallel training refuses (`training.parallel.pick_distributed`):
    a method that cannot train data-parallel, parameters stepped in backward and gradients offloaded as
    they are made (both before the gradient is all-reduced or reduce-scattered)."""
    if distributed not in DISTRIBUTED:
        raise UserError(f"--distributed {distributed!r} is not a strategy. Fix: one of {', '.join(DISTRIBUTED)}.")
    problems = []
    if not isinstance(world_size, int) or world_size < 1:
        problems.append(f"--world-size {world_size}: need at least one GPU. Fix: --world-size 1 or more.")
    elif distributed == "none" and world_size > 1:
        problems.append(f"--world-size {world_size} with --distributed none: one process trains on one GPU. "
                        "Fix: --distributed fsdp (or ddp), or --world-size 1.")
    if distributed != "none" and distributed not in method.DISTRIBUTED:
        problems.append(f"--distributed {distributed}: method {method.name!r} does not train under it (training "
                        "refuses it). Fix: --distributed none, or another method.")
    if distributed == "fsdp" and optimizer not in FSDP_OPTIMIZERS:
        problems.append(f"optimizer={optimizer} under fsdp: training shards the state of "
                        f"{' and '.join(FSDP_OPTIMIZERS)} only. Fix: --option optimizer=adafactor (or adamw), or "
                        "--distributed ddp.")
    if distributed != "none" and offload != "none":
        problems.append(f"offload={offload} moves each gradient to the host as it is made, before {distributed} "
                        "reduces it across GPUs (training refuses it). Fix: --option offload=none, or "
                        "--distributed none.")
    if distributed != "none" and in_backward:
        problems.append(f"optimizer_in_backward: true steps each parameter in backward, before {distributed} "
                        "reduces its gradient across GPUs (training refuses it). Fix: --option "
                        "optimizer_in_backward=false, or --distributed none.")
    if problems:
        raise UserError(" ".join(problems))


def _fsdp_unsharded(m: Dims, counts: dict[str, int], weights: int, grads: int) -> tuple[int, int]:
    """FSDP2's unsharded buffers at the peak, in bytes: (the parameters of the root and two decoder
    layers, the gradients of the root and one layer). A unit's part of `weights` and `grads` (unsharded)
    is its share of the base model's parameters."""
    units = unit_params(m, counts)
    root, layer = units[0] + units[-1], max(units[1:-1])
    return (math.ceil((root + 2 * layer) * weights / counts["total"]),
            math.ceil((root + layer) * grads / counts["total"]))


def _largest_tensor(m: Dims) -> int:
    """Elements of the largest single parameter tensor: the embedding (or head), or one layer's fused expert
    gate_up (E, 2I, d), or a dense MLP matrix."""
    return max(m.vocab * m.d, m.experts * 2 * m.moe_inter * m.d, m.dense_inter * m.d * 2 if not any(m.moe) else 0)


def _adafactor_bytes(m: Dims) -> int:
    """fp32 Adafactor statistics: rows + columns of each matrix (per expert for the 3-D expert tensors,
    factored over the last two dims), the full vector for 1-D params."""
    q, kv = m.heads * m.hd, m.kv * m.hd
    attn = (m.d + q) * 2 + (m.d + kv) * 2  # q, o and k, v
    per_layer = []
    for moe in m.moe:
        mlp = (m.experts * ((2 * m.moe_inter + m.d) + (m.d + m.moe_inter)) + (m.experts + m.d)
               + 3 * (m.d + m.shared_inter)) if moe else 3 * (m.d + m.dense_inter)
        per_layer.append(attn + mlp + 2 * m.d + 2 * m.d * 2 + 2 * m.d)  # + norms, + RevFFN's 4 adapters and 2
        # skips (rows + cols)
    return 4 * (sum(per_layer) + 2 * (m.vocab + m.d) + m.d)


def gpus_needed(config, method: MemoryMethod, batch: int, seq: int, dtype: str, gpu_mem: str,
                **options) -> int | None:
    """The fewest GPUs, up to `MAX_GPUS`, on which FSDP training fits `gpu_mem` per GPU; None if not even
    `MAX_GPUS`. The per-GPU total never grows with the GPU count (only the sharded terms change), so
    bisect."""
    def fits_on(n: int) -> bool:
        return fits(estimate(config, method, batch, seq, dtype, world_size=n, distributed="fsdp", **options)["total"],
                    gpu_mem)

    if not fits_on(MAX_GPUS):
        return None
    too_few, enough = 0, MAX_GPUS
    while enough - too_few > 1:
        mid = (too_few + enough) // 2
        too_few, enough = (too_few, mid) if fits_on(mid) else (mid, enough)
    return enough


def configurations(config, method: MemoryMethod, batch: int, seq: int, dtype: str, gpu_mem: str,
                   world_size: int = 1, distributed: str = "none", **options) -> list[dict]:
    """Every optimizer x in-backward x offload combination of `method` (data-parallel: without the
    in-backward step and the offload, which it refuses), each with its per-GPU total and whether it fits `gpu_mem`
    (fsdp: with ``gpus``, the fewest GPUs it fits on, `gpus_needed`), smallest first (what `revffn
    estimate --gpu-mem` lists)."""
    rows = []
    for opt in FSDP_OPTIMIZERS if distributed == "fsdp" else OPTIMIZERS:
        for in_bwd in (False, True) if distributed == "none" else (False,):
            for off in ("none", "cpu") if distributed == "none" else ("none",):
                variant = {**options, "optimizer": opt, "optimizer_in_backward": in_bwd, "offload": off}
                est = estimate(config, method, batch, seq, dtype, world_size=world_size, distributed=distributed,
                               **variant)
                rows.append({"optimizer": opt, "optimizer_in_backward": in_bwd, "offload": off,
                             "total": est["total"], "fits": fits(est["total"], gpu_mem)})
                if distributed == "fsdp":
                    rows[-1]["gpus"] = gpus_needed(config, method, batch, seq, dtype, gpu_mem, **variant)
    return sorted(rows, key=lambda r: r["total"])

# -- sizes and formatting -----------------------------------------------------------------------
_UNITS = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30,
          "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """Bytes in "80GB", "80 GiB", "512mib" (GB = 10^9, GiB = 2^30; case-insensitive)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if unit in ("k", "m", "g", "t"):  # nvidia-smi's GiB, or a vendor's GB: 7 % apart at 80
        raise UserError(f"--gpu-mem {text!r}: {unit.upper()} alone is ambiguous. Fix: {match.group(1)}{unit.upper()}B "
                        f"(10^3 steps) or {match.group(1)}{unit.upper()}iB (2^10 steps, as nvidia-smi counts).")
    if not match or unit not in _UNITS:
        raise UserError(f"--gpu-mem {text!r} is not a size. Fix: give a number and a unit, e.g. 80GB, 80GiB, "
                        f"24000MiB (units: GB, GiB, MB, MiB, TB, TiB).")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise UserError(f"--gpu-mem {text!r}: no memory to fit in. Fix: the GPU's memory, e.g. 80GB.")
    return size


def fits(total_bytes: int, gpu_mem: str) -> bool:
    """Whether `total_bytes` fits in `gpu_mem` (e.g. "80GB")."""
    return total_bytes <= parse_size(gpu_mem)


def _gib(n: int) -> str:
    return f"{n / 2**30:10.2f}" if n >= 2**30 / 100 or n == 0 else f"{n / 2**30:10.4f}"


def format_estimate(est: dict, gpu_mem: str | None = None) -> str:
    """A readable per-GPU breakdown in GiB; with `gpu_mem`, whether it fits (and, with ``gpus_needed``
    in `est`, on how many GPUs FSDP fits)."""
    lines = [f"memory estimate per GPU (distributed {est['distributed']}, world size {est['world_size']}): "
             f"{est.get('model', '?')}, method {est.get('method', '?')}, batch {est.get('batch')} per GPU "
             f"x seq {est.get('seq')}, {est.get('dtype')}, {est.get('optimizer')}",
             f"  {'part':<30}{'GiB':>10}"]
    for key in ("weights", "grads", "optimizer_states", "grad_buckets", "gathered_params", "unsharded_grads",
                "activations", "logits", "overhead"):
        if key in ("grad_buckets", "gathered_params", "unsharded_grads") and not est[key]:
            continue  # the buffers of a data-parallel strategy
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
    if gpu_mem is not None and "gpus_needed" in est:
        n = est["gpus_needed"]
        floor = (1 + OVERHEAD) * sum(est[k] for k in ("gathered_params", "unsharded_grads", "activations", "logits"))
        lines.append(f"  fsdp: fits on {n} or more GPUs of {gpu_mem}" if n else
                     f"  fsdp: does not fit on {MAX_GPUS} GPUs of {gpu_mem}: what sharding leaves (unsharded "
                     f"parameters and gradients, activations, logits, + 5%) is {floor / 2**30:.2f} GiB per GPU")
    lines += [f"  note: {n}" for n in est.get("notes", [])]
    if gpu_mem is not None and est.get("configurations"):
        gpus = "gpus" in est["configurations"][0]
        lines += ["", f"  configurations of this method on {gpu_mem}, per GPU (smallest first"
                  + (f"; GPUs: the fewest fsdp fits on, - if over {MAX_GPUS}" if gpus else "") + "):",
                  f"  {'optimizer':<11}{'in-backward':<13}{'offload':<9}{'GiB':>9}  fits" + ("  GPUs" if gpus else "")]
        for r in est["configurations"]:
            row = (f"  {r['optimizer']:<11}{str(r['optimizer_in_backward']).lower():<13}{r['offload']:<9}"
                   f"{_gib(r['total']):>9}  {'yes' if r['fits'] else 'no':<4}")
            lines.append((row + (f"{r['gpus'] or '-':>5}" if gpus else "")).rstrip())
    return "\n".join(lines)

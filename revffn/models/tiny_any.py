"""Tiny random configs for ANY HF causal LM, MoE or dense, built from the config class's own defaults.

`tiny_config_for("jamba")` starts from `JambaConfig()` and shrinks every size key it has (table
`TINY_SIZES`): hidden 64, 4 heads, 2 KV heads, head_dim 16, 4 experts, top-2, widths 32-64,
vocab 256, small MLA ranks, small linear-attention / SSM state. Per-layer lists (`layer_types`,
`mlp_layer_types`, ...) are re-sampled so that every layer kind of the full model still appears,
which sets the layer count (at least 2). Nested model configs (a multimodal model's `text_config`,
`vision_config`, ...) are shrunk the same way. Dropout and jitter keys are set > 0: the sweep trains
with every stochastic feature on; granite-style scale keys are set off their neutral 1.0. What the
table cannot express lives in `TYPE_OVERRIDES`.

The sweep covers two families (`model_families()`): `moe_model_types()`, every type with a
causal-LM class whose config has an MoE key, and `dense_model_types()`, every other type with a
causal-LM class. A multimodal wrapper whose `text_config` has an MoE key (llama4, qwen3_5_moe, ...)
is in neither: its decoder is swept as its own `*_text` MoE type.

    from revffn.models.tiny_any import tiny_model_for
    model = tiny_model_for("deepseek_v3")       # an ordinary HF *ForCausalLM, random weights
"""

from __future__ import annotations

import functools

import torch
import transformers

from revffn.archs.architectures import MOE_SUBCONFIGS, has_moe_keys
from revffn.errors import UserError, closest

# key -> tiny value, applied where the config has the key and its default is a positive int.
TINY_SIZES: dict[str, int] = {
    # geometry
    "hidden_size": 64, "d_model": 64, "num_attention_heads": 4, "n_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "kv_channels": 16, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
    "swa_head_dim": 16, "vocab_size": 256, "vocab_size_per_layer_input": 256, "unpadded_vocab_size": 256,
    "ngram_vocab_size_base": 256, "split_ngram_parts": 2, "make_ngram_vocab_size_divisible_by": 8,
    "max_position_embeddings": 256, "max_seq_len": 256, "model_max_length": 256,
    # GPT-2 and encoder-decoder names of the same sizes (dense types)
    "n_embd": 64, "n_head": 4, "n_positions": 256, "n_ctx": 256, "max_target_positions": 256,
    "max_source_positions": 256, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_layers": 2,
    "emb_dim": 64, "hidden_size_global": 64, "encoder_hash_byte_group_vocab": 256,
    # FFN widths
    "intermediate_size": 64, "dense_intermediate_size": 64, "intermediate_size_mlp": 64, "ffn_hidden_size": 64,
    "prefix_dense_intermediate_size": 64, "moe_intermediate_size": 32, "expert_ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32, "shared_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32, "n_inner": 64, "dff": 64, "ffn_dim": 64, "d_ff": 64,
    "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
    # experts and routing
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2, "top_k_experts": 2,
    "moe_top_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1, "zero_expert_num": 2,
    "n_group": 2, "num_expert_group": 2, "topk_group": 1, "router_hidden_size": 16,
    # MLA and sparse-attention indexers
    "kv_lora_rank": 16, "q_lora_rank": 32, "o_lora_rank": 16, "o_groups": 2, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "qk_head_dim": 24, "v_head_dim": 16, "rotary_dim": 8, "index_head_dim": 16,
    "index_n_heads": 2, "index_topk": 8, "index_topk_blocks": 2, "index_block_size": 8, "indexer_head_dim": 16,
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_budget": 8, "block_size": 8,
    # linear attention, SSM, short convolutions
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 16, "linear_num_heads": 4, "mamba_d_state": 8, "ssm_state_size": 8, "mamba_dt_rank": 8,
    "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_n_groups": 1,
    "n_groups": 1, "mamba_chunk_size": 16, "chunk_size": 16, "d_rel": 8, "rel_extent": 16,
    # low-rank extras
    "hidden_size_per_layer_input": 16, "ple_embed_dim": 16, "gated_norm_rank": 8, "loop_gate_rank": 8,
    "hc_lowrank": 8, "heads_per_ngram": 2,
    # windows
    "sliding_window": 8, "sliding_window_size": 8, "attention_chunk_size": 8, "keep_window_size": 8,
    "floor_scale": 8,
    # extra prediction heads are not part of the causal-LM forward
    "num_nextn_predict_layers": 0, "num_mtp_layers": 0,
}
# expert counts are set exactly (not "at most"): a 1-expert default would hide the routing
EXACT = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# boolean switches that turn the MoE on where it is off by default
MOE_SWITCHES = ("is_moe", "enable_moe_block")
# keys whose default None breaks the model (or hides the MoE), filled with a tiny value
FILL_NONE: dict[str, int] = {
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "head_dim": 16, "indexer_n_heads": 2,
    "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8, "indexer_compress_ratio": 4,
    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
}
# (a, b): when the defaults have a == b, the tiny config keeps a == b (b's tiny value)
COUPLED: tuple[tuple[str, str], ...] = (("num_key_value_heads", "num_attention_heads"),
                                        ("head_dim", "qk_rope_head_dim"))
# layer-pattern counts: at most 1, so a 2-layer model has both kinds
DENSE_PREFIX_KEYS = ("first_k_dense_replace", "num_dense_layers")
TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "eod_token_id": 3, "sep_token_id": 4}
# scale keys whose default is the neutral 1.0: set off 1 so a converted model that ignores them shows it
NON_NEUTRAL: dict[str, float] = {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "attention_multiplier": 0.5,
                                 "logits_scaling": 2.0}
SOFTCAP = 0.1  # *_logit_softcapping: small enough to bend a tiny random model's logits
STOCHASTIC = 0.1  # every dropout / jitter / pdrop key: the sweep trains with randomness on
STOCHASTIC_MARKS = ("dropout", "jitter", "pdrop")
SUBCONFIGS = ("attn_config",)  # other sub-config dicts whose keys are shrunk too
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layers", "num_layers", "n_layer", "decoder_layers")
INDEX_LIST_KEYS = ("moe_layers", "mlp_only_layers", "ple_layer_ids", "local_layer_ids")
MAX_LAYERS = 6

# Per type: what the table cannot express (layer-pattern periods, coupled sizes, kernels off).
TYPE_OVERRIDES: dict[str, dict] = {
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, clip_qkv=8.0)),  # its default lacks both
    "lfm2_moe": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),  # default None breaks
    "dots3_note_text": dict(head_dim=24),  # its sliding layers need head_dim = qk_nope_head_dim + qk_rope_head_dim
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),  # default: all Mamba
    "diffllama": dict(attention_dropout=0.0),  # it refuses attention dropout
    "reformer": dict(is_decoder=True, axial_pos_embds=False),  # its causal-LM class needs is_decoder
    "mamba2": dict(num_heads=8),  # num_heads * head_dim = expand * hidden_size
    "falcon_h1": dict(mamba_d_ssm=64),  # mamba_n_heads * mamba_d_head
    "nemotron": dict(num_key_value_heads=2),  # its default None breaks the attention
    "jamba": dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),  # layers: mamba+MLP, attention+MoE, mamba+MLP, mamba+MoE
    "kolibri1_1": dict(num_hidden_layers=4, layer_types=["sliding_attention", "indexed_attention"] * 2,
                       index_layers=[1], kv_source_layers=[0, 1, 2, 1], mlp_only_layers=[0],
                       index_num_heads=2),  # layer 3 reads the K/V of layer 1
}


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _is_model_config(key: str, value) -> bool:
    """A nested model config (`text_config`, `vision_config`, ...: a dict with its own model_type)."""
    return isinstance(value, dict) and bool(value.get("model_type")) and key not in MOE_SUBCONFIGS + SUBCONFIGS


@functools.cache
def _families() -> dict[str, str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for mt in CONFIG_MAPPING_NAMES:
        if mt not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            continue
        try:
            d = _config_class(mt)().to_dict()
        except Exception:  # a default that does not validate: judge the class annotations
            d = dict.fromkeys(getattr(_config_class(mt), "__annotations__", {}))
        if has_moe_keys(d):
            out[mt] = "moe"
        elif not (isinstance(d.get("text_config"), dict) and has_moe_keys(d["text_config"])):
            out[mt] = "dense"  # (an MoE text_config: the wrapper's decoder is swept as its *_text type)
    return out


def model_families() -> dict[str, str]:
    """{model type: "moe" or "dense"} for every type the sweep covers, in transformers' order
    (see the module docstring)."""
    return dict(_families())


def moe_model_types() -> list[str]:
    """Every model type with a causal-LM class whose config (or `ffn_config`) has an MoE key."""
    return [mt for mt, family in _families().items() if family == "moe"]


def dense_model_types() -> list[str]:
    """Every other model type with a causal-LM class, but multimodal wrappers of an MoE `text_config`."""
    return [mt for mt, family in _families().items() if family == "dense"]


def _shrink(d: dict, stochastic: float | dict[str, float], prefix: str = "") -> dict:
    """The tiny values for the size and stochastic keys `d` has (recursing into sub-config dicts;
    a nested model config is returned whole, shrunk as its own model's)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k in MOE_SUBCONFIGS + SUBCONFIGS:
            out[k] = _shrink(v, stochastic, f"{prefix}{k}.")
        elif _is_model_config(k, v):
            out[k] = {**v, **_tiny_kwargs(v, stochastic, f"{prefix}{k}.")}
        elif _is_stochastic(k, v):
            out[k] = stochastic.get(prefix + k, 0.0) if isinstance(stochastic, dict) else stochastic
        elif k in TINY_SIZES and _is_int(v) and v > 0:
            out[k] = TINY_SIZES[k] if k in EXACT else min(v, TINY_SIZES[k])
        elif k in NON_NEUTRAL and v == 1.0:
            out[k] = NON_NEUTRAL[k]
        elif k.endswith("logit_softcapping") and isinstance(v, float):
            out[k] = SOFTCAP
        elif k in MOE_SWITCHES and v is False:
            out[k] = True
        elif k == "per_layer_config" and v:
            out[k] = {}  # per-layer size exceptions: the tiny model is uniform
        elif k == "use_mamba_kernels":
            out[k] = False
        elif k in FILL_NONE and v is None:
            out[k] = FILL_NONE[k]
        elif k in DENSE_PREFIX_KEYS and _is_int(v) and v > 0:
            out[k] = 1
        elif k in TOKEN_IDS and v is not None and not (_is_int(v) and v < TINY_SIZES["vocab_size"]):
            out[k] = TOKEN_IDS[k]
    for a, b in COUPLED:
        if _is_int(d.get(a)) and d.get(a) == d.get(b) and b in out:
            out[a] = out[b]
    return out


def _is_stochastic(key: str, value) -> bool:
    return any(s in key for s in STOCHASTIC_MARKS) and (isinstance(value, float) or value is None)


def stochastic_keys(model_type: str) -> list[str]:
    """The config keys of `model_type` that switch randomness on in training (dotted in sub-configs):
    every float / None key named like a dropout, jitter or pdrop."""
    fixed = TYPE_OVERRIDES.get(model_type, {})  # a key the type's override pins is not switched

    def walk(d: dict, prefix: str) -> list[str]:
        out = []
        for k, v in d.items():
            if isinstance(v, dict) and (k in MOE_SUBCONFIGS + SUBCONFIGS or _is_model_config(k, v)):
                out += walk(v, f"{prefix}{k}.")
            elif _is_stochastic(k, v) and not (prefix == "" and k in fixed):
                out.append(prefix + k)
        return out

    return walk(_config_class(model_type)().to_dict(), "")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _layer_sample(d: dict, n0: int) -> list[int]:
    """Layer indices of the full model that cover every distinct combination of per-layer kinds."""
    lists = [v for k, v in d.items() if isinstance(v, list) and len(v) == n0 and k not in INDEX_LIST_KEYS]
    seen, idx = set(), []
    for i in range(n0):
        kind = tuple(str(v[i]) for v in lists)
        if kind not in seen:
            seen.add(kind)
            idx.append(i)
    idx = idx[:MAX_LAYERS]
    i = 0
    while len(idx) < 2 and i < n0:  # at least two layers
        if i not in idx:
            idx.append(i)
        i += 1
    return sorted(idx)


def _tiny_kwargs(d: dict, stochastic: float | dict[str, float], prefix: str = "") -> dict:
    """The keys of config dict `d` that the tiny config changes: sizes (`_shrink`), and the layer
    count with every per-layer list re-sampled (`_layer_sample`)."""
    kw = _shrink(d, stochastic, prefix)
    n_key = next((k for k in LAYER_COUNT_KEYS if _is_int(d.get(k))), None)
    if n_key is not None:
        n0 = d[n_key]
        idx = _layer_sample(d, n0)
        kw[n_key] = len(idx)
        for k, v in d.items():
            if not isinstance(v, list):
                continue
            if k in INDEX_LIST_KEYS and all(isinstance(x, int) for x in v):
                kw[k] = [j for j, i in enumerate(idx) if i in v]
            elif len(v) == n0:
                kw[k] = [v[i] for i in idx]
    return kw


def tiny_config_for(model_type: str, stochastic: float | dict[str, float] = STOCHASTIC, **overrides):
    """A tiny HF config of `model_type`, from its config class's defaults (see module docstring).

    Args:
        model_type: an HF `model_type` (`model_families()` lists the swept ones).
        stochastic: the value of every dropout / jitter key (0 turns the keyed randomness off), or
            {dotted key: value} to switch on only those (the others are 0); see `stochastic_keys`.
        overrides: config keys set last.
    Raises:
        UserError: unknown model type.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        raise UserError(f"unknown model_type {model_type!r}.{closest(model_type, CONFIG_MAPPING_NAMES)} "
                        f"Fix: use a model type of transformers {transformers.__version__}.")
    cls = _config_class(model_type)
    kw = _tiny_kwargs(cls().to_dict(), stochastic)
    for k, v in TYPE_OVERRIDES.get(model_type, {}).items():
        kw[k] = {**kw[k], **v} if isinstance(v, dict) and isinstance(kw.get(k), dict) else v
    kw.update(overrides)
    return cls(**kw)


def tiny_model_for(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                   stochastic: float | dict[str, float] = STOCHASTIC, **overrides):
    """A tiny random HF causal LM of `model_type`, MoE or dense (fp32, weights seeded)."""
    config = tiny_config_for(model_type, stochastic, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype)

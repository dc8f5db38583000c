"""Tiny random models built from real HF config classes, for tests, checks and the bench.

`tiny_model("tiny-qwen2-moe", num_hidden_layers=8)` returns an ordinary HF `*ForCausalLM`.
Nothing is downloaded: the config is built in code and the weights are random (seeded).
"""

from __future__ import annotations

import torch
import transformers

from revffn.errors import UserError, closest

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (HF config class, overrides of _COMMON). Widths are given relative to hidden 64.
TINY_PRESETS: dict[str, tuple[str, dict]] = {
    "tiny-qwen2-moe": (
        "Qwen2MoeConfig",
        dict(intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
             num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=False),
    ),
    "tiny-qwen3-moe": (
        "Qwen3MoeConfig",
        dict(intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
             head_dim=16, norm_topk_prob=True),
    ),
    "tiny-mixtral": (
        "MixtralConfig",
        dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    ),
    "tiny-olmoe": (
        "OlmoeConfig",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    ),
    # Not a registered architecture: converts through the generic spec. Its first layer is dense
    # (first_k_dense_replace=1) and its router is sigmoid + group-limited top-k.
    "tiny-glm4-moe": (
        "Glm4MoeConfig",
        dict(intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
             n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, head_dim=16,
             norm_topk_prob=True),
    ),
}

_WIDTH_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def tiny_config(name: str, **overrides):
    """The HF config of a tiny preset. `hidden_size` overrides scale the other widths with it."""
    if name not in TINY_PRESETS:
        raise UserError(f"unknown model preset {name!r}.{closest(name, TINY_PRESETS)} "
                        f"Available presets: {', '.join(TINY_PRESETS)}; or give a local HF model directory.")
    cls_name, extra = TINY_PRESETS[name]
    kw = {**_COMMON, **extra}
    if "hidden_size" in overrides:
        scale = overrides["hidden_size"] / kw["hidden_size"]
        for key in _WIDTH_KEYS:
            if key in kw and key not in overrides:
                kw[key] = max(8, int(kw[key] * scale))
    kw.update(overrides)
    config = getattr(transformers, cls_name)(**kw)
    config._attn_implementation = "sdpa"
    return config


def tiny_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides):
    """A tiny random HF MoE causal LM of a real architecture (see `TINY_PRESETS`)."""
    config = tiny_config(name, **config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype)

"""`ArchSpec`: where the pieces of one HF MoE architecture live (data, not code).

The per-architecture specs live one file each (`qwen2_moe.py`, ...) and are collected, with the
generic fallback, in `revffn.archs.architectures`. What the pieces compute together (the two
branches F and G at full width) is `revffn.archs.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ArchSpec:
    """Where the pieces of one HF MoE architecture live, and its quirks.

    Paths are attribute paths (dotted where the pieces are nested): model-level ones from the
    `*ForCausalLM` object, layer-level ones from one decoder layer, `router` from the layer's MoE
    block. Config keys may be dotted too (`ffn_config.moe_num_experts`). The two branches read, at
    full width d (`layout.attn_branch`, `layout.mlp_branch`):

        attn branch = s * attn_post_norm( mixer( attn_norm(x) ) )          (then dropout p, if keyed)
        mlp branch  = s * mlp_post_norm( mlp( mlp_norm(x) ) + shared_mlp( mlp_norm(x) ) )

    with s = config[branch_scale_key] (granite's `residual_multiplier`), `mixer` the layer's
    `attn` or, where it has none, the first of `mixers` it has (a linear-attention, SSM or
    convolution token mixer of a hybrid stack), and any norm or shared MLP set to None skipped.
    """

    model_type: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    rotary: str | None = "model.rotary_emb"  # None: no model-level RoPE (position_embeddings is None)
    head: str = "lm_head"
    attn_norm: str | None = "input_layernorm"  # None: no pre-norm (flex_olmo's post-norm-only layout)
    attn: str = "self_attn"
    mixers: tuple[str, ...] = ()  # other token mixers a layer may hold instead of `attn` (hybrid stacks)
    attn_post_norm: str | None = None  # sandwich norm on the attention output, before the residual add
    mlp_norm: str | None = "post_attention_layernorm"  # "input_layernorm" too for a parallel block
    mlp: str = "mlp"
    mlp_post_norm: str | None = None  # sandwich norm on the MoE output, before the residual add
    shared_mlp: str | None = None  # a dense MLP beside the MoE, on the same normed input (added)
    parallel: bool = False  # HF feeds attention and MoE the same input: h + a(h) + m(h) (cohere2_moe)
    branch_scale_key: str | None = None  # Y_1 = X_1 + s * F(X_2), Y_2 = X_2 + s * G(Y_1)
    branch_dropout_key: str | None = None  # dropout the layer's own code applies to each branch output
    embed_scale_key: str | None = None  # embeddings * config[key] before the split
    logits_divisor_key: str | None = None  # logits / config[key]
    logits_scale_key: str | None = None  # logits * config[key]
    logits_softcap_key: str | None = None  # logits = c * tanh(logits / c), c = config[key]
    router: str = "gate"
    router_logits_index: int = 0  # router(...) returns (logits, weights, indices)
    num_experts_keys: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")
    top_k_key: str = "num_experts_per_tok"
    aux_loss: bool = True  # HF trains it with the Switch load-balancing loss on softmax(logits)
    sliding_window_all_layers: bool = False  # config.sliding_window -> sliding mask in every layer
    unsupported: str = ""  # why this architecture cannot convert (the refusal names it); "" converts
    notes: str = ""

    def num_experts(self, config) -> int:
        for key in self.num_experts_keys:
            n = config_value(config, key)
            if isinstance(n, int) and n > 0:
                return n
        return 0

    def top_k(self, config) -> int:
        return config_value(config, self.top_k_key) or 0

    def mixer_name(self, layer: nn.Module) -> str | None:
        """The token mixer this layer holds: `attn`, else the first of `mixers` it has (None: none)."""
        for name in (self.attn, *self.mixers):
            if get_path(layer, name, None) is not None:
                return name
        return None

    def scale_keys(self) -> dict[str, str]:
        """{config key: spec field} for every model-level scale this spec applies."""
        fields = ("branch_scale_key", "embed_scale_key", "logits_divisor_key", "logits_scale_key",
                  "logits_softcap_key")
        return {getattr(self, f): f for f in fields if getattr(self, f)}


_MISSING = object()


def get_path(root, path: str, default=_MISSING):
    """`root.a.b.c` for path "a.b.c"; `default` (if given) where a part is missing."""
    for part in path.split("."):
        root = getattr(root, part, _MISSING) if default is not _MISSING else getattr(root, part)
        if root is _MISSING:
            return default
    return root


def config_value(config, key: str | None, default=None):
    """config.key (dotted: through sub-configs, objects or dicts); `default` where absent or None."""
    if not key:
        return default
    value = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part, None)
        if value is None:
            return default
    return value


def set_config_value(config, key: str, value) -> None:
    """config.key = value (dotted as `config_value` reads it: through sub-configs, objects or dicts)."""
    *path, last = key.split(".")
    owner = config
    for part in path:
        owner = owner[part] if isinstance(owner, dict) else getattr(owner, part)
    if isinstance(owner, dict):
        owner[last] = value
    else:
        setattr(owner, last, value)


def meta_params(config) -> int:
    """The parameters of the HF causal LM transformers builds from `config`, built on the meta device (nothing
    allocated; tied weights counted once). Raises what `from_config` raises for a config it cannot build."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())

"""`ArchSpec`: where the pieces of one HF MoE architecture live (data, not code).

The per-architecture specs live one file each (`qwen2_moe.py`, ...) and are collected, with the
generic fallback, in `revffn.models.architectures`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ArchSpec:
    """Where the pieces of one HF MoE architecture live, and its quirks.

    Paths are attribute paths: model-level ones from the `*ForCausalLM` object, layer-level ones
    from one decoder layer, `router` from the layer's MoE block.
    """

    model_type: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    rotary: str = "model.rotary_emb"
    head: str = "lm_head"
    attn_norm: str = "input_layernorm"
    attn: str = "self_attn"
    mlp_norm: str = "post_attention_layernorm"
    mlp: str = "mlp"
    router: str = "gate"
    router_logits_index: int = 0  # router(...) returns (logits, weights, indices)
    num_experts_keys: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")
    top_k_key: str = "num_experts_per_tok"
    aux_loss: bool = True  # HF trains it with the Switch load-balancing loss on softmax(logits)
    sliding_window_all_layers: bool = False  # config.sliding_window -> sliding mask in every layer
    notes: str = ""

    def num_experts(self, config) -> int:
        for key in self.num_experts_keys:
            n = getattr(config, key, None)
            if isinstance(n, int) and n > 0:
                return n
        return 0


def get_path(root, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def has_standard_layout(hf_model, spec: ArchSpec) -> bool:
    try:
        layers = get_path(hf_model, spec.layers)
    except AttributeError:
        return False
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return False
    names = (spec.attn_norm, spec.attn, spec.mlp_norm, spec.mlp)
    return all(isinstance(getattr(layer, n, None), nn.Module) for layer in layers for n in names)

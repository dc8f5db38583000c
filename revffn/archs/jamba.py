"""Jamba: a hybrid of Mamba (`mamba`) and attention (`self_attn`) layers; the FFN is `feed_forward`
(an MoE every other layer), normed by `pre_ff_layernorm`; the final norm is `final_layernorm`.
Mamba layers get the 2-D padding mask.

Jamba has no RoPE (`rotary=None`): its attention layers get `position_embeddings=None`, as in HF.
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="jamba",
    final_norm="model.final_layernorm",
    rotary=None,
    mixers=("mamba",),
    mlp_norm="pre_ff_layernorm",
    mlp="feed_forward",
    router="router",
    notes="hybrid: mamba or self_attn; feed_forward",
)

"""Jamba: a hybrid of Mamba (`mamba`) and attention (`self_attn`) layers; the FFN is `feed_forward`
(an MoE every other layer), normed by `pre_ff_layernorm`; the final norm is `final_layernorm`.
Mamba layers get the 2-D padding mask.

Jamba has no RoPE: `model.rotary_emb` is absent, so `convert` refuses it until the model-level
context runs without one (then set `rotary=None` here).
"""

from revffn.models.spec import ArchSpec

SPEC = ArchSpec(
    model_type="jamba",
    final_norm="model.final_layernorm",
    mixers=("mamba",),
    mlp_norm="pre_ff_layernorm",
    mlp="feed_forward",
    router="router",
    notes="hybrid: mamba or self_attn; feed_forward",
)

"""Kolibri1: post-norms on both sub-block outputs.

HF's layer: h = h + post_self_attn_layernorm(attn(input_layernorm(h))), then
h = h + post_mlp_layernorm(mlp(post_attention_layernorm(h))).
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="kolibri1",
    attn_post_norm="post_self_attn_layernorm",
    mlp_post_norm="post_mlp_layernorm",
    notes="post-norms post_self_attn_layernorm and post_mlp_layernorm",
)

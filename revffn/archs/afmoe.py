"""AFMoE (Arcee Trinity): sandwich norms around both sub-blocks.

HF's layer: h = h + post_attention_layernorm(attn(input_layernorm(h))), then
h = h + post_mlp_layernorm(mlp(pre_mlp_layernorm(h))). So `post_attention_layernorm` is the
attention's post-norm here, not the MoE's pre-norm as in the standard layout.
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="afmoe",
    attn_post_norm="post_attention_layernorm",
    mlp_norm="pre_mlp_layernorm",
    mlp_post_norm="post_mlp_layernorm",
    notes="sandwich norms: attn post-norm post_attention_layernorm, MoE pre/post pre_mlp_/post_mlp_layernorm",
)

"""FlexOlmo (OLMo-2 style): post-norms only, no pre-norms.

HF's layer: h = h + post_attention_layernorm(attn(h)), then h = h + post_feedforward_layernorm(mlp(h)).
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="flex_olmo",
    attn_norm=None,
    attn_post_norm="post_attention_layernorm",
    mlp_norm=None,
    mlp_post_norm="post_feedforward_layernorm",
    notes="post-norm-only layout",
)

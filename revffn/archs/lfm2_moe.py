"""LFM2-MoE: a hybrid of short convolutions (`conv`) and attention (`self_attn`), with its own names:
`operator_norm` before the token mixer, `ffn_norm` before `feed_forward`, the final norm
`embedding_norm`, the RoPE `pos_emb`. Convolution layers get the 2-D padding mask.
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="lfm2_moe",
    final_norm="model.embedding_norm",
    rotary="model.pos_emb",
    attn_norm="operator_norm",
    mixers=("conv",),
    mlp_norm="ffn_norm",
    mlp="feed_forward",
    notes="hybrid: conv or self_attn; operator_norm / ffn_norm / feed_forward",
)

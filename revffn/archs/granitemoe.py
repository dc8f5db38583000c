"""Granite MoE family: the MoE is `block_sparse_moe`, and three multipliers act outside the sub-blocks.

HF's layer: h = h + m * attn(input_layernorm(h)), then h = h + m * moe(post_attention_layernorm(h))
(+ shared_mlp on the same normed input in granitemoeshared), with m = `residual_multiplier`. The
model multiplies the embeddings by `embedding_multiplier` and divides the logits by
`logits_scaling`. (`attention_multiplier` is attention's own softmax scale: nothing to do.)
"""

from dataclasses import replace

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="granitemoe",
    mlp="block_sparse_moe",
    shared_mlp="shared_mlp",
    branch_scale_key="residual_multiplier",
    embed_scale_key="embedding_multiplier",
    logits_divisor_key="logits_scaling",
    notes="block_sparse_moe (+ shared_mlp); residual, embedding and logits multipliers",
)
SPECS = (SPEC, replace(SPEC, model_type="granitemoe_swa"), replace(SPEC, model_type="granitemoeshared"))

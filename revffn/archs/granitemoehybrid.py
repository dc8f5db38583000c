"""Granite-MoE-Hybrid (Granite 4): a hybrid of Mamba-2 (`mamba`) and attention (`self_attn`) layers,
with granite's MoE (`block_sparse_moe`) plus a dense `shared_mlp` on the same normed input, and
granite's residual, embedding and logits multipliers (see `granitemoe`). Mamba layers get the 2-D
padding mask. Layers without experts (only `shared_mlp`) are not supported: they are refused.
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="granitemoehybrid",
    mixers=("mamba",),
    mlp="block_sparse_moe",
    shared_mlp="shared_mlp",
    branch_scale_key="residual_multiplier",
    embed_scale_key="embedding_multiplier",
    logits_divisor_key="logits_scaling",
    notes="hybrid: mamba or self_attn; block_sparse_moe + shared_mlp; granite multipliers",
)

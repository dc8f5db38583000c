"""DBRX: nested pieces, MoE keys in `ffn_config`, and a dropout on each branch in the layer's code.

HF's block: h = h + dropout(attn(norm_1(h))), then h = h + dropout(ffn(norm_2(h))), the first
half inside `norm_attn_norm`, p = `resid_pdrop`.
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="dbrx",
    layers="transformer.blocks",
    embed="transformer.wte",
    final_norm="transformer.norm_f",
    rotary="transformer.rotary_emb",
    attn_norm="norm_attn_norm.norm_1",
    attn="norm_attn_norm.attn",
    mlp_norm="norm_attn_norm.norm_2",
    mlp="ffn",
    branch_dropout_key="resid_pdrop",
    router="router",
    num_experts_keys=("ffn_config.moe_num_experts",),
    top_k_key="ffn_config.moe_top_k",
    notes="transformer.blocks; norm_attn_norm.{norm_1,attn,norm_2}, ffn; resid_pdrop on both branches",
)

"""Qwen3-Next family (qwen3_next, qwen3_5_moe_text, lara_mini): hybrid stacks whose token mixer is
Gated DeltaNet linear attention (`linear_attn`) in some layers and softmax attention (`self_attn`)
in others. F is the layer's token mixer, whichever it is; linear-attention layers get the 2-D
padding mask, as in HF (`HFRevBlock` gives them the `linear_attention` mask key)."""

from dataclasses import replace

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(model_type="qwen3_next", mixers=("linear_attn",), notes="hybrid: linear_attn or self_attn")
SPECS = (SPEC, replace(SPEC, model_type="qwen3_5_moe_text"), replace(SPEC, model_type="lara_mini"))

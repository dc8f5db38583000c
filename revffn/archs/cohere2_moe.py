"""Cohere2-MoE: a parallel block, and the logits are scaled.

HF's layer: h = h + attn(input_layernorm(h)) + mlp(input_layernorm(h)): one norm feeds both
sub-blocks. RevFFN keeps both branches as they are (G normalises its own input with the same
`input_layernorm`); the coupling runs them one after the other, as it does for every model.
The model multiplies the logits by `logit_scale`.
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="cohere2_moe",
    mlp_norm="input_layernorm",
    parallel=True,
    logits_scale_key="logit_scale",
    notes="parallel block (one input_layernorm for both branches); logits * logit_scale",
)

"""JetMoE: the attention is `self_attention`, itself a mixture of attention experts (a top-k
router inside F)."""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(model_type="jetmoe", attn="self_attention", notes="attention at self_attention (attention experts)")

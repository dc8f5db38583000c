"""Llama 4 (text): the MoE (or, in dense layers, the MLP) is `feed_forward`; the MoE returns
(hidden flattened to (B*T, d), router logits); its router returns (scores, logits)."""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(model_type="llama4_text", mlp="feed_forward", router="router", router_logits_index=1,
                notes="MoE at feed_forward")

"""MiniMax (MiniMax-Text-01): refused. Its layers add the residual *after* the norm:
h = alpha * input_layernorm(h) + beta * attn(input_layernorm(h)), and likewise around the MoE, so the
stream that reaches the next layer is a normed one. That does not fit Y = X + F(X) with the norm
inside F."""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="minimax",
    unsupported="its layers add the residual after the norm (alpha * input_layernorm(h) + beta * attn(...)), "
                "which does not fit Y = X + F(X)",
)

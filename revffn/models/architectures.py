"""The architecture table: HF `model_type` -> `ArchSpec`, one spec file per architecture.

Any other HF causal LM whose decoder layers have the standard `input_layernorm / self_attn /
post_attention_layernorm / mlp` layout converts through a generic spec built on the fly.
Adding an architecture: one file defining `SPEC`, one entry below.
"""

from __future__ import annotations

from revffn.errors import UserError
from revffn.models import mixtral, olmoe, qwen2_moe, qwen3_moe
from revffn.models.spec import ArchSpec, has_standard_layout

ARCHITECTURES: dict[str, ArchSpec] = {m.SPEC.model_type: m.SPEC for m in (qwen2_moe, qwen3_moe, mixtral, olmoe)}


def spec_for(hf_model) -> ArchSpec:
    """The spec for `hf_model`: its registered one, else the generic one, else a clear error."""
    model_type = getattr(hf_model.config, "model_type", "?")
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    generic = ArchSpec(
        model_type=model_type,
        aux_loss=hasattr(hf_model.config, "router_aux_loss_coef"),
        notes="generic spec: standard input_layernorm/self_attn/post_attention_layernorm/mlp layout",
    )
    if has_standard_layout(hf_model, generic):
        return generic
    raise UserError(
        f"cannot convert model_type={model_type!r}: its decoder layers do not have the standard "
        f"input_layernorm / self_attn / post_attention_layernorm / mlp layout. Supported model_types: "
        f"{', '.join(sorted(ARCHITECTURES))} (and any HF causal LM with that standard layout). "
        f"Fix: use one of these architectures, or add a spec file under revffn/models/."
    )

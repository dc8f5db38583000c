"""The architecture table: HF `model_type` -> `ArchSpec`, one spec file per architecture.

Any other HF causal LM whose decoder layers have the standard `input_layernorm / self_attn /
post_attention_layernorm / mlp` layout converts through a generic spec built on the fly.
Adding an architecture: one file defining `SPEC` (or `SPECS` for a family), its name in `SPEC_FILES`.
Whether a model then converts exactly is `revffn.archs.layout.check_convertible`.
"""

from __future__ import annotations

import importlib

from revffn.archs.layout import missing_pieces
from revffn.archs.spec import ArchSpec, get_path
from revffn.errors import UserError

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok",
            "moe_intermediate_size")
# sub-configs that hold the MoE keys of a type that is not also swept as its own `*_text` type
MOE_SUBCONFIGS = ("ffn_config",)

# the spec files under revffn/archs/, each defining SPEC (or SPECS, a family)
SPEC_FILES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "afmoe", "kolibri1", "flex_olmo", "granitemoe",
              "granitemoehybrid", "llama4_text", "cohere2_moe", "dbrx", "jetmoe", "qwen3_next", "jamba", "lfm2_moe",
              "minimax")
ARCHITECTURES: dict[str, ArchSpec] = {
    s.model_type: s
    for m in (importlib.import_module(f"revffn.archs.{name}") for name in SPEC_FILES)
    for s in getattr(m, "SPECS", (m.SPEC,))
}

def spec_for(hf_model) -> ArchSpec:
    """The spec for `hf_model`: its registered one, else the generic one, else a clear error.

    Raises:
        UserError: an unregistered model type whose layers lack the standard pieces (named per layer).
    """
    model_type = getattr(hf_model.config, "model_type", "?")
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    generic = ArchSpec(
        model_type=model_type,
        aux_loss=hasattr(hf_model.config, "router_aux_loss_coef"),
        # no model-level RoPE (NoPE, or positions inside the mixers): position_embeddings is None
        rotary=ArchSpec.rotary if get_path(hf_model, ArchSpec.rotary, None) is not None else None,
        notes="generic spec: standard input_layernorm/self_attn/post_attention_layernorm/mlp layout",
    )
    missing = missing_pieces(hf_model, generic)
    if not missing:
        return generic
    raise UserError(
        f"cannot convert model_type={model_type!r}: its decoder layers do not have the standard "
        f"input_layernorm / self_attn / post_attention_layernorm / mlp layout: {'; '.join(missing)}. Supported "
        f"model_types: {', '.join(sorted(t for t, s in ARCHITECTURES.items() if not s.unsupported))} (and any HF "
        f"causal LM with that standard layout). "
        f"Fix: use one of these architectures, or add a spec file under revffn/archs/ naming its pieces."
    )


def has_moe_keys(config: dict) -> bool:
    """Whether an HF config (as a dict) describes a Mixture-of-Experts model: it has an expert-count key."""
    return any(k in config for k in MOE_KEYS) or any(isinstance(config.get(s), dict) and has_moe_keys(config[s])
                                                       for s in MOE_SUBCONFIGS)

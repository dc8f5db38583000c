"""Architecture knowledge as data: one `ArchSpec` per HF `model_type`.

Each supported architecture has a small file in this package that registers its spec. Any other
HF causal LM whose decoder layers have the standard `input_layernorm / self_attn /
post_attention_layernorm / mlp` layout converts through `generic_spec`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from revffn.errors import UserError


@dataclass(frozen=True)
class ArchSpec:
    """Where the pieces of one HF MoE architecture live, and its quirks.

    Paths are attribute paths: model-level ones from the `*ForCausalLM` object, layer-level ones
    from one decoder layer, `router` from the layer's MoE block.
    """

    model_type: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    rotary: str = "model.rotary_emb"
    head: str = "lm_head"
    attn_norm: str = "input_layernorm"
    attn: str = "self_attn"
    mlp_norm: str = "post_attention_layernorm"
    mlp: str = "mlp"
    router: str = "gate"
    router_logits_index: int = 0  # router(...) returns (logits, weights, indices)
    num_experts_keys: tuple[str, ...] = ("num_experts", "num_local_experts", "n_routed_experts")
    top_k_key: str = "num_experts_per_tok"
    aux_loss: bool = True  # HF trains it with the Switch load-balancing loss on softmax(logits)
    sliding_window_all_layers: bool = False  # config.sliding_window -> sliding mask in every layer
    rng_config_keys: tuple[str, ...] = ("attention_dropout",)  # > 0 means RNG must be replayed
    notes: str = ""

    def num_experts(self, config) -> int:
        for key in self.num_experts_keys:
            n = getattr(config, key, None)
            if isinstance(n, int) and n > 0:
                return n
        return 0


SPECS: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    SPECS[spec.model_type] = spec
    return spec


def get_path(root, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _has_standard_layout(hf_model, spec: ArchSpec) -> bool:
    try:
        layers = get_path(hf_model, spec.layers)
    except AttributeError:
        return False
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return False
    names = (spec.attn_norm, spec.attn, spec.mlp_norm, spec.mlp)
    return all(isinstance(getattr(layer, n, None), nn.Module) for layer in layers for n in names)


def spec_for(hf_model) -> ArchSpec:
    """The spec for `hf_model`: its registered one, else the generic one, else a clear error."""
    from revffn.models import ARCHITECTURES  # noqa: F401  (registers the spec files)

    model_type = getattr(hf_model.config, "model_type", "?")
    if model_type in SPECS:
        return SPECS[model_type]
    generic = ArchSpec(
        model_type=model_type,
        aux_loss=hasattr(hf_model.config, "router_aux_loss_coef"),
        notes="generic spec: standard input_layernorm/self_attn/post_attention_layernorm/mlp layout",
    )
    if _has_standard_layout(hf_model, generic):
        return generic
    raise UserError(
        f"cannot convert model_type={model_type!r}: its decoder layers do not have the standard "
        f"input_layernorm / self_attn / post_attention_layernorm / mlp layout. Supported model_types: "
        f"{', '.join(sorted(SPECS))} (and any HF causal LM with that standard layout). "
        f"Fix: use one of these architectures, or add a spec file under revffn/models/."
    )


def with_overrides(spec: ArchSpec, **kw) -> ArchSpec:
    return replace(spec, **kw)

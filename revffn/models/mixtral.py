"""Mixtral: softmax top-k router (always renormalised), `num_local_experts`.

Quirk: `router_jitter_noise > 0` multiplies the router input by uniform noise in training, so the
RNG must be replayed in the backward recomputation; the spec lists it among the RNG keys.
"""

from revffn.models.spec import ArchSpec

SPEC = ArchSpec(
    model_type="mixtral",
    sliding_window_all_layers=True,
    rng_config_keys=("attention_dropout", "router_jitter_noise"),
)

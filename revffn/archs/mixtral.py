"""Mixtral: softmax top-k router (always renormalised), `num_local_experts`.

Quirk: `router_jitter_noise > 0` multiplies the router input by uniform noise in training. Nothing
to declare: the reversible stack sees any sub-block that draws random numbers and replays its RNG
state in backward (`reversible.replay.RNGState`).
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(
    model_type="mixtral",
    sliding_window_all_layers=True,
)

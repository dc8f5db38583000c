"""Architecture specs: how each HF MoE (or dense) decoder layer splits into the reversible block's attention
and MoE branches (`spec.ArchSpec`, one file per architecture), the registry (`architectures`), and the layout
check that refuses what does not fit (`layout`). Plain data and checks: no weights are loaded here."""

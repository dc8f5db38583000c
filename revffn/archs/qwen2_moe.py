"""Qwen2-MoE (Qwen1.5-MoE-A2.7B): softmax top-k router, shared expert with a sigmoid gate.

Layers listed in `mlp_only_layers` (or off the `decoder_sparse_step`) are dense; they convert the
same way with their MLP as G. Attention kinds come from `config.layer_types`.
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(model_type="qwen2_moe", notes="shared_expert + shared_expert_gate inside mlp")

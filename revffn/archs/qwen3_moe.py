"""Qwen3-MoE: softmax top-k router, q/k RMSNorm inside attention, no shared expert.

`config.sliding_window` (when set) switches every layer to the sliding-window mask.
"""

from revffn.archs.spec import ArchSpec

SPEC = ArchSpec(model_type="qwen3_moe", sliding_window_all_layers=True)

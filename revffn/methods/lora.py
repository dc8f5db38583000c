"""`lora`: LoRA adapters through the real `peft` library (`LoraConfig`, `get_peft_model`).

Default targets: attention q/k/v/o, the shared expert's gate/up/down (qwen2_moe
`shared_expert.{gate,up,down}_proj`), and the fused 3-D expert tensors (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) through peft's `target_parameters` (one rank-r adapter per expert). The
router (`mlp.gate`) stays out unless `include_router: true` (then its weight is adapted as a
parameter, and the load-balancing loss reaches that adapter). Only adapter parameters train.
`lora_dropout > 0` applies only to Linear targets: peft's parameter adapters have no dropout, so it
is refused while experts or the router are targeted.

Export: `final/adapter/` (peft `save_pretrained`) and the merged model (`merge_and_unload`) as a
plain HF directory in `final/`.

Trades: gradients and AdamW states only for the adapters (tiny), the frozen base still holds its
weights and every layer's activations; quality is bounded by the rank.
"""

from __future__ import annotations

from revffn.methods.peft_common import PeftMethod, peft_schema


class LoRAMethod(PeftMethod):
    name = "lora"
    SCHEMA = peft_schema()
    STUDY_LR_GRID = (1e-3, 3e-3)  # adapters: ~10x full's
    use_dora = False

"""`dora`: DoRA (weight-decomposed LoRA) through `peft` (`LoraConfig(use_dora=True)`).

Covers only `nn.Linear` targets: attention q/k/v/o and the shared expert's gate/up/down. With peft
0.21 and 0.22 DoRA cannot adapt the fused 3-D expert tensors or the router: peft's
`ParamWrapper` (the only way to adapt a bare parameter) raises for `use_dora=True`. So the routed
experts and the router stay frozen and un-adapted; `include_router: true` is refused on models whose
router is not an `nn.Linear` (qwen2_moe, qwen3_moe, mixtral, olmoe in transformers 5).

Export: `final/adapter/` (peft `save_pretrained`) and the merged model (`merge_and_unload`) as a
plain HF directory in `final/`.

Trades: LoRA's memory plus one magnitude vector per target, and a slower forward (DoRA renormalises
the adapted weight's columns every step); often closer to full fine-tuning than LoRA at equal rank.
"""

from __future__ import annotations

from revffn.methods.peft_common import PeftMethod, peft_schema


class DoRAMethod(PeftMethod):
    name = "dora"
    SCHEMA = peft_schema()
    STUDY_LR_GRID = (1e-3, 3e-3)  # adapters: ~10x full's
    use_dora = True

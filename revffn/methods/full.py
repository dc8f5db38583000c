"""`full`: plain full fine-tuning of the unconverted HF model (the SFT reference).

Trades: every parameter gets a gradient and two AdamW states, and every layer's activations are
kept for backward. Best quality, most memory.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from revffn.conversion.causal_lm import CausalLM
from revffn.methods.base import Method, export_hf, non_router_parameters
from revffn.schema import Key


class FullMethod(Method):
    name = "full"
    SCHEMA = {"freeze_router": Key(bool, False, "keep the MoE routers frozen")}
    META_PREPARE = True  # wraps the HF model as it is: under FSDP each rank loads only its shards
    STUDY_LR_GRID = (3e-4, 1e-3)  # around the usual SFT range

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        return CausalLM(hf_model, self.cfg.router_aux_loss_coef)

    def optimizer_parameters(self, model) -> list[nn.Parameter]:
        return non_router_parameters(model, self.opts["freeze_router"])

    def export(self, model, out_dir: Path) -> None:
        """A plain HF `save_pretrained` directory (safetensors), loadable by HF and `revffn.load`."""
        export_hf(model, out_dir, method=self.name)

"""`full`: plain full fine-tuning of the unconverted HF model (the SFT reference).

Trades: every parameter gets a gradient and two AdamW states, and every layer's activations are
kept for backward. Best quality, most memory.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from revffn.methods.base import set_requires_grad, write_manifest
from revffn.models.causal_lm import CausalLM
from revffn.training.config import Key


class FullMethod:
    name = "full"
    SCHEMA = {"freeze_router": Key(bool, False, "keep the MoE routers frozen")}

    def __init__(self, cfg):
        self.cfg, self.opts = cfg, cfg.section(self.name)

    @classmethod
    def validate(cls, cfg) -> None:
        pass

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        return CausalLM(hf_model, self.cfg.router_aux_loss_coef)

    def optimizer_parameters(self, model) -> list[nn.Parameter]:
        routers = {id(p) for r in model.routers() for p in r.parameters()} if self.opts["freeze_router"] else set()
        return [p for p in model.parameters() if id(p) not in routers]

    def set_trainable(self, model, step: int, optimizer=None) -> str:
        set_requires_grad(model, {id(p) for p in self.optimizer_parameters(model)})
        return "full"

    def export(self, model, out_dir: Path) -> None:
        """A plain HF `save_pretrained` directory (safetensors), loadable by HF and `revffn.load`."""
        model.hf.save_pretrained(out_dir)
        write_manifest(out_dir, format="hf", method=self.name)

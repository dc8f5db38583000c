"""`revffn`: full fine-tuning through reversible blocks, in two stages.

Stage 1 (`adapter_warmup_steps`): only the projection adapters P_up/P_down train; the pretrained
backbone is frozen so the new parts first learn to speak its language. Stage 2: everything trains
except the routers (`freeze_router: true`, for routing stability). One AdamW holds every parameter
that will ever train; frozen ones have no gradient, so AdamW skips them and keeps the adapters'
state across the boundary.

Trades: activation memory flat in depth (two d/2 streams + one layer) for one extra forward per
layer in backward; grads and optimizer states stay those of full fine-tuning.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_model
from torch import nn

from revffn.errors import UserError
from revffn.methods.base import Method, non_router_parameters, set_requires_grad, write_manifest
from revffn.models.convert import ADAPTER_INITS, convert
from revffn.schema import Key


class RevFFNMethod(Method):
    name = "revffn"
    SCHEMA = {
        "adapter_warmup_steps": Key(int, 10, "stage 1: steps that train only the projection adapters", min=0),
        "freeze_router": Key(bool, True, "stage 2: keep the MoE routers frozen"),
        "stream_dtype": Key(str, "float32", "dtype of the residual streams (float32 keeps backward exact)",
                            choices=("float32", "bfloat16")),
        "adapter_init": Key(str, "coordinate", "projection adapter init", choices=ADAPTER_INITS),
    }

    @classmethod
    def validate(cls, cfg) -> None:
        opts = cfg.section(cls.name)
        if opts["adapter_warmup_steps"] >= cfg.max_steps:
            raise UserError(f"revffn.adapter_warmup_steps={opts['adapter_warmup_steps']} leaves no stage-2 step "
                            f"(max_steps={cfg.max_steps}). Fix: make it smaller than max_steps.")

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        dtype = torch.float32 if self.opts["stream_dtype"] == "float32" else torch.bfloat16
        return convert(hf_model, adapter_init=self.opts["adapter_init"], stream_dtype=dtype,
                       aux_loss_coef=self.cfg.router_aux_loss_coef)

    def optimizer_parameters(self, model) -> list[nn.Parameter]:
        return non_router_parameters(model, self.opts["freeze_router"])

    def steady_state_step(self) -> int:
        return self.opts["adapter_warmup_steps"]

    def stage(self, step: int) -> str:
        return "warmup" if step < self.opts["adapter_warmup_steps"] else "joint"

    def set_trainable(self, model, step: int, optimizer=None) -> str:
        stage = self.stage(step)
        params = model.adapter_parameters() if stage == "warmup" else self.optimizer_parameters(model)
        set_requires_grad(model, {id(p) for p in params})
        return stage

    def export(self, model, out_dir: Path) -> None:
        """The converted model's weights (safetensors), the base HF config, and revffn.json."""
        model.config.save_pretrained(out_dir)
        save_model(model, str(out_dir / "model.safetensors"))
        write_manifest(out_dir, format="revffn", method=self.name, adapter_init=self.opts["adapter_init"],
                       stream_dtype=self.opts["stream_dtype"])

"""A method that lives outside the package, for the registry's acceptance test (`test_registry.py`).

`toy`: full fine-tuning with the input embedding frozen. Importing this module registers it, as a
plugin would; a worker process imports it through the job's `method_module`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from torch import nn

from revffn.conversion.causal_lm import CausalLM
from revffn.memory.estimate import MemoryContext, MemoryTerms
from revffn.memory.saved import FULL, layer_saved, outside_saved
from revffn.methods import register
from revffn.methods.base import Method, export_hf


class ToyMethod(Method):
    name = "toy"
    STUDY_LR_GRID = (5e-4,)

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        return CausalLM(hf_model, self.cfg.router_aux_loss_coef)

    def optimizer_parameters(self, model) -> list[nn.Parameter]:
        embedding = model.hf.get_input_embeddings().weight
        return [p for p in model.parameters() if p is not embedding]

    def export(self, model, out_dir: Path) -> None:
        export_hf(model, out_dir, method=self.name)

    @classmethod
    def memory_terms(cls, ctx: MemoryContext) -> MemoryTerms:
        """Full fine-tuning less the embedding (an untied head keeps training): no token ids kept, and
        the first layer's input needs no gradient."""
        m = ctx.m
        first = layer_saved(m, 0, ctx.B, ctx.T, ctx.s, ctx.padded, ctx.impl, replace(FULL, inp=False))
        act_fwd = outside_saved(m, ctx.B, ctx.T, ctx.s, embed=False) + first + sum(ctx.layers[1:]) + ctx.aux
        return MemoryTerms(trainable=ctx.counts["total"] - ctx.counts["embed"], activations_forward=act_fwd,
                           notes=("toy: full fine-tuning, input embedding frozen",))


register(ToyMethod)

"""`ckpt`: full fine-tuning with HF gradient checkpointing (non-reentrant), through `CausalLM`.

Every decoder layer keeps only its input for backward and recomputes its forward there, so the
gradients are those of `full` (same weights, same batch) while activation memory drops from
all layers' internals to one layer's plus the layer inputs.

Trades: about one extra forward pass per step (roughly +30% step time) for activation memory;
gradients and AdamW states stay those of full fine-tuning.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from revffn.conversion.causal_lm import CausalLM
from revffn.memory.estimate import MemoryContext, MemoryTerms
from revffn.methods.base import Method, export_hf, non_router_parameters
from revffn.schema import Key


class CkptMethod(Method):
    name = "ckpt"
    SCHEMA = {"freeze_router": Key(bool, False, "keep the MoE routers frozen")}
    META_PREPARE = True  # wraps the HF model as it is: under FSDP each rank loads only its shards
    # not in the study: same gradients as `full`

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        # transformers >= 5.2x renamed gradient_checkpointing_enable (now a deprecated alias, same effect)
        enable = getattr(hf_model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return CausalLM(hf_model, self.cfg.router_aux_loss_coef)

    def optimizer_parameters(self, model) -> list[nn.Parameter]:
        return non_router_parameters(model, self.opts["freeze_router"])

    def export(self, model, out_dir: Path) -> None:
        """A plain HF `save_pretrained` directory (safetensors), loadable by HF and `revffn.load`."""
        export_hf(model, out_dir, method=self.name)

    @classmethod
    def memory_terms(cls, ctx: MemoryContext) -> MemoryTerms:
        """Full fine-tuning's trainables; each layer keeps only its (B, T, d) input, the mask and the
        aux loss's tensors stay, and one layer's saved tensors come back while its backward recomputes it."""
        m, s = ctx.m, ctx.s
        # layer inputs and the mask are the checkpoints' inputs; RoPE cos/sin ride in a tuple (not kept)
        act_fwd = ctx.outside - 2 * ctx.T * m.rope_dim * s + m.layers * ctx.N * m.d * s + ctx.mask_bytes + ctx.aux
        return MemoryTerms(trainable=ctx.counts["total"], activations_forward=act_fwd,
                           recompute_working_set=max(ctx.layers),
                           notes=("ckpt: one (B, T, d) boundary state per layer kept; one layer's saved tensors "
                                  "while its backward recomputes it",))

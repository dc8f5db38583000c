"""An unconverted HF causal LM behind the same forward contract as `RevFFNForCausalLM`.

The baselines (full, ckpt, lora, dora, hift, refta) train through this wrapper, so every method
shares one loss (chunked cross-entropy), one router load-balancing loss and one output type.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from revffn.archs.architectures import spec_for
from revffn.archs.layout import cache_kwarg, logits_transform, output_cache
from revffn.archs.spec import get_path
from revffn.conversion.convert import RevFFNOutput
from revffn.conversion.loss import CHUNK_TOKENS, SwitchAux, causal_lm_loss, head_logits
from revffn.reversible.replay import RouterTap


class CausalLM(nn.Module):
    """Wraps an HF `*ForCausalLM` (possibly with PEFT layers injected): forward(input_ids,
    attention_mask, labels, return_logits) -> RevFFNOutput with loss, loss_sum, n_tokens, aux_loss."""

    def __init__(self, hf_model: nn.Module, aux_loss_coef: float | None = None, chunk_tokens: int = CHUNK_TOKENS):
        super().__init__()
        self.hf = hf_model
        config = hf_model.config
        self.spec = spec_for(hf_model)
        self.aux_loss_coef = (getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if aux_loss_coef is None \
            else aux_loss_coef
        self.chunk_tokens = chunk_tokens  # rows per chunk of the head + cross-entropy, as RevFFNForCausalLM
        self.num_experts = self.spec.num_experts(config)
        self.top_k = self.spec.top_k(config)
        self._taps = []
        for layer in get_path(hf_model, self.spec.layers):
            router = get_path(layer, f"{self.spec.mlp}.{self.spec.router}", None)
            if isinstance(router, nn.Module) and self.num_experts:
                self._taps.append(RouterTap(router, self.spec.router_logits_index, listening=False))

    @property
    def config(self):
        return self.hf.config

    def routers(self) -> list[nn.Module]:
        return [t.router for t in self._taps]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, return_logits: bool = True,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0, cache=None,
                use_cache: bool = False) -> RevFFNOutput:
        """As `RevFFNForCausalLM.forward`; `cache` / `use_cache` are HF's own (the backbone builds its
        cache class, hybrid ones included), `out.cache` the extended cache."""
        backbone = get_path(self.hf, self.spec.layers.rsplit(".", 1)[0])
        use_cache = use_cache or cache is not None
        with contextlib.ExitStack() as taps:  # the routers' logits of this forward only (`RouterTap.listen`)
            for tap in self._taps:
                taps.enter_context(tap.listen())
            base = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=use_cache, **({cache_kwarg(backbone): cache} if cache is not None else {}))
        router_logits = [tap.take() for tap in self._taps]  # held by the aux loss's graph alone
        hidden = base.last_hidden_state
        head = get_path(self.hf, self.spec.head)
        out = RevFFNOutput(cache=output_cache(base) if use_cache else None)
        if self.aux_loss_coef > 0 and self.spec.aux_loss and self._taps:
            rows = None if attention_mask is None else attention_mask[:, -input_ids.shape[1]:]  # the new tokens'
            row_mask = None if rows is None else rows.reshape(-1).float()
            trainable = torch.is_grad_enabled() and any(p.requires_grad for r in self.routers() for p in r.parameters())
            aux = SwitchAux(self.num_experts, self.top_k, row_mask, differentiable=trainable)
            for logits in router_logits:
                aux.add(logits if trainable else logits.detach())
            out.aux_loss = aux.value()
        if labels is not None:
            out.loss_sum, out.n_tokens = causal_lm_loss(hidden, head, labels, self.chunk_tokens,
                                                        *logits_transform(self.spec, self.hf.config))
            out.loss = out.loss_sum / out.n_tokens.clamp(min=1)
            if out.aux_loss is not None and out.aux_loss.requires_grad:
                out.loss = out.loss + self.aux_loss_coef * out.aux_loss
        if return_logits:
            out.logits = head_logits(hidden[:, -logits_to_keep:] if logits_to_keep else hidden, head,
                                     *logits_transform(self.spec, self.hf.config))
        return out

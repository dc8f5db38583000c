"""A RevFFN-converted causal LM as a transformers `PreTrainedModel`: `from_pretrained`, `generate()`
with the KV cache, `save_pretrained`.

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained("runs/quickstart/final", trust_remote_code=True)
    model.generate(input_ids, max_new_tokens=64, do_sample=False)

It builds the base architecture from `config.text_config`, converts it with `revffn.convert` and
loads the weights a revffn run wrote, so revffn must be importable (pip install revffn). The
converted model's forward is revffn's own (`RevFFNForCausalLM.forward`, the plain twin in eval):
the logits are `revffn generate`'s. This file is copied verbatim into `final/`.
"""

import torch
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from revffn.conversion.convert import convert

from .configuration_revffn import RevFFNConfig


class RevFFNModelForCausalLM(PreTrainedModel, GenerationMixin):
    """Attributes:
    hf: the base HF model, its decoder layers replaced by reversible blocks (the only submodule, so the
        state dict's keys are the ones revffn writes: `hf.model.layers.0.base_layer.self_attn...`).
    revffn: the `RevFFNForCausalLM` around `hf` that computes the forward.
    """

    config_class = RevFFNConfig
    base_model_prefix = "hf"
    _supports_sdpa = True

    def __init__(self, config: RevFFNConfig):
        super().__init__(config)
        # the dtype from_pretrained builds in (its default dtype), not the base config's own `dtype`
        self.hf = AutoModelForCausalLM.from_config(config.text_config, dtype=torch.get_default_dtype())
        self.post_init()  # before `convert`: HF's init would redraw the projection adapters it adds
        model = convert(self.hf, stream_dtype=getattr(torch, config.stream_dtype),
                        adapter_skip=config.adapter_skip, stream_width=getattr(config, "stream_width", "half"),
                        coupling=getattr(config, "coupling", "additive"), buffer_bits=getattr(config, "buffer_bits", 6),
                        buffer_momentum=getattr(config, "buffer_momentum", "negative"))
        object.__setattr__(self, "revffn", model)  # not registered: its parameters are `hf`'s, under `hf.`

    def train(self, mode: bool = True):
        """Also the converted model's mode: training with grad takes the reversible path."""
        super().train(mode)
        self.revffn.training = mode
        return self

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache=None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, past_key_values=None,
                **kwargs) -> CausalLMOutputWithPast:
        """`RevFFNForCausalLM.forward` under HF's names; other HF kwargs (return_dict, ...) are ignored.
        The KV cache comes and goes as `cache` (transformers >= 5.24) or `past_key_values` (before)."""
        if use_cache is None:
            use_cache = self.config.get_text_config().use_cache
        out = self.revffn(input_ids, attention_mask=attention_mask, labels=labels, position_ids=position_ids,
                          logits_to_keep=logits_to_keep, cache=cache if cache is not None else past_key_values,
                          use_cache=bool(use_cache))
        name = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
        return CausalLMOutputWithPast(loss=out.loss, logits=out.logits, **{name: out.cache})

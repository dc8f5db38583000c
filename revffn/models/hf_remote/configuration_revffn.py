"""The config of a RevFFN-converted causal LM, as transformers reads it from a revffn `final/`.

    AutoModelForCausalLM.from_pretrained("runs/quickstart/final", trust_remote_code=True)

`text_config` is the base model's own config (qwen2_moe, mixtral, ...): the converted model is that
architecture with each decoder layer inside a reversible block (`revffn.conversion.convert`), so
transformers' generation machinery (its KV cache, `get_text_config()`) reads the base's geometry
from it. This file is copied verbatim into `final/` (`revffn.models.hf_remote.save_converted`) and
`config.json` names it under `auto_map`.

On disk config.json is flat: the base's own keys (its `model_type` included), then `architectures`,
`auto_map` and RevFFN's `OWN_KEYS`. transformers 5 reads config.json with `AutoConfig` before it loads
any tokenizer, so a `model_type` it does not know (`revffn`) plus an `auto_map` makes
`AutoTokenizer.from_pretrained(final)` ask whether to run this file ("Do you wish to run the custom
code? [y/N]"); a known one does not. With `trust_remote_code=True` this class is used, and
`get_config_dict` folds the flat file into `text_config` (a nested config.json, written before, reads
unchanged).
"""

import json

from transformers import CONFIG_MAPPING, AutoConfig, PreTrainedConfig

try:  # transformers >= 5.2x declares sub-configs by spec; 5.17 by class (`sub_configs`), see RevFFNConfig
    from transformers.configuration_utils import SubConfigSpec
except ImportError:
    SubConfigSpec = None

# RevFFN's, beside the base's keys in config.json
OWN_KEYS = ("stream_dtype", "adapter_skip", "stream_width", "coupling", "buffer_bits", "buffer_momentum")
WRAPPER_KEYS = ("architectures", "auto_map")  # this model's, not the base's


class RevFFNConfig(PreTrainedConfig):
    """Attributes:
    text_config: the base HF model's config (a dict in config.json).
    stream_dtype: dtype of the two residual streams ("float32", "bfloat16" or "float64").
    adapter_skip: the blocks have the d/2 x d/2 skip adapters (`revffn.adapter_skip`; absent in
        directories written before them: False).
    stream_width: "half" (the paper's two d/2 streams) or "full" (two d-wide ones); absent in directories
        written before it: "half".
    coupling: "additive" (the adapters' coupling) or "buffered" (every decoder layer whole on fixed-point
        streams, no adapters); absent in directories written before it: "additive".
    buffer_bits: the buffered coupling's k (lam = 2^-k).
    buffer_momentum: the buffered coupling's sign of lam, "positive" or "negative"; absent in directories written
        before it: "negative".
    """

    model_type = "revffn"
    if SubConfigSpec is not None:
        sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="qwen2_moe")}
    else:
        sub_configs = {"text_config": AutoConfig}

    text_config: dict | PreTrainedConfig | None = None
    stream_dtype: str = "float32"
    adapter_skip: bool = False
    stream_width: str = "half"
    coupling: str = "additive"
    buffer_bits: int = 6
    buffer_momentum: str = "negative"

    def __post_init__(self, **kwargs):
        """`text_config` as its own config class (5.17 leaves a dict as a dict; newer ones do this too)."""
        if isinstance(self.text_config, dict):
            text = dict(self.text_config)
            self.text_config = CONFIG_MAPPING[text.pop("model_type", "qwen2_moe")](**text)
        elif self.text_config is None:
            self.text_config = CONFIG_MAPPING["qwen2_moe"]()
        super().__post_init__(**kwargs)

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path, **kwargs):
        """config.json as this class's fields: a flat file's base keys moved under `text_config`."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") in (None, cls.model_type):  # nested, as revffn wrote it before
            return config_dict, kwargs
        text = {k: v for k, v in config_dict.items() if k not in OWN_KEYS + WRAPPER_KEYS}
        own = {k: config_dict[k] for k in (*OWN_KEYS, *WRAPPER_KEYS, "dtype") if k in config_dict}
        return {**own, "model_type": cls.model_type, "text_config": text}, kwargs

    def to_json_string(self, use_diff: bool = True) -> str:
        """The flat config.json (module docstring): every key of the base's config, then this model's."""
        text = self.get_text_config()
        base = text.to_diff_dict() if use_diff else text.to_dict()  # diff: what base.save_pretrained writes
        flat = {k: v for k, v in base.items() if k not in OWN_KEYS + WRAPPER_KEYS}
        flat.update({k: getattr(self, k) for k in WRAPPER_KEYS if getattr(self, k, None) is not None})
        flat.update({k: getattr(self, k) for k in OWN_KEYS})
        return json.dumps(self._encode_special_floats(flat), indent=2, sort_keys=True) + "\n"

"""The config of a RevFFN-converted causal LM, as transformers reads it from a revffn `final/`.

    AutoModelForCausalLM.from_pretrained("runs/quickstart/final", trust_remote_code=True)

`text_config` is the base model's own config (qwen2_moe, mixtral, ...): the converted model is that
architecture with each decoder layer inside a reversible block (`revffn.models.convert`), so
transformers' generation machinery (its KV cache, `get_text_config()`) reads the base's geometry
from it. This file is copied verbatim into `final/` (`revffn.models.hf_remote.save_converted`) and
`config.json` names it under `auto_map`.
"""

from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec


class RevFFNConfig(PreTrainedConfig):
    """Attributes:
    text_config: the base HF model's config (a dict in config.json).
    stream_dtype: dtype of the two half-width residual streams ("float32" or "bfloat16").
    adapter_skip: the blocks have the d/2 x d/2 skip adapters (`revffn.adapter_skip`; absent in
        directories written before them: False).
    """

    model_type = "revffn"
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="qwen2_moe")}

    text_config: dict | PreTrainedConfig | None = None
    stream_dtype: str = "float32"
    adapter_skip: bool = False

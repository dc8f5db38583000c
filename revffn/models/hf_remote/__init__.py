"""A revffn `final/` that transformers loads: `AutoModelForCausalLM.from_pretrained(final, trust_remote_code=True)`.

`save_converted` writes a converted model as config.json (a `RevFFNConfig`, written flat: the base
model's config with its own `model_type`, so `AutoTokenizer.from_pretrained(final)` needs no remote
code; `architectures`, `auto_map` naming the two files below, `stream_dtype`, `adapter_skip`, `stream_width`),
model.safetensors (the converted weights, keys as `RevFFNForCausalLM` names them) and the two files
themselves, `configuration_revffn.py` and `modeling_revffn.py`, copied from this package: transformers
imports them from `final/`, and they import revffn. `revffn.load` reads the same directory without
them (`models.loading.stored_config`: the flat config.json is a plain base config to it). The model
itself still needs `trust_remote_code=True`: without it transformers builds the plain base
architecture, finds none of these weights and says so (every key MISSING in its load report).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors.torch import save_model

from revffn.models.hf_remote.configuration_revffn import OWN_KEYS, WRAPPER_KEYS, RevFFNConfig

REMOTE_FILES = ("configuration_revffn.py", "modeling_revffn.py")
AUTO_MAP = {"AutoConfig": "configuration_revffn.RevFFNConfig",
            "AutoModelForCausalLM": "modeling_revffn.RevFFNModelForCausalLM"}


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# final/README.md: the model card the Hub and a reader see first. A plain load (no remote code) gives no error, only
# a load report, so the card says what it gives.
MODEL_CARD = """---
library_name: transformers
tags: [revffn, reversible]
---
# A RevFFN model ({coupling} coupling)

Written by revffn (`{model_type}` layers inside reversible blocks). Its modeling code ships beside it and imports
revffn, which must be installed where it loads; load it with that code:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained(PATH)
```

Without `trust_remote_code=True` transformers builds the plain `{model_type}` architecture and initialises every
weight anew (its load report lists each as MISSING): a random model, not this one. Scored with lm-evaluation-harness:
`lm_eval --model hf --model_args pretrained=PATH,trust_remote_code=True --tasks TASK`.
"""


def save_converted(model, out_dir: Path) -> None:
    """Write `model` (a `RevFFNForCausalLM`) into `out_dir` as transformers loads it with remote code."""
    dtype = dtype_name(next(model.parameters()).dtype)  # the weights' dtype, as save_pretrained records it
    # a base config read back from a flat config.json carries this model's keys: not the base's
    text = {k: v for k, v in model.config.to_dict().items() if k not in OWN_KEYS + WRAPPER_KEYS}
    config = RevFFNConfig(text_config={**text, "dtype": dtype}, dtype=dtype,
                          stream_dtype=dtype_name(model.stream_dtype), adapter_skip=model.adapter_skip,
                          stream_width=model.stream_width, coupling=model.coupling, buffer_bits=model.buffer_bits,
                          buffer_momentum=model.buffer_momentum,
                          architectures=["RevFFNModelForCausalLM"])
    config.auto_map = AUTO_MAP
    config.save_pretrained(out_dir)
    save_model(model, str(Path(out_dir) / "model.safetensors"), metadata={"format": "pt"})
    for name in REMOTE_FILES:
        shutil.copyfile(Path(__file__).parent / name, Path(out_dir) / name)
    (Path(out_dir) / "README.md").write_text(MODEL_CARD.format(coupling=model.coupling,
                                                               model_type=text.get("model_type", "base")))

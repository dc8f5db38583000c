"""revffn: memory-efficient full-parameter fine-tuning of MoE LLMs with reversible blocks.

    import revffn
    hf = revffn.tiny_model("tiny-qwen2-moe", num_hidden_layers=4)
    model = revffn.convert(hf)            # RevFFN: reversible blocks, exact gradients
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    model = revffn.load("runs/quickstart/final")   # a trained run's final/ directory
"""

from __future__ import annotations

import importlib

__all__ = ["convert", "load", "tiny_model", "RevFFNForCausalLM", "TINY_PRESETS"]
__version__ = "0.1.0"

_EXPORTS = {"convert": "revffn.conversion.convert", "RevFFNForCausalLM": "revffn.conversion.convert",
            "load": "revffn.models.loading", "tiny_model": "revffn.models.presets",
            "TINY_PRESETS": "revffn.models.presets"}


def __getattr__(name: str):
    """The public names, imported on first use: `import revffn` itself loads neither torch nor transformers, so
    the `revffn` command can answer a Ctrl-C during their import (`revffn.__main__.console`)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'revffn' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value

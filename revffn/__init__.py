"""revffn: memory-efficient full-parameter fine-tuning of MoE LLMs with reversible blocks.

    import revffn
    hf = revffn.tiny_model("tiny-qwen2-moe", num_hidden_layers=4)
    model = revffn.convert(hf)            # RevFFN: reversible blocks, exact gradients
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    model = revffn.load("runs/quickstart/final")   # a trained run's final/ directory
"""

from revffn.conversion.convert import RevFFNForCausalLM, convert
from revffn.models.loading import load
from revffn.models.presets import TINY_PRESETS, tiny_model

__all__ = ["convert", "load", "tiny_model", "RevFFNForCausalLM", "TINY_PRESETS"]
__version__ = "0.1.0"

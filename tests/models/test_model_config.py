"""`model_config`'s checks against what they predict: the grouped_mm width rule against the kernel itself."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from revffn.models.loading import hf_config
from revffn.models.model_config import _stride_problem


@pytest.mark.skipif(not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")),
                    reason="this torch has no grouped_mm: transformers loops over the experts")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_expert_width_rule_predicts_what_grouped_mm_runs(dtype):
    """For each width, the check refuses exactly the geometries whose forward and backward fail in the kernel."""
    refused, failed = [], []
    for hidden in range(40, 50, 2):
        over = {"num_hidden_layers": 1, "hidden_size": hidden, "head_dim": 16, "vocab_size": 64}
        if _stride_problem("tiny-qwen3-moe", over, dtype, "cpu") is not None:
            refused.append(hidden)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config("tiny-qwen3-moe", **over)).to(dtype)
        try:
            model(torch.randint(0, 64, (2, 16)), labels=torch.randint(0, 64, (2, 16))).loss.backward()
        except RuntimeError as e:
            assert "strides should be multiple of 16 bytes" in str(e)
            failed.append(hidden)
    assert refused == failed and refused  # (the tiny preset's expert width is hidden_size / 2)

"""`model_config`'s checks against what they predict: the grouped_mm width rule against the kernel itself."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from revffn.models.loading import hf_config
from revffn.models.model_config import _misaligned, _stride_problem, grouped_mm_runs


@pytest.mark.skipif(not grouped_mm_runs("cpu"), reason="no grouped_mm on this torch's CPU: transformers loops")
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


def test_only_experts_that_run_on_grouped_mm_are_held_to_its_widths(tmp_path):
    """Llama 4's experts multiply with torch.bmm, which takes any width; Qwen3-MoE's dispatch to grouped_mm."""
    from transformers import Llama4TextConfig, Qwen3MoeConfig

    geometry = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "vocab_size": 64}
    llama4, qwen3 = tmp_path / "llama4", tmp_path / "qwen3"
    Llama4TextConfig(**geometry, intermediate_size=30, intermediate_size_mlp=64, num_local_experts=4).save_pretrained(
        llama4)
    Qwen3MoeConfig(**geometry, moe_intermediate_size=30, num_experts=4).save_pretrained(qwen3)
    assert _misaligned(str(llama4), {}, 4) is None
    model = AutoModelForCausalLM.from_config(Llama4TextConfig.from_pretrained(llama4))
    model(torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8))).loss.backward()  # runs, at width 30
    name, shape, widths = _misaligned(str(qwen3), {}, 4)
    assert name == "model.layers.0.mlp.experts.down_proj" and shape == [4, 64, 30] and widths == [30]

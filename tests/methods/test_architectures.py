"""Every method on every tiny MoE preset: prepares, trains two steps, exports, and the export reloads
with the trained model's logits. LoRA adapts the fused experts everywhere; peft's transformers-v4
name mapping (which would retarget shared-expert `gate_proj`/`up_proj`/`down_proj` Linears, glm4_moe)
is side-stepped."""

from __future__ import annotations

import pytest
import torch

from revffn.models.loading import load
from tests.methods._util import batch, build, config, step

PRESETS = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe", "tiny-glm4-moe"]


@pytest.mark.parametrize("method", ["ckpt", "lora", "dora", "hift", "refta"])
@pytest.mark.parametrize("preset", PRESETS)
def test_method_on_preset(preset, method, tmp_path):
    run = build(config(method, tmp_path, f"model={preset}", "model_config={}", lr=1e-2))
    meth, model = run.method, run.model
    if method == "lora":
        modules, parameters = meth.targets
        assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(parameters)
        if preset == "tiny-glm4-moe":  # shared experts + dense layer 0: adapted through their weights
            assert {"gate_proj.weight", "up_proj.weight", "down_proj.weight"} <= set(parameters)
            assert any("shared_experts.gate_proj.lora_A" in n for n, _ in model.named_parameters())
        assert not meth.peft_model.peft_config["default"].rank_pattern  # ranks stay r
    for i in range(2):
        step(run, i, batch(seed=i))
    model.eval()
    ids = batch(seed=7)["input_ids"]
    with torch.no_grad():
        before = model(ids).logits
    meth.export(model, tmp_path / "final")
    with torch.no_grad():
        after = load(str(tmp_path / "final"))(ids).logits
    assert (after - before).abs().max() <= 1e-4

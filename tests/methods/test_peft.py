"""`lora` / `dora` through peft: targets, only adapters train, merged export == unmerged model."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from revffn.conversion.causal_lm import CausalLM
from revffn.errors import UserError
from revffn.models.loading import load
from tests.methods._util import adapter_ranks, batch, build, changed, config, snapshot, step, unadapted_linears


@pytest.mark.filterwarnings("ignore::FutureWarning")  # peft probes a deprecated HF attribute on load
@pytest.mark.parametrize("name", ["lora", "dora"])
def test_only_adapters_train_and_merge_matches(name, tmp_path):
    run = build(config(name, tmp_path, f"{name}.r=4", lr=1e-2))
    method, model = run.method, run.model
    modules, parameters = method.targets
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= set(modules)
    ranks = adapter_ranks(model)
    assert set(ranks.values()) == {4}  # no fused-expert rank pattern (peft 0.22 would give the experts 2r)
    assert not unadapted_linears(model)  # attention and the shared expert's gate/up/down, each once
    experts = [n for n in ranks if n.endswith("mlp.experts")]
    if name == "lora":  # the fused 3-D experts, through peft's target_parameters
        assert parameters == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"] and len(experts) == 2
    else:  # peft's ParamWrapper refuses DoRA: Linear modules only
        assert parameters == [] and not experts
    trainable = {n for n, p in model.named_parameters() if any(p is q for q in method.optimizer_parameters(model))}
    assert trainable and all("lora_" in n for n in trainable)
    assert not any(".mlp.gate." in n for n in trainable)  # router excluded by default
    before = snapshot(model)
    for i in range(3):
        step(run, i, batch(seed=i))
    moved = changed(before, model)
    assert moved and moved <= trainable, sorted(moved - trainable)[:5]
    if name == "lora":
        assert any("experts" in n for n in moved)
    else:
        assert any("lora_magnitude_vector" in n for n in moved)

    model.eval()
    data = batch(seed=9)
    with torch.no_grad():
        unmerged = model(data["input_ids"], attention_mask=data["attention_mask"]).logits
    method.export(model, tmp_path / "final")
    final = tmp_path / "final"
    assert (final / "adapter" / "adapter_config.json").is_file()
    assert json.loads((final / "revffn.json").read_text())["format"] == "hf"
    with torch.no_grad():
        in_place = model(data["input_ids"], attention_mask=data["attention_mask"]).logits
        reloaded = load(str(final))(data["input_ids"], attention_mask=data["attention_mask"]).logits
        hf = CausalLM(AutoModelForCausalLM.from_pretrained(final, local_files_only=True)).eval()
        via_hf = hf(data["input_ids"], attention_mask=data["attention_mask"]).logits
    assert not any("lora_" in n for n, _ in model.named_parameters())
    base = build(config(name, tmp_path, "method=full")).model  # same seed: the untrained base weights
    with torch.no_grad():  # final/adapter is a working peft adapter for that base
        adapted = PeftModel.from_pretrained(base.hf, final / "adapter")
        via_adapter = CausalLM(adapted.base_model.model).eval()(data["input_ids"],
                                                                attention_mask=data["attention_mask"]).logits
    for logits in (in_place, reloaded, via_hf, via_adapter):
        assert (logits - unmerged).abs().max() <= 1e-4


def test_lora_include_router_and_dropout_rules(tmp_path):
    run = build(config("lora", tmp_path, "lora.r=2", "lora.include_router=true"))
    method, model = run.method, run.model
    assert "mlp.gate.weight" in method.targets[1]
    assert any(".mlp.gate.lora_A" in n for n, _ in model.named_parameters())
    out = model(**batch(), return_logits=False)
    assert out.aux_loss.requires_grad  # the router adapter gets the load-balancing gradient too
    method.export(model, tmp_path / "final")  # merged in place: the router taps must follow the unwrapped router
    out2 = model(**batch(n=1, seed=1), return_logits=False)
    assert torch.isfinite(out2.aux_loss) and model.routers()[0] is model.hf.model.layers[0].mlp.gate
    assert all(t.logits is None and not t.listening for t in model._taps)  # taken by the forward: none kept
    with pytest.raises(UserError, match="lora_dropout"):
        build(config("lora", tmp_path, "lora.lora_dropout=0.1"))
    method = build(config("lora", tmp_path, "lora.lora_dropout=0.1", "lora.target_modules=[q_proj,v_proj]")).method
    assert method.targets == (["q_proj", "v_proj"], [])
    with pytest.raises(UserError, match="include_router"):
        build(config("dora", tmp_path, "dora.include_router=true"))
    with pytest.raises(UserError, match="matches no nn.Linear"):
        build(config("lora", tmp_path, "lora.target_modules=[nope_proj]"))

"""`refta`: reconstruction-free forward == x @ ΔWᵀ, fewer parameters than LoRA, zero init, merged export."""

from __future__ import annotations

import torch

from revffn.methods.refta import ReFTALinear, trainable_count, wrappers_of
from revffn.models.loading import load
from tests.methods._util import batch, build, config, step


def test_efficient_forward_equals_materialised_delta(tmp_path):
    model = build(config("refta", tmp_path, "refta.r=4")).model
    wrappers = wrappers_of(model)
    assert len(wrappers) == 8  # q/k/v/o in 2 layers
    assert set(model.refta_shared.keys()) == {"in64_out64", "in64_out32"}  # q/o share one A, k/v another
    torch.manual_seed(1)
    for _, w in wrappers:
        torch.nn.init.normal_(w.B, std=0.1)
    x = torch.randn(3, 5, 64)
    for name, w in wrappers:
        assert isinstance(w, ReFTALinear) and isinstance(w.base_layer, torch.nn.Linear)
        with torch.no_grad():
            delta = w(x) - w.base_layer(x)
            reference = x @ w.delta_weight().T
        assert (delta - reference).abs().max() <= 1e-5, name
    a = [w.A for n, w in wrappers if n.endswith("q_proj")]
    assert a[0] is a[1] and a[0] is [w.A for n, w in wrappers if n.endswith("o_proj")][0]  # shared across layers


def test_fewer_trainable_parameters_than_lora(tmp_path):
    r = 16
    model = build(config("refta", tmp_path, f"refta.r={r}")).model
    refta = trainable_count(model)
    lora = build(config("lora", tmp_path, f"lora.r={r}", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"))
    lora_method, lora_model = lora.method, lora.model
    assert lora_method.targets == (["q_proj", "k_proj", "v_proj", "o_proj"], [])
    lora = sum(p.numel() for p in lora_method.optimizer_parameters(lora_model))
    print(f"trainable parameters at r={r} on q/k/v/o: refta {refta}, lora {lora}")
    assert refta < lora


def test_zero_init_then_merged_export_reloads(tmp_path):
    cfg = config("refta", tmp_path, "refta.r=4", lr=1e-2)
    plain = build(cfg).model  # same seed: the base weights the wrapped model starts from
    run = build(cfg)
    method, model = run.method, run.model
    data = batch(seed=5)
    ids, mask = data["input_ids"], data["attention_mask"]
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, plain.eval()(ids, attention_mask=mask).logits)
    model.train()
    for i in range(3):
        step(run, i, batch(seed=i))
    assert all(w.B.abs().sum() > 0 for _, w in wrappers_of(model))
    model.eval()
    with torch.no_grad():
        wrapped = model(ids, attention_mask=mask).logits
        assert (wrapped - plain(ids, attention_mask=mask).logits).abs().max() > 1e-3  # it did adapt
    method.export(model, tmp_path / "final")
    assert not wrappers_of(model) and not any("refta" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        reloaded = load(str(tmp_path / "final"))(ids, attention_mask=mask).logits
    assert (reloaded - wrapped).abs().max() <= 1e-4

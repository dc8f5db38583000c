"""Every method on every tiny MoE preset: prepares, trains two steps, exports, and the export reloads
with the trained model's logits. LoRA adapts the fused experts everywhere; peft's transformers-v4
name mapping (which would retarget shared-expert `gate_proj`/`up_proj`/`down_proj` Linears, glm4_moe)
is side-stepped.

Dense models too: every registered method trains one step on tiny dense llama, mistral, qwen2, qwen3
and gemma models (`tiny_any`, saved as a local directory the way a user's model comes), and revffn's
reversible gradients equal its plain twin's there."""

from __future__ import annotations

import math

import pytest
import torch

from revffn.memory.estimate import dims
from revffn.methods import METHODS
from revffn.models.loading import SHIPPED_VOCAB, load
from revffn.models.tiny_any import dense_model_types, tiny_model_for
from revffn.reports.check import grad_error
from revffn.training.config import load_config
from revffn.training.step import train_step
from tests.methods._util import adapter_ranks, batch, build, changed, config, snapshot, step, unadapted_linears

PRESETS = ["tiny-qwen3-moe", "tiny-mixtral", "tiny-olmoe", "tiny-glm4-moe"]
DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma"]


@pytest.mark.parametrize("method", ["ckpt", "lora", "dora", "hift", "refta"])
@pytest.mark.parametrize("preset", PRESETS)
def test_method_on_preset(preset, method, tmp_path):
    run = build(config(method, tmp_path, f"model={preset}", "model_config={}", lr=1e-2))
    meth, model = run.method, run.model
    if method == "lora":
        modules, parameters = meth.targets
        assert {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"} <= set(parameters)
        ranks = adapter_ranks(model)
        # shared experts + dense layer 0 (glm4_moe): each Linear adapted once, as a module (peft 0.22) or through
        # its weight where peft moves its name to the fused experts (0.21); every rank r, none doubled
        assert not unadapted_linears(model) and set(ranks.values()) == {16}
        assert not meth.peft_model.peft_config["default"].rank_pattern  # ranks stay r
    if method in ("lora", "dora"):  # the estimate counts what the installed peft adapts (`Dims.peft_rewrites`)
        moved = [t for t in meth.targets[1] if t.endswith("_proj.weight")] if method == "lora" else meth.not_covered
        m = dims(model.hf.config)
        if m.shared_inter or not all(m.moe):  # (a model with MLP Linears beside its fused experts: glm4_moe)
            assert m.peft_rewrites == bool(moved), (moved, meth.targets)
        else:
            assert not moved
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


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory) -> dict:
    """Tiny dense HF models (no dropout, the shipped tokenizer's vocabulary) saved as local directories."""
    root = tmp_path_factory.mktemp("dense")
    for model_type in DENSE:
        tiny_model_for(model_type, stochastic=0.0, vocab_size=SHIPPED_VOCAB).save_pretrained(root / model_type)
    return {model_type: root / model_type for model_type in DENSE}


def _dense_config(model_dir, method: str, tmp):
    return load_config(None, [f"model={model_dir}", f"method={method}", f"output_dir={tmp}", "dtype=float32",
                              "device=cpu", "learning_rate=1e-2", "lr_scheduler_type=constant", "warmup_steps=0"])


def test_the_dense_models_are_dense():
    assert set(DENSE) <= set(dense_model_types())


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("model_type", DENSE)
def test_method_trains_a_dense_model(model_type, method, dense_dirs, tmp_path):
    """One optimizer step of the real training step: a finite loss, and only trainable parameters move."""
    run = build(_dense_config(dense_dirs[model_type], method, tmp_path))
    before = snapshot(run.model)
    loss = step(run, 0, batch(vocab=SHIPPED_VOCAB))
    assert math.isfinite(loss)
    trainable = {n for n, p in run.model.named_parameters() if p.requires_grad}
    moved = changed(before, run.model)
    assert moved and moved <= trainable, sorted(moved - trainable)


@pytest.mark.parametrize("model_type", DENSE)
def test_revffn_gradients_equal_the_plain_twins_on_a_dense_model(model_type, dense_dirs, tmp_path):
    """The same training step (same weights, same batch) as the plain twin and reversibly: every
    parameter's gradient agrees to fp32 rounding, and the dense MLP needs no router tap."""
    grads = {}
    for reversible in (False, True):
        run = build(_dense_config(dense_dirs[model_type], "revffn", tmp_path))
        model = run.model
        model.reversible = reversible
        assert len(model.blocks) == model.config.num_hidden_layers
        assert all(getattr(b, "router_tap", None) is None for b in model.blocks)
        grads[reversible] = {}
        torch.manual_seed(0)
        train_step(run, 0, [batch(vocab=SHIPPED_VOCAB)], after_backward=lambda model=model, out=grads[reversible]:
                   out.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    assert grads[True] and set(grads[True]) == set(grads[False])
    err, worst = grad_error(grads[False], grads[True])
    assert err <= 1e-5, (worst, err)

"""Folding the full-width P_down adapters into the layers (`revffn.fold_adapters`, stage 2): the same function and
exact reversible gradients with 2 d^2 fewer parameters a layer; a fold that would change the function is undone;
a run folds at its stage boundary, drops the adapters' optimizer state, resumes exactly across it and exports
the layout every converted model has."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from revffn import convert, tiny_model
from revffn.conversion import fold
from revffn.conversion.fold import fold_adapters, unfold
from revffn.models.loading import load
from revffn.training import loop
from revffn.training.config import load_config
from tests.conftest import GENERIC, REQUIRED
from tests.methods._util import metrics

pytestmark = pytest.mark.usefixtures("one_thread")


def _random_adapters(name: str, layers: int = 2):
    """A converted tiny model whose P_down and skips are far from the identity and zero (a calibrated or trained
    state), so that a wrong fold shows."""
    torch.manual_seed(0)
    model = convert(tiny_model(name, num_hidden_layers=layers), adapter_init="random", stream_width="full",
                    adapter_skip=True)
    with torch.no_grad():
        for block in model.blocks:
            for m in (block.p_down_attn, block.p_down_moe):
                m.weight.add_(torch.eye(m.weight.shape[0]))
            for m in (block.p_skip_attn, block.p_skip_moe):
                torch.nn.init.normal_(m.weight, std=0.05)
    return model


def _grads(model, ids, reversible: bool) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model.reversible = reversible
    model(ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", REQUIRED + [GENERIC])
def test_fold_keeps_the_function_and_the_gradients_exact(name):
    model = _random_adapters(name)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    d, layers = model.config.hidden_size, len(model.blocks)
    with torch.no_grad():
        before = model.eval()(ids, labels=ids).logits
    o_proj = model.blocks[0].base_layer.self_attn.o_proj.weight.detach().clone()
    n_before = sum(p.numel() for p in model.parameters())
    removed, plan = fold_adapters(model)
    assert plan == [[i, a] for i in range(layers) for a in ("p_down_attn", "p_down_moe")]
    n_after = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for p in removed) == n_before - n_after == 2 * d * d * layers
    assert all(b.p_down_attn is None and b.p_down_moe is None for b in model.blocks)
    assert not torch.equal(model.blocks[0].base_layer.self_attn.o_proj.weight, o_proj)  # P multiplied in
    with torch.no_grad():
        after = model(ids, labels=ids).logits
    assert (after - before).abs().max() <= 1e-5 * before.abs().max()
    model.train()  # the reversible backward of the folded blocks equals ordinary backprop through them
    rev, plain = _grads(model, ids, True), _grads(model, ids, False)
    assert rev.keys() == plain.keys() and rev
    assert max(((rev[k] - plain[k]).norm() / plain[k].norm().clamp(min=1e-12)).item() for k in rev) <= 1e-5


def test_a_fold_that_changes_the_function_is_undone(monkeypatch):
    """A wrong output map (here: the query projection, reported as the attention's output) fails the probe: the
    weights are restored bitwise and P_down stays; the MoE branch, found right, still folds."""
    model = _random_adapters("tiny-qwen2-moe")
    real = fold._out_maps

    def wrong(module, d):
        maps = real(module, d)
        q = getattr(module, "q_proj", None)
        return [(q, "weight", "rows")] if q is not None else maps

    monkeypatch.setattr(fold, "_out_maps", wrong)
    q = {i: b.base_layer.self_attn.q_proj.weight.detach().clone() for i, b in enumerate(model.blocks)}
    removed, plan = fold_adapters(model)
    assert plan == [[0, "p_down_moe"], [1, "p_down_moe"]]
    assert all(b.p_down_attn is not None and b.p_down_moe is None for b in model.blocks)
    assert all(torch.equal(b.base_layer.self_attn.q_proj.weight, q[i]) for i, b in enumerate(model.blocks))


def test_half_width_does_not_fold():
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2), stream_width="half")
    assert fold_adapters(model) == ([], [])


def test_unfold_writes_the_identity_and_keeps_the_function():
    model = _random_adapters("tiny-mixtral").eval()
    fold_adapters(model)
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        folded = model(ids).logits
        unfold(model)
        assert all(torch.equal(b.p_down_moe.weight, torch.eye(model.config.hidden_size)) for b in model.blocks)
        assert torch.equal(model(ids).logits, folded)


TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 2, hidden_size: 64}", "method=revffn",
        "dtype=float32", "device=cpu", "revffn.coupling=additive", "revffn.adapter_init=coordinate",
        "revffn.adapter_warmup_steps=2",
        "revffn.heal_data=builtin:stdlib_text", "data=builtin:reversal_train", "eval_data=null",
        "max_seq_length=32", "per_device_train_batch_size=4", "max_steps=5", "logging_steps=1", "save_steps=0",
        "learning_rate=1e-3", "warmup_steps=0"]


def test_a_run_folds_at_stage_2_resumes_across_it_and_exports_a_converted_model(tmp_path):
    """The first stage-2 step's loss is the unfolded model's (the same function); the fold's plan is saved and
    a resume from after it repeats it before loading (exact losses); final/ holds P_down as the identity and
    reloads to the trained model's logits."""
    folded, plain = tmp_path / "folded", tmp_path / "plain"
    loop.run(load_config(None, [*TINY, f"output_dir={plain}", "save_steps=3", "revffn.fold_adapters=false"]))
    loop.run(load_config(None, [*TINY, f"output_dir={folded}", "save_steps=3"]))
    a, b = metrics(folded), metrics(plain)
    assert [r["stage"] for r in a] == ["heal", "heal", "joint", "joint", "joint"]
    assert [r["loss"] for r in a[:3]] == pytest.approx([r["loss"] for r in b[:3]], abs=1e-6)
    assert abs(a[-1]["loss"] - b[-1]["loss"]) > 1e-6  # then P trains inside the layers' weights, not beside them
    state = json.loads((folded / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["method_state"]["folded"] == [[0, "p_down_attn"], [0, "p_down_moe"], [1, "p_down_attn"],
                                               [1, "p_down_moe"]]
    d = 64

    def moments(run):  # AdamW's first moments in the step-3 checkpoint
        opt = torch.load(run / "checkpoints" / "step-3" / "optimizer.pt", weights_only=True)
        return sum(s["exp_avg"].numel() for s in opt["state"].values())

    assert moments(plain) - moments(folded) == 2 * 2 * d * d  # the adapters' moments went with them
    ref = [r["loss"] for r in a]
    loop.run(load_config(None, [*TINY, f"output_dir={folded}", "save_steps=3", "resume=true"]))
    assert [r["loss"] for r in metrics(folded)] == pytest.approx(ref, abs=1e-6)
    weights = {k: v for f in (folded / "final").glob("*.safetensors") for k, v in load_file(f).items()}
    assert all(torch.equal(v, torch.eye(d)) for k, v in weights.items() if "p_down" in k)
    model = load(str(folded / "final")).eval()
    ids = torch.randint(3, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all() and len([k for k in weights if "p_down" in k]) == 4

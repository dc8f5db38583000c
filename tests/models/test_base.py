"""The shipped pretrained base (`builtin:base`): what it is, that it loads and converts, and that it
still reaches the held-out loss recorded when it was made (`revffn/assets/base/base.json`)."""

import json

import pytest
import torch
from safetensors import safe_open

from revffn.conversion.causal_lm import CausalLM
from revffn.conversion.convert import RevFFNForCausalLM, convert
from revffn.data.tokenizer import load_tokenizer
from revffn.errors import UserError
from revffn.models.loading import SHIPPED_MODELS, check_model_ref, load_hf, resolve_model_ref
from revffn.training.evaluate import retention_loss

BASE_DIR = SHIPPED_MODELS["builtin:base"]


@pytest.fixture(scope="module")
def recorded():
    return json.loads((BASE_DIR / "base.json").read_text())


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_ref("builtin:base"))


def test_shipped_base_is_a_small_bf16_qwen2_moe_with_shared_expert():
    weights = BASE_DIR / "model.safetensors"
    assert weights.stat().st_size <= 20 * 2**20
    with safe_open(str(weights), "pt") as f:
        dtypes = {f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes == {torch.bfloat16}
    hf = load_hf("builtin:base")
    assert type(hf).__name__ == "Qwen2MoeForCausalLM"
    assert hf.config.shared_expert_intermediate_size > 0 and hf.config.num_experts >= 8
    assert next(hf.parameters()).dtype == torch.float32  # load_hf computes in fp32 unless asked


def test_base_reaches_recorded_heldout_loss(recorded, tok):
    loss = retention_loss(CausalLM(load_hf("builtin:base")).eval(), tok)
    assert loss == pytest.approx(recorded["heldout_loss"], rel=0.01)
    assert loss < 4.0  # pretrained: far below the uniform ln(2048) = 7.62


def test_base_converts_and_keeps_recorded_loss(recorded, tok):
    model = convert(load_hf("builtin:base"))
    assert isinstance(model, RevFFNForCausalLM)
    loss = retention_loss(model.eval(), tok)
    assert loss == pytest.approx(recorded["converted_heldout_loss"], rel=0.01)
    # The reversible path trains: one backward gives finite gradients on the adapters and the experts.
    model.train()
    ids = tok(["Ada lives in Oakridge."], return_tensors="pt")["input_ids"]
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_unknown_shipped_model_is_a_clear_error():
    check_model_ref("builtin:base")
    with pytest.raises(UserError, match=r"^model: unknown shipped model 'builtin:bsae'.*Fix: use builtin:base"):
        check_model_ref("builtin:bsae")

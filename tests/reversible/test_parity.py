"""Reversible gradients equal the plain-autograd twin's, for every supported architecture."""

import pytest
import torch

from revffn.reports.check import run_check
from tests.conftest import GENERIC, REQUIRED


@pytest.mark.parametrize("width", ["half", "full"])
@pytest.mark.parametrize("model", REQUIRED + [GENERIC])
def test_fp32_parity(model, width):
    r = run_check(model, layers=4, dtype="float32", batch=2, seq=24, stream_width=width)
    print(model, width, {k: r[k] for k in ("max_rel_grad_error", "max_reconstruction_error", "conversion_gap")})
    assert r["stream_width"] == width
    assert r["max_rel_grad_error"] <= 1e-5
    assert r["max_reconstruction_error"] <= 1e-4
    assert r["passed"]
    assert torch.isfinite(torch.tensor(r["loss_converted"]))


@pytest.mark.parametrize("model", REQUIRED + [GENERIC])
def test_bf16_compute_fp32_streams(model):
    r = run_check(model, layers=4, dtype="bfloat16", batch=2, seq=24)
    print(model, r["err_ratio_vs_fp32"])
    assert r["err_ratio_vs_fp32"] <= 1.25
    assert r["passed"]


def test_bf16_streams_are_worse_than_fp32_streams():
    """Why streams default to fp32: bf16 streams make reconstruction inexact."""
    fp32_streams = run_check("tiny-qwen2-moe", layers=6, dtype="bfloat16", seq=24)
    bf16_streams = run_check("tiny-qwen2-moe", layers=6, dtype="bfloat16", seq=24, stream_dtype=torch.bfloat16)
    print("recon fp32 streams", fp32_streams["max_reconstruction_error"],
          "bf16 streams", bf16_streams["max_reconstruction_error"])
    assert bf16_streams["max_reconstruction_error"] > fp32_streams["max_reconstruction_error"]
    assert bf16_streams["max_rel_grad_error"] > fp32_streams["max_rel_grad_error"]


def test_parity_with_dense_first_layers():
    """qwen2_moe with mlp_only_layers: dense layers convert with their MLP as G."""
    r = run_check("tiny-qwen2-moe", layers=4, dtype="float32", seq=16)
    assert r["passed"]
    from revffn import convert
    from revffn.models.presets import tiny_model

    m = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=3, mlp_only_layers=[0]))
    assert m.blocks[0].router_tap is None and m.blocks[1].router_tap is not None
    ids = torch.randint(3, 512, (2, 16))
    grads = {}
    for rev in (True, False):
        m.zero_grad()
        m.reversible = rev
        m(ids, labels=ids).loss.backward()
        grads[rev] = torch.cat([p.grad.reshape(-1) for p in m.parameters() if p.grad is not None])
    assert ((grads[True] - grads[False]).norm() / grads[False].norm()) < 1e-5

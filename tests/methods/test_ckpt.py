"""`ckpt`: gradient checkpointing recomputes the layers and leaves the gradients those of `full`."""

from __future__ import annotations

import torch

from tests.methods._util import batch, build, config


def _grads(cfg, counter: list | None = None) -> dict[str, torch.Tensor]:
    run = build(cfg)
    model = run.model
    run.method.set_trainable(model, 0)
    if counter is not None:  # inside the checkpointed forward: runs again in backward when recomputed
        model.hf.model.layers[0].self_attn.register_forward_hook(lambda *a: counter.append(1))
    out = model(**batch(), return_logits=False)
    (out.loss_sum / out.n_tokens + model.aux_loss_coef * out.aux_loss).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_ckpt_gradients_equal_full(tmp_path):
    calls_full, calls_ckpt = [], []
    full = _grads(config("ckpt", tmp_path, "method=full"), calls_full)
    ckpt = _grads(config("ckpt", tmp_path), calls_ckpt)
    assert len(calls_full) == 1 and len(calls_ckpt) == 2  # ckpt really recomputes in backward
    assert full.keys() == ckpt.keys()
    for name, g in full.items():
        assert g is not None and ckpt[name] is not None, name
        assert torch.allclose(g, ckpt[name], atol=1e-5, rtol=0), (name, (g - ckpt[name]).abs().max())


def test_no_router_tap_keeps_a_recomputed_layer_after_backward(tmp_path):
    """HF checkpointing reruns each layer's router in backward; a tap that kept those logits kept each recomputed
    layer's whole graph until the next step (issue 24: 290 MiB at the bench's act-heavy profile)."""
    run = build(config("ckpt", tmp_path))
    model = run.model
    run.method.set_trainable(model, 0)
    out = model(**batch(), return_logits=False)
    (out.loss_sum / out.n_tokens + model.aux_loss_coef * out.aux_loss).backward()
    assert model._taps and all(t.logits is None for t in model._taps)

"""Routing replay, autocast replay and the router auxiliary loss (RNG replay: test_rng.py)."""

import copy

import torch

from revffn import convert, tiny_model
from revffn.models.convert import DebugOptions
from revffn.models.loss import SwitchAux


def _grads(model, ids, mask=None, reversible=True):
    model.zero_grad(set_to_none=True)
    model.reversible = reversible
    model(ids, attention_mask=mask, labels=ids, return_logits=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b, names):
    num = torch.cat([(a[n] - b[n]).reshape(-1) for n in names]).norm()
    return (num / torch.cat([b[n].reshape(-1) for n in names]).norm()).item()


def test_routing_replay_survives_a_forced_near_tie():
    """Experts 0 and 1 differ in their router logit by 1e-6 * x_k only. During the backward
    recomputation a hook flips the sign of feature k of the router input: without replay every
    token routed to 0 or 1 switches expert; with replay the recorded choice is reused."""
    torch.manual_seed(0)
    hf = tiny_model("tiny-qwen2-moe", num_hidden_layers=3, num_experts_per_tok=1, router_aux_loss_coef=0.0)
    k = 5
    with torch.no_grad():
        for layer in hf.model.layers:
            w = layer.mlp.gate.weight  # (E, d)
            w.normal_(0, 0.02)
            w[:, k] = 0
            w[0] = 3 * w[0].sign() * w[0].abs().clamp(min=0.01)  # experts 0/1 dominate many tokens
            w[1] = w[0]
            w[1, k] = 1e-6  # the near-tie: l1 - l0 = 1e-6 * x_k
    model = convert(hf, adapter_init="coordinate")
    model.train()
    ids = torch.randint(3, 512, (2, 32))
    g_plain = _grads(model, ids, reversible=False)

    def flip_feature_k(module, args):
        if torch.is_grad_enabled():  # only the backward recomputation runs the router with grad
            x = args[0].clone()
            x[..., k] = -x[..., k]
            return (x,)

    handles = [r.register_forward_pre_hook(flip_feature_k) for r in model.routers()]
    try:
        model.debug = DebugOptions(track_routing_flips=True)
        g_replay = _grads(model, ids)
        flips = model.routing_flips()
        model.debug = DebugOptions(routing_replay=False)
        g_no_replay = _grads(model, ids)
    finally:
        for h in handles:
            h.remove()
        model.debug = DebugOptions()

    experts = [n for n in g_plain if ".experts." in n]
    err_replay, err_no_replay = _rel(g_replay, g_plain, experts), _rel(g_no_replay, g_plain, experts)
    print(f"flips={flips} expert-grad rel err: replay {err_replay:.2e}, no replay {err_no_replay:.2e}")
    assert flips > 0, "the forced near-tie must actually flip the fresh top-k"
    assert err_replay < 1e-4
    assert err_no_replay > 1e-2


def test_cpu_autocast_is_reapplied_in_backward():
    """Forward under autocast, backward outside it (the usual pattern): the reversible
    recomputation must still run in bf16, as the forward did."""
    model = convert(tiny_model("tiny-olmoe", num_hidden_layers=3))
    model.train()
    ids = torch.randint(3, 512, (2, 16))

    def autocast_grads(reversible):
        model.zero_grad(set_to_none=True)
        model.reversible = reversible
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    g_plain, g_rev = autocast_grads(False), autocast_grads(True)
    g_fp32 = _grads(model, ids, reversible=False)
    names = list(g_plain)
    err_rev, err_bf16 = _rel(g_rev, g_plain, names), _rel(g_fp32, g_plain, names)
    print(f"rev vs plain under autocast {err_rev:.2e}; fp32 vs autocast {err_bf16:.2e}")
    assert err_bf16 > 1e-3  # autocast really changed the numerics
    assert err_rev < err_bf16 / 10  # the recomputation ran under the same autocast


def test_switch_aux_matches_hf():
    from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

    logits = tuple(torch.randn(12, 8) for _ in range(3))
    mask = torch.ones(2, 6)
    mask[1, 4:] = 0
    for m in (None, mask):
        aux = SwitchAux(8, 2, None if m is None else m.reshape(-1))
        for lg in logits:
            aux.add(lg)
        ref = load_balancing_loss_func(logits, 8, 2, m)
        assert torch.allclose(aux.value(), ref, atol=1e-6)


def test_aux_loss_gradient_through_reversible_path():
    hf = tiny_model("tiny-qwen3-moe", num_hidden_layers=3)
    model = convert(hf, aux_loss_coef=1.0)  # large, so its gradient dominates the router's
    model.train()
    ids = torch.randint(3, 512, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    g_plain = _grads(model, ids, mask, reversible=False)
    g_rev = _grads(model, ids, mask, reversible=True)
    routers = [n for n in g_plain if ".mlp.gate." in n]
    assert routers
    assert _rel(g_rev, g_plain, list(g_plain)) < 1e-5
    ref = copy.deepcopy(model)
    ref.aux_loss_coef = 0.0
    g_noaux = _grads(ref, ids, mask, reversible=True)
    assert _rel(g_noaux, g_plain, routers) > 1e-2, "the aux loss must contribute to router gradients"


def test_frozen_router_aux_loss_is_only_logged():
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2), aux_loss_coef=1.0)
    model.train()
    for r in model.routers():
        r.requires_grad_(False)
    ids = torch.randint(3, 512, (2, 16))
    out = model(ids, labels=ids, return_logits=False)
    assert out.aux_loss is not None and out.aux_loss.item() > 0 and not out.aux_loss.requires_grad
    g_with = _grads(model, ids)
    model.aux_loss_coef = 0.0
    g_without = _grads(model, ids)
    assert _rel(g_with, g_without, list(g_without)) == 0.0

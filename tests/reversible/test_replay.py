"""Choice replay under forced near-ties (router top-k at any path, max(dim)), autocast replay and the
router auxiliary loss (RNG replay: test_rng.py; the choice ops one by one: test_choices.py)."""

import copy

import torch
from torch import nn

from revffn import convert, tiny_model
from revffn.conversion.convert import DebugOptions
from revffn.conversion.loss import SwitchAux
from revffn.models.tiny_any import tiny_model_for


def _grads(model, ids, mask=None, reversible=True):
    model.zero_grad(set_to_none=True)
    model.reversible = reversible
    model(ids, attention_mask=mask, labels=ids, return_logits=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b, names):
    num = torch.cat([(a[n] - b[n]).reshape(-1) for n in names]).norm()
    return (num / torch.cat([b[n].reshape(-1) for n in names]).norm()).item()


K = 5  # the feature whose sign the backward recomputation flips


def _force_near_tie(w: torch.Tensor) -> None:
    """Router weight (E, d): experts 0 and 1 dominate many tokens and differ by 1e-6 * x_K only."""
    w.normal_(0, 0.02)
    w[:, K] = 0
    w[0] = 3 * w[0].sign() * w[0].abs().clamp(min=0.01)
    w[1] = w[0]
    w[1, K] = 1e-6  # the near-tie: l1 - l0 = 1e-6 * x_K


def _near_tie(model, routers, ids):
    """Expert-gradient errors against the plain twin, with and without replay, and the flips counted,
    when a pre-hook flips the sign of feature K of every router's input during the backward
    recomputation: without replay every token routed to expert 0 or 1 switches expert."""
    model.train()
    g_plain = _grads(model, ids, reversible=False)

    def flip_feature_k(module, args):
        if torch.is_grad_enabled():  # only the backward recomputation runs the router with grad
            x = args[0].clone()
            x[..., K] = -x[..., K]
            return (x,)

    handles = [r.register_forward_pre_hook(flip_feature_k) for r in routers]
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
    return flips, err_replay, err_no_replay


def near_tie_model():
    """A converted 3-layer tiny-qwen2-moe (top-1) whose every router has a forced near-tie."""
    torch.manual_seed(0)
    hf = tiny_model("tiny-qwen2-moe", num_hidden_layers=3, num_experts_per_tok=1, router_aux_loss_coef=0.0)
    with torch.no_grad():
        for layer in hf.model.layers:
            _force_near_tie(layer.mlp.gate.weight)
    return convert(hf, adapter_init="coordinate")


def test_routing_replay_survives_a_forced_near_tie():
    model = near_tie_model()
    flips, err_replay, err_no_replay = _near_tie(model, model.routers(), torch.randint(3, 512, (2, 32)))
    assert flips > 0, "the forced near-tie must actually flip the fresh top-k"
    assert err_replay < 1e-4
    assert err_no_replay > 1e-2


def test_near_tie_of_a_router_at_another_path_is_replayed():
    """gpt_oss's router is `mlp.router`, not `mlp.gate`: its top-k is recorded all the same, because
    the whole sub-block is recorded, wherever the router lives."""
    torch.manual_seed(0)
    hf = tiny_model_for("gpt_oss", stochastic=0.0, num_hidden_layers=2, num_experts_per_tok=1)
    routers = [layer.mlp.router for layer in hf.model.layers]
    with torch.no_grad():
        for r in routers:
            _force_near_tie(r.weight)
            r.bias.zero_()
    model = convert(hf)
    assert model.routers() == []  # no load-balancing tap at this path: nothing router-specific is needed
    flips, err_replay, err_no_replay = _near_tie(model, routers, torch.randint(3, 256, (2, 32)))
    assert flips > 0
    assert err_replay < 1e-4
    assert err_no_replay > 1e-2


class MaxRouter(nn.Module):
    """A top-1 router that chooses with `max(dim)`, as phimoe's sparse mixer does, not `topk`."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.proj = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        _force_near_tie(self.proj.weight.data)

    def forward(self, x):
        logits = self.proj(x.reshape(-1, self.proj.in_features))
        weights, chosen = logits.softmax(-1).max(dim=-1, keepdim=True)
        return logits, weights, chosen


def test_near_tie_of_a_max_choice_is_replayed():
    torch.manual_seed(0)
    hf = tiny_model("tiny-qwen2-moe", num_hidden_layers=3, num_experts_per_tok=1, router_aux_loss_coef=0.0)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate = MaxRouter(layer.mlp.gate.weight)
    model = convert(hf)
    flips, err_replay, err_no_replay = _near_tie(model, [layer.base_layer.mlp.gate for layer in model.blocks],
                                                 torch.randint(3, 512, (2, 32)))
    assert flips > 0
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

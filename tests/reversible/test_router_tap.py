"""`RouterTap` on a toy router: record, replay, flips, remove(), and no mode left behind on errors.
`StackContext` round-trips position embeddings of any pytree shape through the reversible stack."""

import pytest
import torch
from torch import nn

from revffn.reversible import AutocastState, RevBlock, RouterTap, StackContext, run_stack


class Router(nn.Module):
    """Softmax top-k, as HF routers do; `tensor_method` selects with `Tensor.topk` instead."""

    def __init__(self, d=8, num_experts=6, k=2, tensor_method=False):
        super().__init__()
        self.gate = nn.Linear(d, num_experts, bias=False)
        self.k, self.tensor_method, self.fail = k, tensor_method, False

    def forward(self, x):
        logits = self.gate(x)
        probs = logits.softmax(-1)
        weights, idx = probs.topk(self.k, dim=-1) if self.tensor_method else torch.topk(probs, self.k, dim=-1)
        if self.fail:
            raise ValueError("router failed")
        return logits, weights, idx


def _mode_depth() -> int:
    return torch._C._len_torch_function_stack()


@pytest.mark.parametrize("tensor_method", [False, True])
def test_record_then_replay_reuses_indices_and_keeps_weights_differentiable(tensor_method):
    torch.manual_seed(0)
    router = Router(tensor_method=tensor_method)
    tap = RouterTap(router, num_experts=6)
    x = torch.randn(5, 8)
    with tap.recording() as records:
        _, _, idx = router(x)
    assert len(records) == 1 and records[0].dtype == torch.uint8
    assert torch.equal(records[0].long(), idx)
    assert tap.logits is None  # cleared when the context ends: no graph kept alive

    with tap.replaying(records, track_flips=True) as replay:
        logits, weights, replayed = router(-x)  # a different input: fresh top-k would differ
    fresh = torch.topk((-x @ router.gate.weight.T).softmax(-1), 2, dim=-1).indices
    differs = (fresh.sort(-1).values != idx.sort(-1).values).any(-1)
    assert differs.any(), "the test input must change the fresh choice"
    assert torch.equal(replayed, idx)
    assert torch.allclose(weights, logits.softmax(-1).gather(-1, idx))
    assert int(replay.flips) == int(differs.sum())
    weights.sum().backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0
    assert _mode_depth() == 0


def test_outside_the_contexts_only_logits_are_tapped():
    router = Router()
    tap = RouterTap(router, num_experts=6)
    x = torch.randn(3, 8)
    logits, _, idx = router(x)
    assert tap.logits is logits
    assert torch.equal(idx, torch.topk(logits.softmax(-1), 2, dim=-1).indices)


def test_contexts_do_not_nest():
    tap = RouterTap(Router(), num_experts=6)
    with tap.recording() as records, pytest.raises(RuntimeError, match="do not nest"):
        with tap.replaying(records):
            pass


def test_remove_detaches_both_hooks():
    router = Router()
    tap = RouterTap(router, num_experts=6)
    tap.remove()
    assert not router._forward_pre_hooks and not router._forward_hooks
    x = torch.randn(3, 8)
    with tap.recording() as records:
        router(x)
    assert records == [] and tap.logits is None
    with tap.replaying([torch.zeros(3, 2, dtype=torch.uint8)]):
        _, _, idx = router(x)  # not replayed: the router's own choice
    assert torch.equal(idx, torch.topk(router.gate(x).softmax(-1), 2, dim=-1).indices)


@pytest.mark.parametrize("where", ["router", "pre_hook"])
def test_an_error_inside_the_router_leaves_no_mode_entered(where):
    router = Router()
    tap = RouterTap(router, num_experts=6)
    if where == "router":
        router.fail = True
    else:  # a later pre-hook raises after the tap's pre-hook entered the mode
        def fail(module, args):
            raise ValueError("router failed")

        router.register_forward_pre_hook(fail)
    with tap.recording() as records:
        with pytest.raises(ValueError, match="router failed"):
            router(torch.randn(3, 8))
        assert _mode_depth() == 0
        torch.topk(torch.randn(4, 6), 2)  # outside the router: not recorded
    assert len(records) == (1 if where == "router" else 0)
    assert _mode_depth() == 0


class ToyBlock(RevBlock):
    """F and G read every leaf of `sctx.position_embeddings` and of `sctx.masks`."""

    def __init__(self, d: int):
        super().__init__()
        self.f, self.g = nn.Linear(d, d), nn.Linear(d, d)

    def F(self, X_2, sctx):  # noqa: N802
        leaves = torch.utils._pytree.tree_leaves(sctx.position_embeddings)
        return torch.tanh(self.f(X_2)) * sum(leaves) + sctx.masks["full"]

    def G(self, Y_1, sctx):  # noqa: N802
        leaves = torch.utils._pytree.tree_leaves(sctx.position_embeddings)
        return torch.tanh(self.g(Y_1)) * leaves[0]


@pytest.mark.parametrize("shape", ["tensor", "triple", "nested"])
def test_position_embeddings_of_any_pytree_shape_round_trip(shape):
    torch.manual_seed(0)
    d = 4
    a, b, c = (torch.rand(3, d) + 0.5 for _ in range(3))
    pe = {"tensor": a, "triple": (a, b, c), "nested": {"rope": (a, b), "extra": [c]}}[shape]
    masks = {"full": torch.randn(3, d), "sliding_attention": None}
    sctx = StackContext(pe, masks, AutocastState("cpu", False, torch.float32))

    tensors = sctx.tensors()
    assert len(tensors) == {"tensor": 1, "triple": 3, "nested": 3}[shape] + 2
    empty = sctx.with_tensors([None] * len(tensors))  # what the autograd Function keeps on ctx
    back = empty.with_tensors(tensors)
    assert type(back.position_embeddings) is type(pe) and back.masks.keys() == masks.keys()
    for x, y in zip(back.tensors(), tensors):
        assert x is y
    assert back.stats is sctx.stats

    blocks = [ToyBlock(d) for _ in range(3)]
    X = torch.randn(3, 2 * d)
    grads = {}
    for reversible in (True, False):
        for blk in blocks:
            blk.zero_grad(set_to_none=True)
        Y_1, Y_2, _ = run_stack(blocks, *X.chunk(2, dim=-1), sctx, reversible)
        (Y_1.square().sum() + Y_2.sum()).backward()
        grads[reversible] = torch.cat([p.grad.reshape(-1) for blk in blocks for p in blk.parameters()])
    assert torch.allclose(grads[True], grads[False], atol=1e-5)
    assert grads[False].abs().sum() > 0

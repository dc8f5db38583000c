"""Choice record / replay on toy sub-blocks: every index-choosing op, compact records, flips,
mismatches and no mode left behind on errors; `RouterTap` keeps logits only. `StackContext`
round-trips position embeddings of any pytree shape (and per layer type) through the stack."""

import pytest
import torch
from torch import nn

from revffn.reversible import (
    AutocastState,
    RevBlock,
    RouterTap,
    StackContext,
    recording_choices,
    replaying_choices,
    run_stack,
)


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
    x = torch.randn(5, 8)
    with recording_choices() as records:
        _, _, idx = router(x)
    assert len(records) == 1 and records[0].dtype == torch.uint8
    assert torch.equal(records[0].long(), idx)

    with replaying_choices(records, track_flips=True) as replay:
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


CHOICES = {  # name -> (op on a (4, 6) float tensor, how many records it makes)
    "topk": (lambda s: torch.topk(s, 2, dim=1), 1),
    "Tensor.topk": (lambda s: s.topk(3), 1),
    "sort": (lambda s: torch.sort(s, dim=0, descending=True), 1),
    "Tensor.sort": (lambda s: s.sort(), 1),
    "argsort": (lambda s: torch.argsort(s, dim=-1), 1),
    "max(dim)": (lambda s: torch.max(s, 1), 1),
    "Tensor.max(dim, keepdim)": (lambda s: s.max(dim=-1, keepdim=True), 1),
    "min(dim)": (lambda s: torch.min(s, dim=0), 1),
    "argmax(dim)": (lambda s: torch.argmax(s, dim=1), 1),
    "argmin(flat)": (lambda s: s.argmin(), 1),
    "max(all), max(a, b), integer sort": (lambda s: (s.max(), torch.max(s, -s), torch.arange(6).flip(0).sort()), 0),
}


@pytest.mark.parametrize("name", list(CHOICES))
def test_every_choice_op_is_recorded_and_replayed(name):
    """Replayed on a perturbed input, each op returns the recorded indices and values gathered from
    the new input (differentiable); the fresh op would choose otherwise. Non-choices are not recorded."""
    op, n = CHOICES[name]
    torch.manual_seed(0)
    s = torch.randn(4, 6)
    with recording_choices() as records:
        out = op(s)
    assert len(records) == n
    if n == 0:
        return
    s2 = (s + 2 * torch.randn(4, 6)).requires_grad_(True)
    with replaying_choices(records, track_flips=True) as replay:
        again = op(s2)
    assert int(replay.flips) > 0, "the perturbation must change the fresh choice"
    indices = out if torch.is_tensor(out) else out[1]
    assert torch.equal(again if torch.is_tensor(again) else again[1], indices)
    if not torch.is_tensor(again):  # (values, indices): values gathered at the recorded indices
        values, idx = again
        dim = {"topk": 1, "sort": 0}.get(name, 0 if name.startswith("min") else -1)
        gathered = s2.gather(dim, idx if values.dim() == s2.dim() else idx.unsqueeze(dim))
        assert torch.equal(values, gathered.reshape(values.shape))
        values.sum().backward()
        assert s2.grad.count_nonzero() == idx.numel()  # the gradient flows to the recorded choices only


def test_records_are_compact_by_the_size_of_the_chosen_dim():
    for n, dtype in ((6, torch.uint8), (300, torch.int16), (40000, torch.int32)):
        with recording_choices() as records:
            torch.randn(2, n).topk(2, dim=-1)
            torch.randn(n, 3).argmax(dim=1)  # dim of size 3
        assert [r.dtype for r in records] == [dtype, torch.uint8]


def test_multinomial_replays_samples_and_keeps_the_rng_stream():
    """A sampling router: the recorded samples come back even on other probabilities, and the RNG
    advances as in forward (a later draw in the same sub-block sees the same numbers)."""
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.1, 0.8]])
    torch.manual_seed(3)
    with recording_choices() as records:
        picked = torch.multinomial(probs, 1)
        after = torch.rand(3)
    torch.manual_seed(3)
    with replaying_choices(records, track_flips=True) as replay:
        again = probs.flip(-1).multinomial(1)
        after_again = torch.rand(3)
    assert torch.equal(again, picked) and torch.equal(after, after_again)
    assert len(records) == 1 and int(replay.flips) > 0


def test_replay_that_does_not_match_the_forward_raises():
    s = torch.randn(4, 6)
    with recording_choices() as records:
        s.topk(2)
    with pytest.raises(RuntimeError, match="more often than the forward"):
        with replaying_choices(records):
            s.topk(2)
            s.argmax(-1)
    with pytest.raises(RuntimeError, match="made 0 choices, the forward 1"):
        with replaying_choices(records):
            pass
    assert _mode_depth() == 0


def test_router_tap_keeps_logits_until_taken_and_remove_detaches():
    router = Router()
    tap = RouterTap(router)
    x = torch.randn(3, 8)
    logits, _, _ = router(x)
    assert tap.logits is logits
    assert tap.take() is logits and tap.take() is None  # taken once: no graph kept alive
    tap.remove()
    assert not router._forward_hooks
    router(x)
    assert tap.logits is None


def test_an_error_inside_a_recorded_sub_block_leaves_no_mode_entered():
    router = Router()
    router.fail = True
    with pytest.raises(ValueError, match="router failed"):
        with recording_choices() as records:
            router(torch.randn(3, 8))
    assert len(records) == 1 and _mode_depth() == 0
    with pytest.raises(ValueError, match="router failed"):
        with replaying_choices(records):
            router(torch.randn(3, 8))
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


class KeyedBlock(RevBlock):
    """F and G scale by this block's own entry of per-layer-type position embeddings."""

    def __init__(self, d: int, key: str):
        super().__init__()
        self.f, self.g, self.position_key = nn.Linear(d, d), nn.Linear(d, d), key

    def F(self, X_2, sctx):  # noqa: N802
        return torch.tanh(self.f(X_2)) * sctx.position_embeddings[0]

    def G(self, Y_1, sctx):  # noqa: N802
        return torch.tanh(self.g(Y_1)) * sctx.position_embeddings[1]


def test_per_layer_type_position_embeddings_reach_their_own_blocks():
    torch.manual_seed(0)
    d = 4
    pe = {t: (torch.rand(3, d) + 0.5, torch.rand(3, d) + 0.5) for t in ("full", "sliding")}
    sctx = StackContext(pe, {}, AutocastState("cpu", False, torch.float32), per_layer_position=True)
    assert sctx.for_layer("sliding").position_embeddings is pe["sliding"]
    assert sctx.for_layer(None) is sctx
    blocks = [KeyedBlock(d, k) for k in ("full", "sliding", "full")]
    X = torch.randn(3, 2 * d)
    grads = {}
    for reversible in (True, False):
        for blk in blocks:
            blk.zero_grad(set_to_none=True)
        Y_1, Y_2, _ = run_stack(blocks, *X.chunk(2, dim=-1), sctx, reversible)
        (Y_1.square().sum() + Y_2.sum()).backward()
        grads[reversible] = torch.cat([p.grad.reshape(-1) for blk in blocks for p in blk.parameters()])
    assert torch.allclose(grads[True], grads[False], atol=1e-5)


def test_a_tap_not_listening_records_nothing():
    router = Router()
    tap = RouterTap(router, listening=False)
    router(torch.randn(3, 8))
    assert tap.logits is None
    with tap.listen():
        logits, _, _ = router(torch.randn(3, 8))
    assert tap.take() is logits and not tap.listening

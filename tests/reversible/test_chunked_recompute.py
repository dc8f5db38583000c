"""`recompute_chunk_tokens`: the reversible backward recomputes each token-wise G (the MoE branch) by
chunks of token rows, replaying each chunk's rows of the forward's choice records; the gradients are
those of the whole-batch recomputation (fp32 summation order aside), with padding and with the router's
load-balancing loss. G with an RNG record, or with a choice not made per token, is recomputed whole.

Tolerance: 1e-6 absolute on every gradient (parameters and the embedding output), whose largest
entries are ~0.1-1 here; measured differences are <= ~1.2e-7 (the chunks' partial sums of a parameter's
gradient add up in another order). A chunk replaying the wrong rows, or a missing load-balancing term,
is off by > 1e-4 (the negative controls below).
"""

import pytest
import torch
from torch import nn

from revffn import convert, tiny_model
from revffn.conversion.convert import DebugOptions
from tests.conftest import GENERIC, REQUIRED
from tests.reversible.test_replay import K, near_tie_model
from tests.reversible.test_rng import NoisyRouter

pytestmark = pytest.mark.usefixtures("one_thread")

CHUNK = 7  # does not divide B * T = 26: chunks of 7, 7, 7, 5
TOL = 1e-6
INPUT = "<embedding output>"


def _batch(padded: bool = True):
    ids = torch.randint(3, 512, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0  # left padding
    return ids, mask


def _grads(model, ids, mask, chunk: int, seed: int | None = None) -> tuple[dict, float]:
    """Every parameter's gradient and the gradient reaching the embedding output (the stack's input),
    with `recompute_chunk_tokens=chunk`; and the loss."""
    model.zero_grad(set_to_none=True)
    model.recompute_chunk_tokens = chunk
    box = {}

    def keep_input_grad(module, args, out):
        out.register_hook(lambda g: box.__setitem__(INPUT, g.clone()))

    handle = model.hf.model.embed_tokens.register_forward_hook(keep_input_grad)
    try:
        if seed is not None:
            torch.manual_seed(seed)  # the same noise in every forward
        loss = model(ids, attention_mask=mask, labels=ids, return_logits=False).loss
        loss.backward()
    finally:
        handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {**grads, **box}, loss.item()


def _err(a: dict, b: dict) -> float:
    """The largest absolute difference over every gradient."""
    assert a.keys() == b.keys()
    return max((a[n] - b[n]).abs().max().item() for n in b)


def _rel(a: dict, b: dict, names) -> float:
    num = torch.cat([(a[n] - b[n]).reshape(-1) for n in names]).norm()
    return (num / torch.cat([b[n].reshape(-1) for n in names]).norm()).item()


def _g_calls(model) -> tuple[list[int], list]:
    """Records the token count of every call of each layer's MoE / MLP module that runs with grad
    enabled (in the reversible path: only the backward recomputation)."""
    calls = []

    def count(module, args, out):
        if torch.is_grad_enabled():
            calls.append(args[0].shape[:-1].numel())

    handles = [b.base_layer.mlp.register_forward_hook(count) for b in model.blocks]
    return calls, handles


@pytest.mark.parametrize("name", REQUIRED + [GENERIC])
def test_chunked_matches_whole_with_padding_and_aux_loss(name):
    """Padding, and the load-balancing loss with a trainable router (its gradient flows through every
    chunk's surrogate): the same gradients as the whole-batch recomputation, and the same forward."""
    model = convert(tiny_model(name, num_hidden_layers=2), aux_loss_coef=0.1)
    model.train()
    assert model.router_trainable()
    ids, mask = _batch()
    g_whole, loss_whole = _grads(model, ids, mask, 0)
    assert "recompute_chunks" not in model.last_stack_stats
    calls, handles = _g_calls(model)
    try:
        g_chunked, loss_chunked = _grads(model, ids, mask, CHUNK)
    finally:
        for h in handles:
            h.remove()
    err = _err(g_chunked, g_whole)
    print(f"{name}: chunked vs whole, max abs grad difference {err:.2e}")
    assert loss_chunked == loss_whole  # the forward is untouched
    assert max(g.abs().max().item() for g in g_whole.values()) > 1e-2  # the tolerance is small against them
    assert err <= TOL
    assert model.last_stack_stats["recompute_chunks"] == {0: 4, 1: 4}
    assert calls == [7, 7, 7, 5] * 2  # G really ran chunk by chunk in backward, never on all 26 tokens
    assert model.last_stack_stats["f_recompute_chunks"] == {0: 2, 1: 2}  # F: one 13-token sequence a chunk


def _f_calls(model) -> tuple[list[int], list]:
    """Records the batch size of every call of each layer's attention module that runs with grad
    enabled (in the reversible path: only the backward recomputation)."""
    calls = []

    def count(module, args, kwargs, out):
        if torch.is_grad_enabled():
            calls.append(kwargs.get("hidden_states", args[0] if args else None).shape[0])

    handles = [b.base_layer.self_attn.register_forward_hook(count, with_kwargs=True) for b in model.blocks]
    return calls, handles


@pytest.mark.parametrize("name", REQUIRED + [GENERIC])
def test_attention_recomputed_by_whole_sequences(name):
    """F (attention) is recomputed by chunks of whole sequences: with left padding (its mask rows
    sliced with the sequences) and 3 sequences of 13 tokens in chunks of at most 26 tokens (2, then 1),
    the same gradients as the whole recomputation; F really ran on 2 then 1 sequences in backward."""
    model = convert(tiny_model(name, num_hidden_layers=2))
    model.train()
    ids = torch.randint(3, 512, (3, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    g_whole, loss_whole = _grads(model, ids, mask, 0)
    assert "f_recompute_chunks" not in model.last_stack_stats
    calls, handles = _f_calls(model)
    try:
        g_chunked, loss_chunked = _grads(model, ids, mask, 26)
    finally:
        for h in handles:
            h.remove()
    assert loss_chunked == loss_whole
    assert model.last_stack_stats["f_recompute_chunks"] == {0: 2, 1: 2}
    assert calls == [2, 1] * 2
    assert _err(g_chunked, g_whole) <= TOL


def test_attention_chunks_with_the_wrong_mask_rows_are_wrong():
    """The negative control of the mask slicing: each chunk given the first sequences' mask rows
    (the padded sequence's mask on an unpadded one) gives other gradients."""
    from revffn.reversible import coupling

    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2))
    model.train()
    ids = torch.randint(3, 512, (2, 13), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    g_whole, _ = _grads(model, ids, mask, 0)
    real = coupling.StackContext.batch_rows

    def first_rows(self, rows, batch, seq):
        return real(self, slice(1, 2) if rows.start == 0 else slice(0, 1), batch, seq)

    coupling.StackContext.batch_rows = first_rows
    try:
        g_wrong, _ = _grads(model, ids, mask, 13)
    finally:
        coupling.StackContext.batch_rows = real
    assert model.last_stack_stats["f_recompute_chunks"] == {0: 2, 1: 2}
    assert _err(g_wrong, g_whole) > 1e-4


def test_aux_loss_gradient_is_exact_per_chunk():
    """aux_loss_coef 1: the router gradients are dominated by the load-balancing term, which the
    chunks inject through their own rows of the padding mask; without that term they are far off."""
    model = convert(tiny_model("tiny-qwen3-moe", num_hidden_layers=3), aux_loss_coef=1.0)
    model.train()
    ids, mask = _batch()
    g_whole, _ = _grads(model, ids, mask, 0)
    g_chunked, _ = _grads(model, ids, mask, CHUNK)
    routers = [n for n in g_whole if ".mlp.gate." in n]
    assert len(routers) == 3
    assert _err(g_chunked, g_whole) <= TOL
    assert _rel(g_chunked, g_whole, routers) <= 1e-5
    model.aux_loss_coef = 0.0
    g_noaux, _ = _grads(model, ids, mask, CHUNK)
    assert _rel(g_noaux, g_whole, routers) > 1e-2, "the aux loss must contribute to router gradients"


def test_chunked_replay_survives_a_forced_near_tie():
    """The negative control of the record slicing: a forced near-tie (test_replay) makes the rebuilt
    input choose other experts. Each chunk replays its own rows of the record, so the gradients are
    the whole recomputation's; a chunked recomputation without replay (fresh choices) is far off."""
    model = near_tie_model()
    model.train()

    def flip_feature_k(module, args):
        if torch.is_grad_enabled():  # only the backward recomputation runs the router with grad
            x = args[0].clone()
            x[..., K] = -x[..., K]
            return (x,)

    ids = torch.randint(3, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    handles = [r.register_forward_pre_hook(flip_feature_k) for r in model.routers()]
    try:
        g_whole, _ = _grads(model, ids, None, 0)
        model.debug = DebugOptions(track_routing_flips=True)
        g_chunked, _ = _grads(model, ids, None, CHUNK)
        flips = model.routing_flips()
        model.debug = DebugOptions(routing_replay=False)
        g_fresh, _ = _grads(model, ids, None, CHUNK)
    finally:
        for h in handles:
            h.remove()
        model.debug = DebugOptions()
    experts = [n for n in g_whole if ".experts." in n]
    err, err_fresh = _err(g_chunked, g_whole), _rel(g_fresh, g_whole, experts)
    print(f"flips={flips}: chunked replay max abs difference {err:.2e}; without replay expert grads {err_fresh:.2e}")
    assert flips > 0, "the forced near-tie must flip the fresh top-k in the chunks"
    assert err <= TOL
    assert err_fresh > 1e-2


def test_rng_in_g_falls_back_to_the_whole_recomputation():
    """Router jitter draws random numbers in G: a chunk would draw others, so every G is recomputed
    whole: the same bits as without chunking, and no layer in `recompute_chunks` (one sequence, so
    that F, which is chunked by sequences, is recomputed whole too)."""
    model = convert(tiny_model("tiny-mixtral", num_hidden_layers=2, router_jitter_noise=0.2))
    model.train()
    ids, mask = (t[1:] for t in _batch())
    g_whole, _ = _grads(model, ids, mask, 0, seed=123)
    g_chunked, _ = _grads(model, ids, mask, CHUNK, seed=123)
    assert model.last_stack_stats["rng_sub_blocks"] == [(0, "G"), (1, "G")]
    assert model.last_stack_stats.get("recompute_chunks", {}) == {}
    assert all(torch.equal(g_chunked[n], g_whole[n]) for n in g_whole)
    g_other, _ = _grads(model, ids, mask, 0, seed=7)
    assert _err(g_other, g_whole) > 1e-4, "the noise must matter"


def test_rng_in_one_layer_or_in_f_only():
    """Noise in layer 1's router only: layer 1's G is recomputed whole, layer 0's by chunks. Attention
    dropout draws in F, which is never chunked: G still is. Both exact against the whole recomputation."""
    hf = tiny_model("tiny-qwen2-moe", num_hidden_layers=2, attention_dropout=0.3)
    hf.model.layers[1].mlp.gate = NoisyRouter(hf.model.layers[1].mlp.gate)
    model = convert(hf)
    model.train()
    ids, mask = _batch()
    g_whole, _ = _grads(model, ids, mask, 0, seed=5)
    g_chunked, _ = _grads(model, ids, mask, CHUNK, seed=5)
    stats = model.last_stack_stats
    assert stats["rng_sub_blocks"] == [(0, "F"), (1, "F"), (1, "G")]
    assert stats["recompute_chunks"] == {0: 4}
    assert "f_recompute_chunks" not in stats  # F drew random numbers: recomputed whole
    assert _err(g_chunked, g_whole) <= TOL


class CrossTokenRouter(nn.Module):
    """A router that also makes a choice across tokens (it orders them by their top logit, as an
    expert-choice router would), or one on the (B, T, E) logits: not row slices of B*T."""

    def __init__(self, router: nn.Module, how: str):
        super().__init__()
        self.router, self.how = router, how

    def forward(self, x):
        logits, weights, chosen = self.router(x)
        if self.how == "across":
            logits.max(-1).values.argsort()  # a choice along the token dim: recorded, not per row
        else:
            logits.view(1, -1, logits.shape[-1]).topk(2, dim=-1)  # a (1, T, k) record: leading dim 1
        return logits, weights, chosen


@pytest.mark.parametrize("how", ["across", "3d"])
def test_a_choice_not_per_row_falls_back(how):
    """A record that is not row slices of B*T: that G is recomputed whole, exactly as without chunking."""
    hf = tiny_model("tiny-olmoe", num_hidden_layers=2)
    hf.model.layers[0].mlp.gate = CrossTokenRouter(hf.model.layers[0].mlp.gate, how)
    model = convert(hf)
    model.train()
    ids, mask = _batch()
    g_whole, _ = _grads(model, ids[:1], mask[:1], 0)
    g_chunked, _ = _grads(model, ids[:1], mask[:1], CHUNK)
    assert model.last_stack_stats["recompute_chunks"] == {1: 2}  # layer 1 by chunks, layer 0 whole
    assert _err(g_chunked, g_whole) <= TOL


def test_chunk_of_all_tokens_or_more_is_the_whole_recomputation():
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2))
    model.train()
    ids, mask = _batch()
    g_whole, _ = _grads(model, ids, mask, 0)
    for chunk in (26, 1000):
        g, _ = _grads(model, ids, mask, chunk)
        assert "recompute_chunks" not in model.last_stack_stats
        assert all(torch.equal(g[n], g_whole[n]) for n in g_whole)
    g_one, _ = _grads(model, ids, mask, 1)  # one token per chunk
    assert model.last_stack_stats["recompute_chunks"] == {0: 26, 1: 26}
    assert _err(g_one, g_whole) <= TOL


@pytest.mark.parametrize("chunk", [0, CHUNK])
def test_blocks_rebuild_their_inputs_in_place(monkeypatch, chunk):
    """Each block's backward writes X_1 and X_2 into the buffers of Y_1 and Y_2 (the top block's are the stack's
    saved outputs) and, below the top block, their gradients into those of dY_1 and dY_2: no new stream, with the
    same bits as separate buffers. Autograd's incoming gradients (the top block's dY) are never written."""
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=3))
    model.train()
    ids, mask = _batch()
    block_cls = type(model.blocks[0])
    original = block_cls.backward_pass
    seen = []

    def recording(force_copy):
        def backward_pass(self, Y_1, Y_2, dY_1, dY_2, sctx, records, d_aux=None, owned=(False,) * 4):
            ptrs = [None if t is None else t.untyped_storage().data_ptr() for t in (Y_1, Y_2, dY_1, dY_2)]
            owned = (False,) * 4 if force_copy else owned
            out = original(self, Y_1, Y_2, dY_1, dY_2, sctx, records, d_aux, owned=owned)
            seen.append((owned, ptrs, [t.untyped_storage().data_ptr() for t in out]))
            return out
        return backward_pass

    monkeypatch.setattr(block_cls, "backward_pass", recording(force_copy=False))
    g_in_place, _ = _grads(model, ids, mask, chunk)
    assert [owned for owned, _, _ in seen] == [(True, True, False, False)] + [(True,) * 4] * 2
    (_, top_in, top_out), *lower = seen
    assert top_out[:2] == top_in[:2]  # X_1, X_2 in the saved outputs' buffers
    assert not set(top_out[2:]) & set(top_in)  # the gradients in new ones
    for _, ptrs_in, ptrs_out in lower:
        assert ptrs_out == ptrs_in  # X_1 in Y_1's buffer, X_2 in Y_2's, dX_1 in dY_1's, dX_2 in dY_2's
    seen.clear()
    monkeypatch.setattr(block_cls, "backward_pass", recording(force_copy=True))
    g_copied, _ = _grads(model, ids, mask, chunk)
    assert all(not set(p_in) & set(p_out) for _, p_in, p_out in seen)  # the control did allocate
    assert g_in_place.keys() == g_copied.keys()
    assert all(torch.equal(g_in_place[n], g_copied[n]) for n in g_copied)


def test_a_second_backward_through_the_stack_stops_loudly():
    """The backward rebuilds the streams in the saved outputs' buffers, so the graph serves one backward:
    retain_graph=True and a second backward stop on autograd's in-place check, not with wrong gradients."""
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2))
    model.train()
    ids, mask = _batch()
    loss = model(ids, attention_mask=mask, labels=ids, return_logits=False).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()

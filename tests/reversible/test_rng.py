"""RNG replay without a list: any sub-block that draws random numbers is recorded and replayed.

The reversible backward re-runs every sub-block; one that draws noise must draw the same noise
again. `RevStackFunction` compares the generator state around each sub-block and keeps the state
from before it only where it moved, whatever the op (dropout, router jitter, a custom router).
"""

import pytest
import torch
from torch import nn

from revffn import convert, tiny_model
from revffn.memory.measure import saved_bytes_of_stack

CPU_STATE_BYTES = torch.get_rng_state().numel()  # 5056: mt19937


class NoisyRouter(nn.Module):
    """A router that adds Gaussian noise to its input in training, under no config key at all."""

    def __init__(self, router: nn.Module, scale: float = 0.5):
        super().__init__()
        self.router, self.scale = router, scale

    def forward(self, x):
        if self.training:
            x = x + torch.randn_like(x) * self.scale
        return self.router(x)


def _noisy(hf, layers=None):
    for i, layer in enumerate(hf.model.layers):
        if layers is None or i in layers:
            layer.mlp.gate = NoisyRouter(layer.mlp.gate)
    return hf


def _grads(model, ids, seed, reversible=True):
    model.zero_grad(set_to_none=True)
    model.reversible = reversible
    torch.manual_seed(seed)  # before each forward: the plain and reversible ones draw the same noise
    model(ids, labels=ids, return_logits=False).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b):
    """The largest relative error of one parameter's gradient (`revffn check`'s max_rel_grad_error)."""
    return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b if b[n].abs().max() > 0)


def _ids():
    return torch.randint(3, 512, (2, 16), generator=torch.Generator().manual_seed(0))


def test_unlisted_randomness_is_exact_with_replay_and_wrong_without():
    """The negative control: the same model, with `debug.rng_replay` off, gets wrong gradients."""
    model = convert(_noisy(tiny_model("tiny-qwen2-moe", num_hidden_layers=3)))
    model.train()
    ids = _ids()
    g_plain = _grads(model, ids, 123, reversible=False)
    g_rev = _grads(model, ids, 123)
    assert model.last_stack_stats["rng_sub_blocks"] == [(0, "G"), (1, "G"), (2, "G")]
    model.debug.rng_replay = False
    g_off = _grads(model, ids, 123)
    err, err_off = _rel(g_rev, g_plain), _rel(g_off, g_plain)
    print(f"noisy router, grad rel err: replay {err:.2e}, no replay {err_off:.2e}")
    assert err < 1e-5
    assert err_off > 1e-2
    assert _rel(_grads(model, ids, 7, reversible=False), g_plain) > 1e-3, "the noise must matter"


@pytest.mark.parametrize("name,overrides,noisy,sub_block", [
    ("tiny-qwen2-moe", {"attention_dropout": 0.3}, False, "F"),
    ("tiny-mixtral", {"router_jitter_noise": 0.2}, False, "G"),
    ("tiny-olmoe", {}, True, "G"),
])
def test_rng_replay_matches_plain_and_leaves_global_rng(name, overrides, noisy, sub_block):
    hf = tiny_model(name, num_hidden_layers=3, **overrides)
    model = convert(_noisy(hf) if noisy else hf)
    model.train()
    ids = _ids()
    g_plain = _grads(model, ids, 123, reversible=False)
    after_plain = torch.get_rng_state()
    g_rev = _grads(model, ids, 123)
    after_rev = torch.get_rng_state()
    assert _rel(g_rev, g_plain) < 1e-5
    assert torch.equal(after_plain, after_rev), "backward replay must not disturb the global RNG"
    assert model.last_stack_stats["rng_sub_blocks"] == [(i, sub_block) for i in range(3)]
    assert model.last_stack_stats["rng_bytes"] == 3 * CPU_STATE_BYTES
    assert _rel(_grads(model, ids, 7, reversible=False), g_plain) > 1e-3, "the noise must be active"


def test_only_the_sub_block_that_draws_is_recorded():
    """Noise in layer 1's router only: one record, G of layer 1; F's dropout adds F records."""
    model = convert(_noisy(tiny_model("tiny-qwen3-moe", num_hidden_layers=3), layers={1}))
    model.train()
    ids = _ids()
    g_plain = _grads(model, ids, 5, reversible=False)
    g_rev = _grads(model, ids, 5)
    assert model.last_stack_stats["rng_sub_blocks"] == [(1, "G")]
    assert model.last_stack_stats["rng_bytes"] == CPU_STATE_BYTES
    assert _rel(g_rev, g_plain) < 1e-5


class SamplingRouter(nn.Module):
    """Samples its top-k experts from the softmax with `multinomial`: RNG and a choice in one op."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.router = router

    def forward(self, x):
        logits, _, _ = self.router(x)
        probs = logits.softmax(-1)
        chosen = torch.multinomial(probs, self.router.top_k)
        return logits, probs.gather(-1, chosen), chosen


def test_a_sampling_router_is_replayed():
    """multinomial draws from the generator (RNG record of G) and chooses (a choice record): exact."""
    hf = tiny_model("tiny-qwen2-moe", num_hidden_layers=3)
    for layer in hf.model.layers:
        layer.mlp.gate = SamplingRouter(layer.mlp.gate)
    model = convert(hf)
    model.train()
    ids = _ids()
    g_plain = _grads(model, ids, 123, reversible=False)
    g_rev = _grads(model, ids, 123)
    assert model.last_stack_stats["rng_sub_blocks"] == [(0, "G"), (1, "G"), (2, "G")]
    assert _rel(g_rev, g_plain) < 1e-5
    assert _rel(_grads(model, ids, 7, reversible=False), g_plain) > 1e-3, "the sampling must matter"


def test_no_randomness_records_zero_bytes_and_records_stay_out_of_activations():
    """Train mode, dropout 0, no jitter: nothing drawn, nothing stored. With dropout, the RNG
    records are counted apart: the activation bytes (records excluded) do not change."""
    ids = _ids()

    def stack_bytes(**overrides):
        model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=3, **overrides))
        model.train()
        with saved_bytes_of_stack(model) as log:
            model(ids, labels=ids, return_logits=False)
        stats = model.last_stack_stats
        return stats, log.bytes(stats["record_storages"]), log.bytes()

    stats, activations, total = stack_bytes()
    assert stats["rng_bytes"] == 0 and stats["rng_sub_blocks"] == []
    assert total - activations == stats["record_bytes"] > 0  # routing records only
    stats_d, activations_d, total_d = stack_bytes(attention_dropout=0.1)
    assert stats_d["rng_bytes"] == 3 * CPU_STATE_BYTES
    assert activations_d == activations
    assert total_d - activations_d == stats_d["record_bytes"] + stats_d["rng_bytes"]


def test_eval_and_plain_twin_record_nothing():
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2, attention_dropout=0.3))
    model.eval()
    model(_ids(), return_logits=False)
    assert model.last_stack_stats == {}  # eval runs the plain twin: nothing watched, nothing recorded


@pytest.mark.gpu
def test_cuda_rng_replay_records_only_the_device_generator():
    """On CUDA, dropout draws from the device's Philox generator: 16 bytes per sub-block."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = convert(_noisy(tiny_model("tiny-qwen2-moe", num_hidden_layers=3, attention_dropout=0.3))).cuda()
    model.train()
    ids = _ids().cuda()
    g_plain = _grads(model, ids, 123, reversible=False)
    after_plain = torch.cuda.get_rng_state()
    g_rev = _grads(model, ids, 123)
    assert torch.equal(after_plain, torch.cuda.get_rng_state())
    stats = model.last_stack_stats
    assert stats["rng_sub_blocks"] == [(i, s) for i in range(3) for s in "FG"]
    assert stats["rng_bytes"] == 6 * torch.cuda.get_rng_state().numel()
    assert _rel(g_rev, g_plain) < 1e-5
    model.debug.rng_replay = False
    assert _rel(_grads(model, ids, 123), g_plain) > 1e-2

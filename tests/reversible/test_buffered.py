"""The buffered coupling (`reversible.buffered`): every decoder layer whole on fixed-point streams, rebuilt bitwise
from the top with k bits a coordinate a layer, its gradients the plain twin's, and at init the HF model to 2^-k."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from revffn.conversion.convert import convert
from revffn.conversion.teacher import teacher_context, teacher_layer
from revffn.errors import UserError
from revffn.models.loading import build_hf, config_overrides
from revffn.reports.check import make_batch, run_check
from revffn.reversible.buffered import (
    DEFAULT_MOMENTUM,
    RebuildError,
    attention_kernels,
    deterministic_kernels,
    pack_low_bits,
    unpack_low_bits,
)
from tests.conftest import GENERIC, REQUIRED


def _hf(name: str = "tiny-qwen2-moe", layers: int = 6):
    return build_hf(name, torch.float32, 0, torch.device("cpu"),
                    **config_overrides(name, layers, None, shipped_vocab=False))


def _model(name: str = "tiny-qwen2-moe", layers: int = 6, bits: int = 4):
    hf = _hf(name, layers)
    model = convert(hf, coupling="buffered", buffer_bits=bits, buffer_momentum=DEFAULT_MOMENTUM).train()
    return model, make_batch(hf.config.vocab_size, 2, 32, 0)


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_the_low_bits_pack_and_unpack(bits):
    a = torch.randint(-2**40, 2**40, (3, 7, 5), dtype=torch.int64)  # 105 elements: not a multiple of 8
    packed = pack_low_bits(a, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == bits * 14  # bits planes of ceil(105 / 8) bytes
    assert torch.equal(unpack_low_bits(packed, a.shape).to(torch.int64), a & ((1 << bits) - 1))


@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-mixtral"])
def test_every_layer_input_is_rebuilt_bitwise(name):
    model, (ids, mask, _) = _model(name)
    assert model.rebuild_errors(ids, mask) == [0.0] * 6
    assert model.adapter_parameters() == []  # whole layers: nothing added to the HF model


@pytest.mark.parametrize("model_name", REQUIRED + [GENERIC])
def test_fp32_parity_with_the_plain_twin(model_name):
    """Reversible (fixed point, bit buffer) against the plain twin (float64 streams, ordinary autograd), routers
    trainable with the load-balancing loss: every parameter's gradient."""
    r = run_check(model_name, layers=4, dtype="float32", batch=2, seq=24, coupling="buffered")
    print(model_name, {k: r[k] for k in ("max_rel_grad_error", "max_reconstruction_error", "conversion_gap")})
    assert r["coupling"] == "buffered" and r["passed"]
    assert r["max_rel_grad_error"] <= 1e-5
    assert r["saved_bytes_reversible"] < r["saved_bytes_plain"] / 5


@pytest.mark.parametrize("momentum, sign", [("positive", 1), ("negative", -1)])
def test_the_twin_is_the_hf_decoder_layers_with_the_coupling(momentum, sign):
    """F + G of each block is its HF decoder layer's update: the twin equals the recurrence v' = s lam v + D(b),
    b' = b + v' computed with the HF layers themselves (D(b) = layer(b) - b); and lam -> 0 is the unconverted
    model."""
    hf = _hf(layers=4)
    ids, mask, _ = make_batch(hf.config.vocab_size, 2, 16, 0)
    with torch.no_grad():
        base = hf(input_ids=ids, attention_mask=mask).logits
    gaps = {}
    for bits in (2, 8):
        model = convert(_hf(layers=4), coupling="buffered", buffer_bits=bits, buffer_momentum=momentum).eval()
        with torch.no_grad():
            out = model(ids, attention_mask=mask).logits
            h, pos, sctx = teacher_context(model, ids, mask)
            v, b = torch.zeros_like(h), h
            for block in model.blocks:
                v = sign * 2.0 ** -bits * v + teacher_layer(block, b, sctx, pos) - b
                b = b + v
            ref = model.hf.lm_head(model.hf.model.norm(b))
        assert (out - ref).abs().max() < 1e-4 * ref.abs().max()
        gaps[bits] = (out - base).abs().max().item()
    assert 0 < gaps[8] < gaps[2] / 10


@pytest.mark.parametrize("momentum", ["positive", "negative"])
def test_both_momenta_rebuild_bitwise_and_match_the_twins_gradients(momentum):
    """Each sign of lam: every layer input rebuilt bitwise, and the reversible gradients the plain twin's."""
    model, (ids, mask, labels) = _model(layers=4)
    model.buffer_momentum = momentum
    assert model.rebuild_errors(ids, mask) == [0.0] * 4
    grads = {}
    for reversible in (True, False):
        model.reversible = reversible
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, labels=labels, return_logits=False).loss.backward()
        grads[reversible] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 10
    for n, g in grads[False].items():
        assert (grads[True][n] - g).abs().max() <= 1e-5 * max(g.abs().max(), 1e-6), n
    with pytest.raises(UserError, match="buffer_momentum"):
        convert(_hf(layers=2), coupling="buffered", buffer_momentum="sideways")


def test_a_recompute_that_is_not_bitwise_is_refused():
    """A layer that computes differently in backward than in forward (here: noise on its second call, as a
    nondeterministic kernel would) leaves the rebuilt input off by 2^k a layer: the backward raises."""
    model, (ids, mask, labels) = _model(layers=3)
    g = model.blocks[1].G
    calls = []

    def noisy(x, sctx):
        calls.append(1)
        out = g(x, sctx)
        return out + 1e-6 if len(calls) > 1 else out

    model.blocks[1].G = noisy
    with pytest.raises(RebuildError, match="bitwise"):
        model(ids, attention_mask=mask, labels=labels, return_logits=False).loss.backward()


def test_the_buffer_is_k_bits_a_coordinate_a_layer():
    for layers, bits in ((2, 4), (4, 4), (4, 2)):
        model, (ids, mask, labels) = _model(layers=layers, bits=bits)
        model(ids, attention_mask=mask, labels=labels, return_logits=False).loss.backward()
        assert model.last_stack_stats["buffer_bytes"] == layers * bits * ids.numel() * model.config.hidden_size // 8


def test_each_layers_bits_are_freed_once_its_layer_is_rebuilt():
    """The bit buffers live on the autograd node, not in saved tensors: when the backward has rebuilt layer i, the
    buffers of the layers above it are gone (the step's peak is at the bottom of the backward); their bytes are
    still reported (`held_bytes`), and a second backward through the same graph is refused (the saved streams
    are rebuilt in place: autograd's version check)."""
    import weakref

    model, (ids, mask, labels) = _model(layers=4)
    alive_at = {}
    refs = []

    def probe(i, v, b):
        if refs:  # (the backward's calls; the forward makes none on the reversible path)
            alive_at[i] = [ref() is not None for ref in refs]

    loss = model(ids, attention_mask=mask, labels=labels, return_logits=False, probe=probe).loss
    todo, node = [loss.grad_fn], None
    while todo and node is None:
        n = todo.pop()
        node = n if type(n).__name__ == "BufferedStackFunctionBackward" else None
        todo.extend(m for m, _ in n.next_functions if m is not None)
    refs.extend(weakref.ref(t) for t in node.lost)
    assert model.last_stack_stats["held_bytes"] == sum(r().numel() for r in refs) > 0
    loss.backward(retain_graph=True)
    assert alive_at == {i: [j <= i for j in range(4)] for i in range(4)}  # layer i's own: in use until the next
    assert all(r() is None for r in refs)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()


def test_the_backward_recomputes_a_layer_by_chunks_of_whole_sequences():
    """recompute_chunk_tokens: each layer recomputed and back-propagated a chunk of sequences at a time (its router
    choices and load-balancing rows sliced to them): the same gradients as the whole batch at once."""
    grads = {}
    for chunk in (0, 64):
        hf = _hf(layers=3)
        model = convert(hf, coupling="buffered").train()
        model.recompute_chunk_tokens = chunk
        ids, mask, labels = make_batch(hf.config.vocab_size, 4, 32, 0)
        model(ids, attention_mask=mask, labels=labels, return_logits=False).loss.backward()
        grads[chunk] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        stats = model.last_stack_stats.get("recompute_chunks", {})
        assert stats == ({0: 2, 1: 2, 2: 2} if chunk else {})
    assert grads[0].keys() == grads[64].keys() and any("gate" in n for n in grads[0])  # routers trained: the aux
    for n, g in grads[0].items():
        assert torch.allclose(grads[64][n], g, rtol=1e-5, atol=1e-8), n


def test_the_plain_twin_runs_chunked_under_autograd():
    """The twin (reversible=False: eval with grad, parity references) computes a layer's update by the same chunks,
    and its gradients are the reversible backward's (stop 51's `out=` write of a chunk broke its autograd)."""
    grads = {}
    for reversible in (True, False):
        hf = _hf(layers=3)
        model = convert(hf, coupling="buffered").train()
        model.recompute_chunk_tokens, model.reversible = 64, reversible
        ids, mask, labels = make_batch(hf.config.vocab_size, 4, 32, 0)
        model(ids, attention_mask=mask, labels=labels, return_logits=False).loss.backward()
        grads[reversible] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads[True].keys() == grads[False].keys()
    for n, g in grads[False].items():
        assert torch.allclose(grads[True][n], g, rtol=1e-5, atol=1e-8), n


def test_a_layer_beyond_the_fixed_point_range_gives_a_nan_loss_not_garbage():
    """Past |x| = 2^30 (or NaN) the int64 streams would wrap: the stack's output is NaN, so the loss is, and the
    training loop stops as on any diverged run (tests/training/test_resume.py's NaN run)."""
    model, (ids, mask, labels) = _model(layers=2)
    g = model.blocks[0].G
    model.blocks[0].G = lambda x, sctx: g(x, sctx) * 2.0**40
    out = model(ids, attention_mask=mask, labels=labels, return_logits=False)
    assert torch.isnan(out.loss)
    out.loss.backward()  # NaN gradients reach the embeddings; the loop's own check refuses the step


def test_cuda_gets_deterministic_kernels_and_the_cpu_is_left_alone(monkeypatch):
    """The bitwise recompute on CUDA needs deterministic algorithms (an MoE's index_add_ uses atomics otherwise) and
    cuBLAS's deterministic workspace; a user's own CUBLAS_WORKSPACE_CONFIG is kept; deterministic mode's NaN-fill of
    fresh memory is left off (it slowed only the buffered runs); the CPU changes nothing."""
    from torch.utils import deterministic

    was, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = deterministic.fill_uninitialized_memory
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    filters = warnings.filters[:]  # (its warning filters are process-wide too)
    try:
        torch.use_deterministic_algorithms(False)
        deterministic.fill_uninitialized_memory = True
        deterministic_kernels(torch.device("cpu"))
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        assert deterministic.fill_uninitialized_memory
        deterministic_kernels(torch.device("cuda"))
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and not deterministic.fill_uninitialized_memory
        # the alerts of kernels the rebuild does not depend on are quiet (their texts as torch's CUDA kernels raise
        # them), any other kernel's still prints
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            deterministic_kernels(torch.device("cuda"))  # (its filters go first, ahead of "always")
            for text in ("Flash Attention defaults to a non-deterministic algorithm. To explicitly enable determinism "
                         "call torch.use_deterministic_algorithms(True, warn_only=False).",
                         "Memory Efficient attention defaults to a non-deterministic algorithm. To explicitly enable "
                         "determinism call torch.use_deterministic_algorithms(True, warn_only=False).",
                         "_histc_cuda with floating point input does not have a deterministic implementation, "
                         "but you set "
                         "'torch.use_deterministic_algorithms(True, warn_only=True)'.",
                         "scatter_add_cuda_kernel does not have a deterministic implementation, but you set "
                         "'torch.use_deterministic_algorithms(True, warn_only=True)'."):
                warnings.warn(text, UserWarning, stacklevel=1)
        assert [str(w.message).split()[0] for w in seen] == ["scatter_add_cuda_kernel"]
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        deterministic_kernels(torch.device("cuda"))
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
        deterministic.fill_uninitialized_memory = fill
        warnings.filters[:] = filters


def test_cuda_layers_use_one_set_of_attention_kernels_and_the_cpu_is_left_alone():
    """On CUDA a layer's forward and its recompute run under the same SDPA choice, cuDNN's excluded (its plan with
    the logsumexp kept for a backward is another than without); on the CPU the flags are not touched."""
    before = [torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()]
    with attention_kernels(torch.device("cpu")):
        assert [torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()] == before
    with attention_kernels(torch.device("cuda")):  # flags only: no GPU needed to read them
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
        assert torch.backends.cuda.math_sdp_enabled()
    assert [torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()] == before


def test_every_layer_runs_under_the_attention_kernels_in_forward_and_recompute(monkeypatch):
    """Each layer's forward (`layer_update`, no grad) and its recompute in the backward (`invert_layer`, grad) run
    under `attention_kernels`: both see the same SDPA choice. (The recompute did not, until this test.)"""
    from revffn.reversible import buffered

    model, (ids, mask, labels) = _model(layers=3)
    seen = []

    def kernels(device):
        seen.append(torch.is_grad_enabled())
        return attention_kernels(device)

    monkeypatch.setattr(buffered, "attention_kernels", kernels)
    model(ids, attention_mask=mask, labels=labels, return_logits=False).loss.backward()
    assert seen.count(False) == 3 and seen.count(True) == 3  # each layer once without grad, once with


def test_the_cli_sets_cublas_workspace_before_anything_runs(monkeypatch, capsys):
    """cuBLAS reads CUBLAS_WORKSPACE_CONFIG once, at the first matmul, and `revffn convert` / the study evaluate
    the base before the buffered coupling asks for it: the CLI sets it at start (inherited by its workers), and keeps
    a user's own."""
    from revffn.cli import main

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with pytest.raises(SystemExit):  # no command: argparse's usage error, after the start-up
        main([])
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with pytest.raises(SystemExit):
        main([])
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"

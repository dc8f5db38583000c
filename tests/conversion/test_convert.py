"""Conversion: structure, masks, inits, unsupported layouts, local directories."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import revffn
from revffn import convert, tiny_model
from revffn.archs.architectures import spec_for
from revffn.errors import UserError
from tests.conftest import GENERIC, REQUIRED


@pytest.mark.parametrize("name", REQUIRED + [GENERIC])
def test_tiny_models_are_real_hf_classes(name):
    hf = tiny_model(name, num_hidden_layers=3)
    assert type(hf).__module__.startswith("transformers.models.")
    assert hf.config.num_hidden_layers == 3
    assert spec_for(hf).model_type == hf.config.model_type
    model = convert(hf)
    assert len(model.blocks) == 3
    assert model.blocks[1].router_tap is not None
    # the unconverted pieces stay reachable, as PEFT keeps base_layer
    assert model.blocks[0].base_layer.self_attn is not None
    out = model(torch.randint(3, 512, (2, 8)), labels=torch.randint(3, 512, (2, 8)))
    assert out.logits.shape == (2, 8, 512) and torch.isfinite(out.loss)


def test_generic_spec_is_used_for_unregistered_architecture():
    hf = tiny_model(GENERIC, num_hidden_layers=2)
    spec = spec_for(hf)
    assert spec.model_type == "glm4_moe" and "generic" in spec.notes
    from revffn.archs.architectures import ARCHITECTURES

    assert "glm4_moe" not in ARCHITECTURES


def test_unsupported_layout_gives_clear_error():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UserError) as e:
        convert(gpt2)
    msg = str(e.value)
    assert "gpt2" in msg
    for t in ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe"):
        assert t in msg


def test_padding_mask_is_respected():
    """Logits of real tokens do not depend on right padding."""
    model = convert(tiny_model("tiny-qwen3-moe", num_hidden_layers=2)).eval()
    ids = torch.randint(3, 512, (1, 10))
    padded = torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 6)], dim=1).long()
    with torch.no_grad():
        a = model(ids).logits
        b = model(padded, attention_mask=mask).logits[:, :10]
    assert torch.allclose(a, b, atol=1e-5)


def test_causality():
    model = convert(tiny_model("tiny-mixtral", num_hidden_layers=2)).eval()
    ids = torch.randint(3, 512, (1, 12))
    changed = ids.clone()
    changed[0, 8:] = 7
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-5)
    assert not torch.allclose(a[:, 8:], b[:, 8:], atol=1e-3)


def test_zero_init_is_exactly_the_layerless_model():
    hf = tiny_model("tiny-olmoe", num_hidden_layers=2)
    ids = torch.randint(3, 512, (2, 8))
    with torch.no_grad():
        expected = hf.lm_head(hf.model.norm(hf.model.embed_tokens(ids)))
    model = convert(hf, adapter_init="zero").eval()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, expected, atol=1e-5)


@pytest.mark.parametrize("init", ["coordinate", "zero"])  # (random: building the skips draws numbers first)
def test_skip_adapters_start_at_zero_and_are_adapters(init):
    """With `adapter_skip` every block gains two d/2 x d/2 skips, counted as adapters (stage 1 trains them),
    at 0 for every init: the model computes exactly what the four-adapter one does."""
    ids = torch.randint(3, 512, (2, 8))
    torch.manual_seed(0)
    plain = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2), adapter_init=init).eval()
    torch.manual_seed(0)
    skip = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2), adapter_init=init, adapter_skip=True).eval()
    h = plain.config.hidden_size // 2
    assert all(b.p_skip_attn is None and b.p_skip_moe is None for b in plain.blocks)
    for b in skip.blocks:
        assert b.p_skip_attn.weight.shape == b.p_skip_moe.weight.shape == (h, h)
        assert b.p_skip_attn.weight.count_nonzero() == b.p_skip_moe.weight.count_nonzero() == 0
    n_plain, n_skip = (sum(p.numel() for p in m.adapter_parameters()) for m in (plain, skip))
    assert n_skip - n_plain == 2 * h * h * len(skip.blocks)
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, skip(ids).logits)


def test_coordinate_init_keeps_what_the_pretrained_layers_know():
    """On the shipped pretrained base: `coordinate` must beat `zero` (the layerless model: embedding ->
    final norm -> head), so the converted layers still contribute, and `random` (noise, about the
    uniform ln V). On random weights every init scores about ln V, so this needs trained weights."""
    from revffn.conversion.causal_lm import CausalLM
    from revffn.data.tokenizer import load_tokenizer
    from revffn.models.loading import load_hf, resolve_model_ref
    from revffn.training.evaluate import retention_loss

    tok = load_tokenizer(resolve_model_ref("builtin:base"))
    loss = {"base": retention_loss(CausalLM(load_hf("builtin:base")).eval(), tok, limit=16)}
    for init in ("coordinate", "zero", "random"):
        torch.manual_seed(0)
        loss[init] = retention_loss(convert(load_hf("builtin:base"), adapter_init=init).eval(), tok, limit=16)
    print(loss)  # measured: base 2.22, coordinate 4.80, zero 5.98, random 7.72; ln(2048) = 7.62
    assert loss["base"] < loss["coordinate"]  # conversion loses information: half of each stream is masked
    assert loss["coordinate"] < loss["zero"] - 0.5
    assert loss["coordinate"] < loss["random"] - 2.0
    assert loss["random"] > 0.9 * math.log(len(tok))  # noise: no better than guessing uniformly


def test_full_width_streams_carry_the_whole_residual():
    """`stream_width="full"`: both streams start as the embedding output, d wide; there is no P_up; with
    `coordinate` (P_down = I, skips 0) layer 0's Y_1 is the pretrained post-attention state h_0 + Attn(h_0)
    exactly, and the head reads Y_2. An unknown width is refused naming the key."""
    from revffn.conversion.teacher import teacher_context

    torch.manual_seed(0)
    model = convert(tiny_model("tiny-mixtral", num_hidden_layers=2), adapter_skip=True, stream_width="full").eval()
    d = model.config.hidden_size
    block = model.blocks[0]
    assert block.p_up_attn is None and block.p_up_moe is None
    assert [tuple(m.weight.shape) for m in block.adapters()] == [(d, d)] * 4
    ids = torch.randint(3, 500, (2, 12))
    h, position_ids, sctx = teacher_context(model, ids)
    attn = getattr(block.base_layer, model.spec.attn)
    seen = {}
    handle = attn.register_forward_hook(lambda m, a, out: seen.__setitem__("attn", out[0]))
    with torch.no_grad():
        block.base_layer(h, attention_mask=sctx.masks[block.mask_key], position_ids=position_ids,
                         position_embeddings=sctx.position_embeddings)
        handle.remove()
        X_1, X_2 = model.split(h)
        assert X_1.shape[-1] == X_2.shape[-1] == d
        Y_1, Y_2 = block(X_1, X_2, sctx)
    assert torch.allclose(Y_1, h + seen["attn"], atol=1e-6)
    assert torch.equal(model.merge(Y_1, Y_2), Y_2)
    with pytest.raises(UserError, match="stream_width"):
        convert(tiny_model("tiny-mixtral", num_hidden_layers=1), stream_width="third")


def test_module_hooks_fire_in_both_paths():
    """Sub-modules are called through module(...): hooks see forward and the recomputation."""
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2)).train()
    calls = {"attn": 0, "mlp": 0, "p_up": 0}
    model.blocks[0].base_layer.self_attn.register_forward_hook(lambda *a: calls.__setitem__("attn", calls["attn"] + 1))
    model.blocks[0].base_layer.mlp.register_forward_hook(lambda *a: calls.__setitem__("mlp", calls["mlp"] + 1))
    model.blocks[0].p_up_attn.register_forward_hook(lambda *a: calls.__setitem__("p_up", calls["p_up"] + 1))
    ids = torch.randint(3, 512, (1, 8))
    model.reversible = False
    model(ids, labels=ids).loss.backward()
    assert calls == {"attn": 1, "mlp": 1, "p_up": 1}
    model.reversible = True
    model(ids, labels=ids).loss.backward()
    assert calls == {"attn": 3, "mlp": 3, "p_up": 3}  # forward + backward recomputation


def test_eval_and_no_grad_use_the_plain_path():
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=2))
    ids = torch.randint(3, 512, (1, 8))
    model.eval()
    out = model(ids, labels=ids)
    assert out.loss.grad_fn is not None
    assert "RevStack" not in _graph_names(out.loss.grad_fn)
    model.train()
    out = model(ids, labels=ids)
    assert "RevStackFunctionBackward" in _graph_names(out.loss.grad_fn)


def _graph_names(fn, seen=None):
    seen = set() if seen is None else seen
    if fn is None or fn in seen:
        return set()
    seen.add(fn)
    names = {type(fn).__name__}
    for nxt, _ in fn.next_functions:
        names |= _graph_names(nxt, seen)
    return names


def test_local_directory_loads_with_from_pretrained(tmp_path):
    hf = tiny_model("tiny-olmoe", num_hidden_layers=2)
    hf.save_pretrained(tmp_path)
    from revffn.models.loading import load_hf

    again = load_hf(str(tmp_path))
    for (n, a), (_, b) in zip(hf.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    assert revffn.convert(again) is not None


def test_bad_model_refs(tmp_path):
    from revffn.models.loading import load_hf

    with pytest.raises(UserError, match="config.json"):
        load_hf(str(tmp_path))
    with pytest.raises(UserError, match="tiny-qwen2-moe"):
        load_hf("tiny-qwen2-mo")
    with pytest.raises(UserError, match="neither a local directory nor a Hugging Face Hub ID"):
        load_hf(str(tmp_path / "no" / "such"))  # Hub IDs: tests/models/test_hub.py

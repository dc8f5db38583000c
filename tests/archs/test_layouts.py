"""Layer layouts beyond norm / attention / norm / MLP: every spec field converts exactly and faithfully,
and every layout that does not fit is refused with a message naming the piece.

Exact: the reversible gradients equal the plain twin's. Faithful: the HF layer equals what its spec
says it computes at full width (`layout_gaps`: layer, embedding and logits gaps all 0), so the
converted model leaves nothing of the HF one out. Tiny models from `tiny_any` (every dropout /
jitter key on, granite multipliers off their neutral 1.0).
"""

import dataclasses

import pytest
import torch
from torch import nn

from revffn import convert
from revffn.archs.architectures import spec_for
from revffn.archs.layout import check_convertible, unused_pieces
from revffn.conversion.causal_lm import CausalLM
from revffn.errors import UserError
from revffn.models.tiny_any import tiny_model_for
from revffn.reports.archs import compare, layout_gaps
from revffn.reports.check import make_batch
from tests.conftest import needs_model_types

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def _exact_and_faithful(hf, padded: bool = True, tol: float = TOL) -> dict:
    """Assert the converted `hf` trains exactly (reversible == plain) and its spec leaves nothing out."""
    ids, mask, labels = make_batch(hf.config.vocab_size, 2, 16, 0)
    if not padded:
        mask, labels = torch.ones_like(mask), ids.clone()
    gaps = layout_gaps(hf, spec_for(hf), ids, mask)
    assert all(g is not None and g <= 1e-4 for g in gaps.values()), gaps
    model = convert(hf)
    err, worst, loss_diff = compare(model, ids, mask, labels)
    assert err <= tol and loss_diff <= TOL, (err, worst, loss_diff)
    return {"model": model, **gaps}


def _refusal(hf) -> str:
    with pytest.raises(UserError) as e:
        convert(hf)
    return str(e.value)


# -- spec fields, each exact and faithful ---------------------------------------------------------------
@needs_model_types("kolibri1")
def test_post_norms_kolibri1():
    """attn_post_norm / mlp_post_norm: applied to each sub-block's output, before P_down."""
    hf = tiny_model_for("kolibri1")
    assert spec_for(hf).attn_post_norm == "post_self_attn_layernorm"
    # post-normed branches are ~50x the tiny model's 0.02-scale embeddings: fp32 rebuilding rounds to
    # ~4e-5 (see reports.archs ROUNDING_TOL); fp64 streams are exact
    _exact_and_faithful(hf, tol=1e-4)
    hf = tiny_model_for("kolibri1")
    ids, mask, labels = make_batch(hf.config.vocab_size, 2, 16, 0)
    assert compare(convert(hf, stream_dtype=torch.float64), ids, mask, labels)[0] <= TOL


def test_sandwich_norms_and_own_moe_pre_norm_afmoe():
    """afmoe: post_attention_layernorm is the attention's post-norm; the MoE has pre_mlp_layernorm."""
    spec = spec_for(tiny_model_for("afmoe"))
    assert (spec.attn_post_norm, spec.mlp_norm, spec.mlp_post_norm) == (
        "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm")
    _exact_and_faithful(tiny_model_for("afmoe"), tol=1e-4)


def test_post_norm_only_flex_olmo():
    """attn_norm = mlp_norm = None: no pre-norms, post-norms only."""
    _exact_and_faithful(tiny_model_for("flex_olmo"))


@pytest.mark.parametrize("model_type", ["granitemoe", "granitemoe_swa"])
def test_granite_multipliers_and_renamed_moe(model_type):
    """block_sparse_moe as the MoE; residual_multiplier scales both branches, embedding_multiplier the
    embeddings, logits_scaling divides the logits (each set off 1.0 by tiny_any)."""
    hf = tiny_model_for(model_type)
    c = hf.config
    assert (c.residual_multiplier, c.embedding_multiplier, c.logits_scaling) != (1.0, 1.0, 1.0)
    model = _exact_and_faithful(hf)["model"]
    assert model.embed_scale == c.embedding_multiplier and model.logits_scale == 1 / c.logits_scaling
    assert {b.branch_scale for b in model.blocks} == {c.residual_multiplier}


def test_baseline_wrapper_applies_the_logit_scale():
    """The baselines' wrapper (`CausalLM`) scales the logits as HF does (the backbone does the rest)."""
    hf = tiny_model_for("granitemoe").eval()
    ids = torch.randint(3, hf.config.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.allclose(CausalLM(hf)(ids).logits, hf(ids).logits, atol=1e-6)


def test_shared_mlp_beside_the_moe_granitemoeshared():
    """G = moe + shared_mlp on the same normed input."""
    hf = tiny_model_for("granitemoeshared", shared_intermediate_size=32)
    assert hf.model.layers[0].shared_mlp is not None
    _exact_and_faithful(hf)


def test_renamed_moe_llama4_and_nested_paths_dbrx():
    """llama4_text: feed_forward (returns (B*T, d) and router logits); dbrx: transformer.blocks,
    norm_attn_norm.{norm_1, attn, norm_2}, ffn, MoE keys in ffn_config, resid_pdrop on each branch."""
    model = _exact_and_faithful(tiny_model_for("llama4_text"))["model"]
    assert model.blocks[0].router_tap is not None
    hf = tiny_model_for("dbrx")
    assert hf.config.resid_pdrop > 0
    model = _exact_and_faithful(hf)["model"]
    assert model.num_experts == 4 and model.top_k == hf.config.ffn_config.moe_top_k
    assert {b.branch_dropout for b in model.blocks} == {hf.config.resid_pdrop}


def test_parallel_block_and_logit_scale_cohere2_moe():
    """One input_layernorm feeds attention and MoE in HF (parallel); the logits are scaled."""
    hf = tiny_model_for("cohere2_moe")
    assert spec_for(hf).parallel and hf.config.logit_scale != 1.0
    _exact_and_faithful(hf)


@pytest.mark.parametrize("model_type", ["qwen3_next", "lfm2_moe"])
def test_hybrid_token_mixers(model_type):
    """F is the layer's token mixer, whichever it has (linear attention, short convolution): they return
    a bare (B, T, d) tensor (read whole, not row 0) and take the 2-D padding mask (mask key
    `linear_attention`). Unpadded here: the padded case needs that mask from the model context."""
    hf = tiny_model_for(model_type)
    model = _exact_and_faithful(hf, padded=False)["model"]
    mixers = {b.mixer: b.mask_key for b in model.blocks}
    assert mixers["self_attn"] != "linear_attention" and "linear_attention" in mixers.values()
    assert len(mixers) == 2


def test_hybrid_with_padding_needs_the_2d_mask():
    """With padding, a linear mixer given a 4-D mask would silently ignore the padding (or crash):
    refused, naming the mixer, until the context builds the 2-D mask (then exact)."""
    hf = tiny_model_for("qwen3_next")
    ids, mask, labels = make_batch(hf.config.vocab_size, 2, 16, 0)
    model = convert(hf)
    masks = model._context(model.hf.model.embed_tokens(ids), mask, torch.arange(16)[None]).masks
    if masks["linear_attention"] is not None and masks["linear_attention"].ndim == 2:
        assert compare(model, ids, mask, labels)[0] <= TOL
    else:
        with pytest.raises(UserError, match="`linear_attn` needs the 2-D padding mask"):
            compare(model, ids, mask, labels)


@pytest.mark.parametrize(("model_type", "dense", "overrides"), [
    ("deepseek_v3", "DeepseekV3MLP", {}),  # first_k_dense_replace = 1
    ("qwen2_moe", "Qwen2MoeMLP", {"mlp_only_layers": [0]}),
])
def test_dense_and_moe_layers_mixed(model_type, dense, overrides):
    """Dense-FFN layers mixed with MoE layers: G is the dense MLP in dense layers, the MoE elsewhere."""
    hf = tiny_model_for(model_type, **overrides)
    kinds = [type(layer.mlp).__name__ for layer in hf.model.layers]
    assert kinds[0] == dense and any(k != dense for k in kinds[1:]), kinds
    model = _exact_and_faithful(hf)["model"]
    called = []
    model.blocks[0].base_layer.mlp.register_forward_hook(lambda *a: called.append(True))
    model.blocks[0].G(torch.randn(1, 4, hf.config.hidden_size // 2), model._context(
        torch.zeros(1, 4, hf.config.hidden_size), None, torch.arange(4)[None]))
    assert called
    assert model.blocks[0].router_tap is None and model.blocks[1].router_tap is not None


# -- refusals: each class names the piece ---------------------------------------------------------------
def test_refuses_learnable_residual_weights_doge():
    msg = _refusal(tiny_model_for("doge"))
    assert "model_type='doge'" in msg and "`input_residual`, `post_attention_residual`" in msg
    assert "learnable residual weights" in msg and "Fix:" in msg


@needs_model_types("beam")
def test_refuses_unused_norms_and_modules():
    hf = tiny_model_for("qwen2_moe")
    for layer in hf.model.layers:  # a sandwich norm the qwen2_moe spec does not name
        layer.post_feedforward_layernorm = torch.nn.LayerNorm(hf.config.hidden_size)
    msg = _refusal(hf)
    assert "have `post_feedforward_layernorm` that RevFFN's layout does not use" in msg
    msg = _refusal(tiny_model_for("beam"))  # an extra layer input is named first (it is refused for that)
    assert "needs state or inputs a reversible block cannot give it" in msg


def test_refuses_a_piece_the_spec_declares_missing():
    """The same check catches a spec that forgets a piece (here afmoe read as the standard layout)."""
    hf = tiny_model_for("afmoe")
    with pytest.raises(UserError, match="`pre_mlp_layernorm`, `post_mlp_layernorm`"):
        standard = dataclasses.replace(spec_for(hf), attn_post_norm=None, mlp_norm="post_attention_layernorm",
                                       mlp_post_norm=None)
        check_convertible(hf, standard)


def test_refuses_model_level_parameters_outside_the_spec():
    hf = tiny_model_for("mixtral")
    hf.model.embed_gain = nn.Parameter(torch.ones(hf.config.hidden_size))
    assert "parameters outside its decoder layers, embedding, final norm and head: `model.embed_gain`" in _refusal(hf)


def test_refuses_undeclared_model_level_config_keys():
    """A granite model read without its multipliers would silently drop them: each key is named."""
    hf = tiny_model_for("granitemoe")
    bare = dataclasses.replace(spec_for(hf), branch_scale_key=None, embed_scale_key=None, logits_divisor_key=None)
    with pytest.raises(UserError) as e:
        check_convertible(hf, bare)
    for key in ("residual_multiplier", "embedding_multiplier", "logits_scaling"):
        assert f"config `{key}`" in str(e.value)
    hf = tiny_model_for("mixtral", final_logit_softcapping=30.0)
    assert "config `final_logit_softcapping` = 30.0" in _refusal(hf)
    tiny_model_for("mixtral", final_logit_softcapping=None)  # the neutral value converts
    convert(tiny_model_for("mixtral", final_logit_softcapping=None))


def test_refuses_module_lists_longcat_flash():
    msg = _refusal(tiny_model_for("longcat_flash"))
    assert "`self_attn` (ModuleList, 2 sub-layers)" in msg and "not one module each" in msg


def test_refusal_names_what_each_layer_has_instead():
    msg = _refusal(tiny_model_for("nemotron_h"))
    assert ("layers 0, 1, 2, 3 have no `self_attn`, `input_layernorm`, `post_attention_layernorm`, `mlp` "
            "(each has `norm`, `mixer`)") in msg
    msg = _refusal(tiny_model_for("qwen4_exp_text"))
    assert "layer 0 has no `self_attn`, `input_layernorm`, `post_attention_layernorm` (it has `linear_attn`" in msg


def test_refuses_a_marked_architecture_minimax():
    msg = _refusal(tiny_model_for("minimax"))
    assert "add the residual after the norm" in msg and "Fix: fine-tune it with a baseline method" in msg


def test_refuses_a_missing_model_piece():
    hf = tiny_model_for("qwen2_moe")
    del hf.model.norm  # the final norm the spec names
    msg = _refusal(hf)
    assert "no final norm at `model.norm`" in msg


def test_a_model_without_rope_converts_exactly_jamba():
    """NoPE (jamba: no `model.rotary_emb`): its attention layers get position_embeddings=None, as in HF."""
    from revffn.reports.archs import sweep_one

    row = sweep_one("jamba", timeout=120)
    assert row["status"] == "exact", row["reason"]


def test_a_spec_without_a_rotary_path_still_names_what_is_unused():
    """A spec with no rotary path (NoPE) lists the model-level pieces it leaves unused, not a TypeError
    (transformers 5.17's inkling_text crashed here instead of being refused)."""
    hf = tiny_model_for("mixtral")
    hf.model.embed_gain = nn.Parameter(torch.ones(hf.config.hidden_size))
    spec = dataclasses.replace(spec_for(hf), rotary=None)
    problems = unused_pieces(hf, spec)
    assert len(problems) == 1 and "`model.embed_gain`" in problems[0]

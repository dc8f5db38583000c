"""What the converted model gives each decoder layer besides its stream: position embeddings per
layer type (or none), the mask its layer type takes (the raw 2-D padding mask for linear attention),
and a clear refusal for layers that need state from an earlier layer or another extra input."""

import pytest
import torch

from revffn import convert
from revffn.archs.spec import ArchSpec
from revffn.conversion.convert import RopePlan
from revffn.errors import UserError
from revffn.models.tiny_any import tiny_model_for
from tests.conftest import needs_model_types

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


@pytest.mark.parametrize("model_type,needs", [
    ("zaya", "`prev_router_hidden_states`"),  # the previous layer's router states
    ("hy_v4", "config.indexer_types[2] is 'shared'"),  # DSA top-k reused from an earlier layer
    ("gemma4_text", "`per_layer_input`"),  # an extra per-layer input
])
def test_layers_that_need_more_than_their_stream_are_refused_by_name(model_type, needs):
    with pytest.raises(UserError, match="reversible block cannot give it") as e:
        convert(tiny_model_for(model_type, stochastic=0.0))
    assert needs in str(e.value) and f"model_type={model_type!r}" in str(e.value)


def test_reused_dsa_indices_are_refused_only_where_a_layer_reuses_them():
    """glm_moe_dsa's layers take `prev_topk_indices`, but a 'full' layer runs its own indexer."""
    convert(tiny_model_for("glm_moe_dsa", stochastic=0.0, indexer_types=["full", "full"]))
    with pytest.raises(UserError, match=r"indexer_types\[1\] is 'shared'"):
        convert(tiny_model_for("glm_moe_dsa", stochastic=0.0, indexer_types=["full", "shared"]))


def test_rope_per_layer_type_none_or_a_dict_for_every_layer():
    spec = ArchSpec(model_type="any")  # rotary at model.rotary_emb
    mimo = tiny_model_for("mimo_v2_flash", stochastic=0.0)  # a rope per layer type: each block reads its own
    plan = RopePlan.of(mimo, spec)
    assert plan.per_layer and plan.keys == ("full_attention", "sliding_attention")
    assert RopePlan.of(tiny_model_for("kimi_linear", stochastic=0.0), spec).module is None  # no model-level rope
    v4 = tiny_model_for("deepseek_v4", stochastic=0.0)  # rope keys 'main' / 'compress' are not layer types
    v4_plan = RopePlan.of(v4, spec)
    assert v4_plan.keys == ("main", "compress") and not v4_plan.per_layer
    pe = v4_plan(torch.zeros(1, 4, v4.config.hidden_size), torch.arange(4)[None])
    assert set(pe) == {"main", "compress"} and all(len(v) == 2 for v in pe.values())
    model = convert(mimo)
    assert [b.position_key for b in model.blocks] == list(mimo.config.layer_types)


@needs_model_types("bailing_hybrid")
def test_linear_attention_layers_get_the_2d_padding_mask():
    model = convert(tiny_model_for("bailing_hybrid", stochastic=0.0))
    types = model.config.layer_types
    assert "linear_attention" in types and "full_attention" in types
    embeds = torch.zeros(2, 8, model.config.hidden_size)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    sctx = model._context(embeds, mask, torch.arange(8)[None])
    assert torch.equal(sctx.masks["linear_attention"], mask)  # HF's create_recurrent_attention_mask
    assert sctx.masks["full_attention"].dim() == 4
    assert model._context(embeds, torch.ones_like(mask), torch.arange(8)[None]).masks["linear_attention"] is None


@pytest.mark.parametrize("model_type", [pytest.param(t, marks=needs_model_types(t)) for t in
                                        ("mimo_v2_flash", "bailing_hybrid", "deepseek_v32", "qwen2_moe")])
def test_each_attention_gets_the_position_embeddings_and_mask_hf_gives_it(model_type):
    """Per layer, the token mixer of the converted model receives the same position embeddings and
    attention mask as in the HF model (RoPE per layer type, 2-D mask for linear attention, the
    materialised mask of a DSA indexer), on a padded batch."""
    hf = tiny_model_for(model_type, stochastic=0.0).eval()
    ids = torch.randint(3, 256, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0

    def inputs_per_layer(model, layers, run):
        seen = {}

        def keep(i):
            def hook(module, args, kwargs):
                seen[i] = kwargs.get("position_embeddings"), kwargs.get("attention_mask")
            return hook

        handles = [layer.self_attn.register_forward_pre_hook(keep(i), with_kwargs=True)
                   for i, layer in enumerate(layers)]
        with torch.no_grad():
            run()
        for h in handles:
            h.remove()
        return seen

    want = inputs_per_layer(hf, hf.model.layers, lambda: hf(input_ids=ids, attention_mask=mask, use_cache=False))
    model = convert(hf)
    model.eval()
    got = inputs_per_layer(model, [b.base_layer for b in model.blocks], lambda: model(ids, attention_mask=mask))
    assert want.keys() == got.keys()
    for i in want:
        for w, g in zip(want[i], got[i]):
            w_leaves, w_spec = torch.utils._pytree.tree_flatten(w)
            g_leaves, g_spec = torch.utils._pytree.tree_flatten(g)
            assert w_spec == g_spec, (i, w_spec, g_spec)
            assert all(torch.equal(a, b) for a, b in zip(w_leaves, g_leaves)), i


def test_a_multi_axis_rotary_gets_one_row_of_positions_per_axis():
    """An M-RoPE rotary (`mrope_section`, Qwen3.5-MoE's text model) reads (axes, B, T) position ids: the plan
    broadcasts text positions to every axis, as the HF text model does (5.17's rotary takes only that form)."""

    class MRope(torch.nn.Module):
        mrope_section = [2, 1, 1]

        def forward(self, x, position_ids):
            assert position_ids.shape == (3, *x.shape[:2]), position_ids.shape
            return position_ids.float().sum(0), position_ids.float().prod(0)

    plan = RopePlan(MRope(), axes=3)
    model = torch.nn.Module()
    model.rotary = MRope()
    assert RopePlan.of(model, ArchSpec(model_type="any", rotary="rotary")).axes == 3
    cos, sin = plan(torch.zeros(2, 5, 8), torch.arange(5)[None].expand(2, -1))
    positions = torch.arange(5.0).expand(2, -1)
    assert torch.equal(cos, 3 * positions) and torch.equal(sin, positions**3)
    assert RopePlan.of(tiny_model_for("mixtral", stochastic=0.0), ArchSpec(model_type="any")).axes == 0

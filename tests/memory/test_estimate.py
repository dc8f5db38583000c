"""The analytic memory model: parameter counts, scaling with depth, methods, sizes, calibration."""

import copy
import math

import pytest
import torch

from revffn.conversion.convert import convert
from revffn.conversion.loss import causal_lm_loss
from revffn.errors import UserError
from revffn.memory.estimate import count_params, fits, format_estimate, parse_size
from revffn.memory.estimate import estimate as estimate_of
from revffn.memory.measure import SavedTensorLog
from revffn.methods import method_class
from revffn.methods.revffn import RECOMPUTE_CHUNK_TOKENS
from revffn.models.loading import config_presets, hf_config
from revffn.models.presets import tiny_model
from revffn.reports.check import make_batch
from tests.conftest import GENERIC, REQUIRED

GiB = 2**30


def estimate(config, method: str, *args, **options) -> dict:
    """The estimate of a method by name (the estimator takes the method's class). RevFFN's is the additive
    coupling's unless `coupling` is given: the terms these tests calibrate against `convert`'s default blocks."""
    if method == "revffn":
        options.setdefault("coupling", "additive")
    return estimate_of(config, method_class(method), *args, **options)


@pytest.mark.parametrize("name", [*REQUIRED, GENERIC])
def test_param_counts_match_real_tiny_models(name):
    for layers in (2, 3):
        model = tiny_model(name, num_hidden_layers=layers)
        counts = count_params(hf_config(name, num_hidden_layers=layers))
        assert counts["total"] == sum(p.numel() for p in model.parameters())
        adapters = sum(p.numel() for p in convert(copy.deepcopy(model)).adapter_parameters())
        assert counts["adapters_revffn"] == adapters
        with_skip = sum(p.numel() for p in convert(model, adapter_skip=True).adapter_parameters())
        assert counts["adapters_revffn"] + counts["adapters_revffn_skip"] == with_skip


def test_param_counts_dense_layers_and_tied_head():
    for name, kw in [("tiny-qwen2-moe", dict(mlp_only_layers=[1], num_hidden_layers=3)),
                     ("tiny-qwen3-moe", dict(decoder_sparse_step=2, num_hidden_layers=4, tie_word_embeddings=True))]:
        counts = count_params(hf_config(name, **kw))
        assert counts["dense_mlp"] > 0
        assert counts["total"] == sum(p.numel() for p in tiny_model(name, **kw).parameters())


@pytest.mark.parametrize("name,billions", [("qwen1.5-moe-a2.7b", 14.3), ("mixtral-8x7b", 46.7),
                                            ("olmoe-1b-7b", 6.9), ("qwen3-30b-a3b", 30.5)])
def test_public_presets_param_counts(name, billions):
    assert name in config_presets()
    total = count_params(hf_config(name))["total"]
    assert abs(total / 1e9 - billions) <= 0.01 * billions, total


def test_revffn_activations_flat_in_depth_full_grows():
    def acts(method, layers):
        est = estimate(hf_config("qwen1.5-moe-a2.7b", num_hidden_layers=layers), method, 8, 2048, "bfloat16")
        return est["activations"] - est["routing_records"]

    assert acts("revffn", 32) <= 1.05 * acts("revffn", 4)
    assert 7.0 <= acts("full", 32) / acts("full", 4) <= 8.0
    assert acts("ckpt", 32) < acts("full", 32) / 4


def test_the_buffered_coupling_grows_by_its_buffer_alone():
    """The buffered coupling's forward keeps k bits a coordinate a layer: 28 more layers add exactly that, 3/8 of
    what checkpointing's bf16 layer inputs add at 6 bits."""
    def est(layers, bits=6):
        config = hf_config("qwen1.5-moe-a2.7b", num_hidden_layers=layers)
        return estimate(config, "revffn", 8, 2048, "bfloat16", coupling="buffered", buffer_bits=bits)

    n, d = 8 * 2048, hf_config("qwen1.5-moe-a2.7b").hidden_size
    for bits in (4, 6):
        grown = est(32, bits)["activations"] - est(4, bits)["activations"]
        routing = est(32, bits)["routing_records"] - est(4, bits)["routing_records"]
        assert grown - routing == 28 * n * d * bits // 8
    assert est(32)["trainable_params"] == est(32)["total_params"] - count_params(hf_config(
        "qwen1.5-moe-a2.7b", num_hidden_layers=32))["router"]  # no adapters: the model less its routers


def test_revffn_cheaper_than_full_at_scale():
    config = hf_config("qwen1.5-moe-a2.7b")
    for dtype in ("float32", "bfloat16"):
        full, rev = (estimate(config, m, 8, 2048, dtype) for m in ("full", "revffn"))
        assert rev["total"] < full["total"]
        assert rev["total_params"] > full["total_params"]  # + the adapters
        counts = count_params(config)  # stage 2 trains the model less its routers; the adapters stay frozen
        assert rev["trainable_params"] == counts["total"] - counts["router"]
        trained = estimate(config, "revffn", 8, 2048, dtype, train_adapters=True)  # or train with it
        assert trained["trainable_params"] == rev["total_params"] - counts["router"]
        assert trained["total"] > rev["total"]
        records = rev["routing_records"]
        assert records == 24 * 8 * 2048 * 4  # uint8 per token and choice, per MoE layer
        assert full["total"] == sum(full[k] for k in ("weights", "grads", "optimizer_states", "activations",
                                                      "logits", "overhead"))


def test_precision_and_optimizer_bytes():
    config = hf_config("olmoe-1b-7b")
    est = estimate(config, "full", 1, 512, "bfloat16")
    n = est["trainable_params"]
    # torch AdamW keeps exp_avg / exp_avg_sq in the parameter dtype: bf16 params, bf16 states
    assert est["weights"] == 2 * n and est["grads"] == 2 * n and est["optimizer_states"] == 4 * n
    assert estimate(config, "full", 1, 512)["weights"] == 4 * n
    assert estimate(config, "full", 1, 512)["optimizer_states"] == 8 * n
    assert estimate(config, "full", 1, 512, optimizer="sgd")["optimizer_states"] == 0
    assert est["logits"] == 511 * 50304 * 4 * 2
    assert estimate(config, "full", 8, 2048)["logits"] == 1024 * 50304 * 4 * 2
    assert any("5%" in note for note in est["notes"])


@pytest.mark.parametrize("group_size", [1, 2, 5])
def test_hift_states_about_one_over_k(group_size):
    config = hf_config("qwen1.5-moe-a2.7b")
    full = estimate(config, "full", 4, 1024, "bfloat16")
    hift = estimate(config, "hift", 4, 1024, "bfloat16", group_size=group_size)
    k = math.ceil((config.num_hidden_layers + 2) / group_size)
    ratio = hift["optimizer_states"] / full["optimizer_states"]
    assert 0.5 / k <= ratio <= 2.0 / k
    # the active group trains; the frozen layers above it keep only what input gradients need
    assert 0.5 * full["activations"] < hift["activations"] < full["activations"]


def test_peft_methods_train_few_params():
    config = hf_config("mixtral-8x7b")
    full = estimate(config, "full", 1, 2048, "bfloat16")
    for method in ("lora", "dora", "refta"):
        est = estimate(config, method, 1, 2048, "bfloat16")
        assert est["trainable_params"] < 0.05 * full["trainable_params"]
        assert est["total"] < full["total"]
        # lora adapts the fused experts through peft's ParamWrapper, whose W + BA is kept per layer;
        # refta keeps only what the frozen model's input gradients need, plus its adapters' outputs
        if method != "dora":  # (dora: fp32 adapters on bf16 keep fp32 input copies; about full's)
            assert (est["activations"] > full["activations"]) == (method == "lora")
    lora8, lora32 = (estimate(config, "lora", 1, 2048, r=r)["trainable_params"] for r in (8, 32))
    assert lora32 == 4 * lora8
    # peft's DoRA adapts only Linear modules (attention here), LoRA also every expert
    dora, lora = (estimate(config, m, 1, 2048)["trainable_params"] for m in ("dora", "lora"))
    assert 0 < dora < lora


def test_eager_attention_keeps_probabilities():
    config = hf_config("qwen3-30b-a3b")
    sdpa = estimate(config, "full", 1, 4096, "bfloat16")["activations"]
    eager = estimate(config, "full", 1, 4096, "bfloat16", attn_implementation="eager")["activations"]
    assert eager - sdpa >= 48 * 32 * 4096 * 4096 * 4


def test_parse_size_and_fits():
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("80gib") == 80 * GiB
    assert parse_size(" 512 MiB ") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("24000mb") == 24 * 10**9
    for bad in ("80", "lots", "80 GX", "", "GB"):
        with pytest.raises(UserError, match="--gpu-mem"):
            parse_size(bad)
    with pytest.raises(UserError, match="G alone is ambiguous. Fix: 80GB .* or 80GiB"):
        parse_size("80G")
    with pytest.raises(UserError, match="no memory to fit in"):
        parse_size("0GB")  # (it was accepted: nothing fits)
    assert fits(79 * 10**9, "80GB") and not fits(81 * 10**9, "80GB")


@pytest.mark.parametrize("freeze_router", [True, False])
def test_revffn_recompute_chunks_shrink_the_moe_working_set(freeze_router):
    """recompute_chunk_tokens scales the MoE branch's part of the working set (with its adapters'
    inputs and, on a trainable router, the load-balancing surrogate) by chunk / N; attention's part
    stays. qwen1.5 at 32K tokens: chunks of 4096 keep 1/8 of the MoE branch's part."""
    config, N = hf_config("qwen1.5-moe-a2.7b"), 32768

    def working(chunk: int) -> int:
        return estimate(config, "revffn", 1, N, "bfloat16", recompute_chunk_tokens=chunk,
                        freeze_router=freeze_router)["recompute_working_set"]

    whole, chunked, one = working(0), working(4096), working(1)  # one: attention's part (+ 1/N of the MoE's)
    print(f"working set {whole / GiB:.2f} GiB whole, {chunked / GiB:.2f} GiB by 4096, {one / GiB:.2f} GiB by 1")
    assert one < chunked < 0.6 * whole
    assert whole - chunked == pytest.approx(7 * (chunked - one), rel=1e-3)  # linear in the chunk
    assert working(N) == working(10**6) == whole  # a chunk of every token is the whole recomputation
    est_whole = estimate(config, "revffn", 1, N, "bfloat16", freeze_router=freeze_router, recompute_chunk_tokens=0)
    est_chunked = estimate(config, "revffn", 1, N, "bfloat16", freeze_router=freeze_router, recompute_chunk_tokens=4096)
    est_default = estimate(config, "revffn", 1, N, "bfloat16", freeze_router=freeze_router)
    assert est_default["recompute_working_set"] == working(RECOMPUTE_CHUNK_TOKENS) < chunked
    assert est_whole["recompute_working_set"] == whole and est_chunked["recompute_working_set"] == chunked
    assert est_whole["total"] - est_chunked["total"] == pytest.approx((whole - chunked) * 1.05, rel=1e-6)
    assert any("chunks of 4096 tokens" in n for n in est_chunked["notes"])
    with pytest.raises(UserError, match="recompute_chunk_tokens"):
        estimate(config, "revffn", 1, N, recompute_chunk_tokens=-1)


def test_revffn_recompute_chunks_shrink_the_attention_working_set_by_whole_sequences():
    """With several sequences, attention's part shrinks too, by whole sequences: batch 8 x 2048 in chunks
    of 4096 tokens recomputes attention 2 sequences at a time (1/4 of its part); chunks below one
    sequence keep one sequence (1/8), never less."""
    config = hf_config("qwen1.5-moe-a2.7b")

    def working(batch: int, seq: int, chunk: int) -> int:
        return estimate(config, "revffn", batch, seq, "bfloat16", recompute_chunk_tokens=chunk)["recompute_working_set"]

    one_seq = working(1, 2048, 0)  # one sequence, whole: attention's and the MoE's parts of 2048 tokens
    eight, by_two = working(8, 2048, 0), working(8, 2048, 4096)
    assert eight == pytest.approx(8 * one_seq, rel=1e-3)
    assert by_two == pytest.approx(2 * one_seq, rel=1e-3)  # both parts: 4096 tokens, 2 whole sequences
    attn_one_seq = working(8, 2048, 1)  # attention one sequence at a time, the MoE one token: ~1/8 of the whole
    assert attn_one_seq < by_two / 2 and working(8, 2048, 1024) > attn_one_seq
    notes = estimate(config, "revffn", 8, 2048, "bfloat16", recompute_chunk_tokens=4096)["notes"]
    assert any("its attention's by chunks of 2 sequences" in n for n in notes)
    fsdp = estimate(config, "revffn", 8, 2048, "bfloat16", world_size=2, distributed="fsdp")  # training: whole
    assert fsdp["recompute_working_set"] == eight
    assert any("recomputes each branch whole" in n for n in fsdp["notes"])


def test_unknown_preset_method_and_option():
    with pytest.raises(UserError) as err:
        hf_config("qwen1.5-moe")
    assert "qwen1.5-moe-a2.7b" in str(err.value) and "tiny-qwen2-moe" in str(err.value)
    config = hf_config("tiny-olmoe")
    with pytest.raises(UserError, match="method"):
        estimate(config, "fulll", 1, 8)
    with pytest.raises(UserError, match="rank"):
        estimate(config, "full", 1, 8, rank=4)
    with pytest.raises(UserError, match="dtype"):
        estimate(config, "full", 1, 8, dtype="float8")


def test_stage_1_of_the_buffered_coupling_is_refused():
    """It was ignored, and the estimate (113.5 GiB on Qwen1.5-MoE-A2.7B, batch 8 x 128) read as a heal step's."""
    config = hf_config("qwen1.5-moe-a2.7b")
    with pytest.raises(UserError, match="--option stage=1: the buffered coupling .* Fix: drop stage=1, or add "
                                        "--option coupling=additive"):
        estimate(config, "revffn", 8, 128, "bfloat16", stage=1, coupling="buffered")
    heal = estimate(config, "revffn", 8, 128, "bfloat16", stage=1, coupling="additive")
    joint = estimate(config, "revffn", 8, 128, "bfloat16", stage=2, coupling="additive")
    assert heal["trainable_params"] < joint["trainable_params"] / 10 and heal["total"] < joint["total"] / 2


def test_load_config_from_directory(tmp_path):
    hf_config("tiny-mixtral", num_hidden_layers=3).save_pretrained(tmp_path)
    config = hf_config(str(tmp_path))
    assert config.model_type == "mixtral" and config.num_hidden_layers == 3
    assert count_params(config)["total"] == count_params(hf_config("tiny-mixtral", num_hidden_layers=3))["total"]


def test_format_estimate():
    est = estimate(hf_config("qwen1.5-moe-a2.7b"), "revffn", 8, 2048, "bfloat16")
    text = format_estimate(est, "80GB")
    assert "fits on this GPU (80GB): no" in text and "incl. routing records" in text and "GiB" in text
    small = estimate(hf_config("tiny-qwen2-moe"), "full", 2, 64)
    assert "fits on this GPU (80GB): yes" in format_estimate(small, "80GB")
    assert "fits" not in format_estimate(small, None)


# -- calibration against SavedTensorLog on the tiny presets --------------------------------------
B, T = 2, 64


def _measured_full(name: str, layers: int) -> int:
    hf = tiny_model(name, num_hidden_layers=layers)
    hf.train()
    ids, mask, labels = make_batch(hf.config.vocab_size, B, T, 0)
    log = SavedTensorLog(hf.parameters())
    with log.hooks():
        causal_lm_loss(hf.model(input_ids=ids, attention_mask=mask).last_hidden_state, hf.lm_head, labels)
    return log.bytes()


def _measured_revffn(name: str, layers: int, reversible: bool = True) -> int:
    model = convert(tiny_model(name, num_hidden_layers=layers))
    model.train()
    model.reversible = reversible
    ids, mask, labels = make_batch(model.config.vocab_size, B, T, 0)
    log = SavedTensorLog(model.parameters())
    with log.hooks():
        model(ids, attention_mask=mask, labels=labels, return_logits=False)
    return log.bytes()


@pytest.mark.parametrize("name", REQUIRED)
def test_calibration_against_saved_tensor_log(name):
    config = hf_config(name, num_hidden_layers=1)
    full = estimate(config, "full", B, T)["activations"]
    assert full == pytest.approx(_measured_full(name, 1), rel=0.15)
    rev = estimate(config, "revffn", B, T, freeze_router=False)  # the measured model's router is trainable
    assert rev["activations_forward"] == pytest.approx(_measured_revffn(name, 1), rel=0.15)
    # one layer's working set = what one more layer adds to the plain-autograd twin
    layer = _measured_revffn(name, 2, reversible=False) - _measured_revffn(name, 1, reversible=False)
    assert rev["recompute_working_set"] == pytest.approx(layer, rel=0.15)
    assert torch.get_default_dtype() == torch.float32


def test_a_config_without_the_usual_fields_is_an_error_naming_it(tmp_path):
    """dbrx keeps its MLP sizes in `ffn_config`: the estimate raised AttributeError (a traceback from `revffn
    estimate`). It is a UserError naming the type and the field; `revffn check`'s memory floor then counts the
    models alone."""
    from revffn.models.tiny_any import tiny_model_for
    from revffn.reports.check import check_bytes

    hf = tiny_model_for("dbrx")
    with pytest.raises(UserError, match="dbrx: the memory estimate .* has no 'intermediate_size'. Fix: measure it"):
        estimate_of(hf.config, method_class("full"), 2, 32)
    hf.save_pretrained(tmp_path / "dbrx")  # the check's floor: the models alone, counted on the meta device
    assert check_bytes(str(tmp_path / "dbrx"), None, None, "float32", 2, 32) == (
        8 * sum(p.numel() for p in hf.parameters()), 0)
    gpt_neo = tiny_model_for("gpt_neo")  # intermediate_size None: a TypeError, a traceback from revffn check too
    with pytest.raises(UserError, match=r"gpt_neo: .* not all numbers: moe_inter=None, dense_inter=None\. Fix"):
        estimate_of(gpt_neo.config, method_class("full"), 2, 32)
    gpt_neo.save_pretrained(tmp_path / "gpt_neo")
    from revffn.cli import main

    assert main(["check", "--model", str(tmp_path / "gpt_neo")]) == 2  # convert's own refusal, as before
    assert check_bytes("tiny-qwen2-moe", None, None, "float32", 2, 32)[0] == 8 * count_params(
        hf_config("tiny-qwen2-moe"))["total"]  # the fp32 model and its fp32 converted copy


def test_a_layout_the_estimate_does_not_model_is_refused_by_its_parameter_count():
    """The estimate returned bytes for any config, its own layout counted: 1.79x Jamba's parameters (its Mamba
    layers counted as attention). It now counts against the model transformers builds on the meta device."""
    import transformers

    from revffn.memory.estimate import check_layout

    with pytest.raises(UserError, match=r"jamba: the model has 51,570,323,328 parameters, and the memory estimate's "
                                        r"layout of its config counts 92,075,724,800 \(1.79x\).*Fix: measure it"):
        estimate_of(transformers.JambaConfig(), method_class("revffn"), 1, 512)
    check_layout(transformers.DeepseekV3Config())  # 1.004x at full size: the experts dominate
    for name in [*REQUIRED, GENERIC, *config_presets()]:  # what the estimate is checked on, and the Hub presets
        check_layout(hf_config(name))

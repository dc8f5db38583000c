"""Per-GPU memory under data parallelism: ddp's gradient buckets, fsdp's shards and unsharded buffers,
the fewest GPUs fsdp fits on, and the setups training refuses."""

import pytest

from revffn.errors import UserError
from revffn.memory.estimate import FSDP_OPTIMIZERS, configurations, count_params, dims, fits, gpus_needed, unit_params
from revffn.memory.estimate import estimate as estimate_of
from revffn.methods import method_class
from revffn.models.loading import hf_config

STATIC = ("weights", "grads", "optimizer_states")
BUFFERS = ("grad_buckets", "gathered_params", "unsharded_grads")
PARTS = (*STATIC, *BUFFERS, "activations", "logits", "overhead")


def estimate(config, method: str, *args, **options) -> dict:
    return estimate_of(config, method_class(method), *args, **options)


@pytest.mark.parametrize("method,options", [("full", {}), ("revffn", {}), ("lora", {}),
                                            ("revffn", {"optimizer": "adafactor"})])
def test_fsdp_shards_the_static_terms_and_keeps_the_activations(method, options):
    config = hf_config("qwen3-30b-a3b")
    whole = {"recompute_chunk_tokens": 0} if method == "revffn" else {}  # FSDP2 training recomputes each branch whole
    one = estimate(config, method, 2, 1024, "bfloat16", **options, **whole)
    fsdp = {n: estimate(config, method, 2, 1024, "bfloat16", world_size=n, distributed="fsdp", **options)
            for n in (1, 2, 3)}
    for n, est in fsdp.items():
        assert all(est[k] == -(-one[k] // n) for k in STATIC), n  # 1/n, rounded up
        assert all(est[k] == one[k] for k in ("activations", "logits", "recompute_working_set", "routing_records"))
        assert est["gathered_params"] == fsdp[1]["gathered_params"] > 0 and est["grad_buckets"] == 0
        assert est["total"] == sum(est[k] for k in PARTS)
        assert (est["world_size"], est["distributed"]) == (n, "fsdp")
    assert fsdp[1]["total"] > one["total"] > fsdp[2]["total"] > fsdp[3]["total"]
    assert (one["world_size"], one["distributed"]) == (1, "none") and not any(one[k] for k in BUFFERS)


def test_fsdp_buffers_are_the_root_and_two_layers():
    """Full fine-tuning (every param trains, bf16): the root (embedding, final norm, head) and two decoder
    layers gathered, the root's and one layer's gradients unsharded."""
    config = hf_config("mixtral-8x7b")
    units = unit_params(dims(config), count_params(config))
    root, layer = units[0] + units[-1], max(units[1:-1])
    est = estimate(config, "full", 1, 2048, "bfloat16", world_size=8, distributed="fsdp")
    assert est["gathered_params"] == 2 * (root + 2 * layer)
    assert est["unsharded_grads"] == 2 * (root + layer)
    assert "fsdp over 8 GPU(s)" in " ".join(est["notes"])


def test_ddp_adds_one_copy_of_the_trainable_gradients():
    config = hf_config("olmoe-1b-7b")
    for method in ("full", "revffn", "lora"):
        one = estimate(config, method, 2, 512, "bfloat16")
        for n in (1, 4):
            ddp = estimate(config, method, 2, 512, "bfloat16", world_size=n, distributed="ddp")
            assert ddp["grad_buckets"] == one["grads"] > 0  # every rank holds everything, plus the buckets
            assert all(ddp[k] == one[k] for k in (*STATIC, "activations", "logits"))
            assert ddp["total"] == sum(ddp[k] for k in PARTS)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_gpus_needed_is_the_fewest_that_fit(name, optimizer):
    config, method = hf_config(name), method_class("revffn")
    n = gpus_needed(config, method, 1, 2048, "bfloat16", "80GB", optimizer=optimizer)

    def total(world: int) -> int:
        return estimate_of(config, method, 1, 2048, "bfloat16", optimizer=optimizer, world_size=world,
                           distributed="fsdp")["total"]

    assert n is not None and n >= 2  # none of these fits on one 80GB GPU
    assert fits(total(n), "80GB") and not fits(total(n - 1), "80GB")


def test_gpus_needed_none_when_the_unsharded_part_alone_is_too_big():
    config, method = hf_config("qwen3-30b-a3b"), method_class("full")
    assert gpus_needed(config, method, 8, 8192, "bfloat16", "80GB") is None  # full's activations: > 80GB
    assert gpus_needed(config, method, 1, 512, "bfloat16", "80GB") is not None


def test_configurations_under_fsdp_list_the_gpus_each_needs():
    config, method = hf_config("mixtral-8x7b"), method_class("revffn")
    rows = configurations(config, method, 1, 2048, "bfloat16", "80GB", world_size=8, distributed="fsdp")
    assert len(rows) == len(FSDP_OPTIMIZERS)  # refused under fsdp: the in-backward step, offload, torchao
    assert not any(r["optimizer_in_backward"] or r["offload"] != "none" for r in rows)
    for r in rows[:3]:
        assert r["gpus"] == gpus_needed(config, method, 1, 2048, "bfloat16", "80GB", optimizer=r["optimizer"],
                                        offload=r["offload"])
    assert "gpus" not in configurations(config, method, 1, 2048, "bfloat16", "80GB")[0]


@pytest.mark.parametrize("kwargs,words", [
    ({"world_size": 0}, ["--world-size 0", "Fix"]),
    ({"world_size": 2}, ["--distributed none", "Fix: --distributed fsdp"]),
    ({"distributed": "zero"}, ["--distributed 'zero'", "Fix"]),
    ({"distributed": "ddp", "optimizer_in_backward": True}, ["optimizer_in_backward", "before ddp", "Fix"]),
    ({"distributed": "fsdp", "optimizer_in_backward": True}, ["optimizer_in_backward", "before fsdp", "Fix"]),
    ({"distributed": "fsdp", "offload": "cpu"}, ["offload=cpu", "before fsdp", "Fix"]),
    ({"distributed": "fsdp", "optimizer": "adamw8bit"}, ["optimizer=adamw8bit under fsdp", "Fix"]),
])
def test_refuses_what_training_refuses(kwargs, words):
    with pytest.raises(UserError) as err:
        estimate(hf_config("tiny-qwen2-moe"), "full", 1, 8, **kwargs)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_refuses_hift_data_parallel():
    with pytest.raises(UserError, match="method 'hift'.*Fix: --distributed none"):
        estimate(hf_config("tiny-qwen2-moe"), "hift", 1, 8, distributed="ddp", world_size=2)

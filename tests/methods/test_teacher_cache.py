"""The cached distillation teacher (`revffn.distill_teacher: cached`): a run distilling from the cache trains exactly
as one distilling from the frozen copy, holds no copy of the weights, reuses its cache on resume and refuses a cache
computed on other data (exit 2, naming the key, nothing written)."""

from __future__ import annotations

import json

import pytest
import torch

from revffn.cli import main
from revffn.errors import UserError
from revffn.methods import method_class
from revffn.training import loop
from revffn.training.config import load_config
from tests.methods._util import metrics

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 2, hidden_size: 64}", "method=revffn",
        "dtype=float32", "device=cpu", "revffn.coupling=additive", "revffn.adapter_init=coordinate",
        "revffn.adapter_warmup_steps=0",
        "revffn.distill_coef=0.5", "data=builtin:reversal_train", "eval_data=null",
        "max_seq_length=32", "per_device_train_batch_size=4", "max_steps=4", "logging_steps=1", "save_steps=0",
        "learning_rate=1e-3", "warmup_steps=0",
        "adam_epsilon=1e-6"]  # AdamW's eps 1e-8 would amplify rounding in near-zero gradients past 1e-6


def _train(out, *over: str):
    loop.run(load_config(None, [*TINY, *over, f"output_dir={out}"]))
    return [(r["stage"], r["loss"]) for r in metrics(out)]


def _final(out) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted((out / "final").glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def copy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("copy") / "run"
    return out, _train(out)


def test_cached_teacher_trains_as_the_frozen_copy(tmp_path, copy_run):
    copy_out, copy_losses = copy_run
    losses = _train(tmp_path / "cached", "revffn.distill_teacher=cached")
    assert [s for s, _ in losses] == ["joint"] * 4
    diffs = [abs(a - b) for (_, a), (_, b) in zip(losses, copy_losses)]
    assert max(diffs) <= 1e-6, diffs
    cached, copied = _final(tmp_path / "cached"), _final(copy_out)
    assert cached.keys() == copied.keys()
    assert max((cached[k] - copied[k]).abs().max().item() for k in cached) <= 1e-6
    manifest = json.loads((tmp_path / "cached" / "teacher_cache" / "manifest.json").read_text())
    # every example of the tokenized set, once: reversal_train at max_seq_length 32
    assert manifest["examples"] > 100 and manifest["d"] == 64 and manifest["world"] == 1
    # the distill term mattered: without it the same run trains differently
    _train(tmp_path / "plain", "revffn.distill_coef=0")
    plain = _final(tmp_path / "plain")
    assert max((plain[k] - copied[k]).abs().max().item() for k in plain) > 1e-4


def test_cached_teacher_holds_no_weight_copy_and_is_reused(tmp_path):
    cfg = load_config(None, [*TINY, "revffn.distill_teacher=cached", f"output_dir={tmp_path / 'run'}"])
    from revffn.training.step import build_run

    run = build_run(cfg, torch.device("cpu"))
    assert run.method.teacher is None  # the copy route's deepcopy is not made
    _train(tmp_path / "run", "revffn.distill_teacher=cached", "save_steps=3", "overwrite=true")
    cache = tmp_path / "run" / "teacher_cache"
    stamp = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    ref = [r["loss"] for r in metrics(tmp_path / "run")]
    _train(tmp_path / "run", "revffn.distill_teacher=cached", "save_steps=3", "resume=true")
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamp  # read back, not rebuilt
    assert [r["loss"] for r in metrics(tmp_path / "run")] == pytest.approx(ref, abs=1e-6)
    # a fresh run over it (overwrite=true) on other data: the run's own cache is cleared with it and rebuilt
    first = json.loads((cache / "manifest.json").read_text())["data_sha256"]
    _train(tmp_path / "run", "revffn.distill_teacher=cached", "overwrite=true", "data=builtin:commas_train",
           "max_steps=1")
    assert json.loads((cache / "manifest.json").read_text())["data_sha256"] != first


def test_a_cache_of_other_data_exits_2_and_a_cut_build_is_rebuilt(tmp_path, capsys):
    cache = tmp_path / "cache"
    _train(tmp_path / "first", "revffn.distill_teacher=cached", f"revffn.teacher_cache={cache}", "max_steps=2")
    before = sorted(p.name for p in cache.iterdir())
    first = json.loads((cache / "manifest.json").read_text())["data_sha256"]
    other = ["revffn.distill_teacher=cached", f"revffn.teacher_cache={cache}", "data=builtin:commas_train",
             "max_steps=2"]
    code = main(["train", *TINY, *other, f"output_dir={tmp_path / 'second'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "revffn.teacher_cache" in err and "another data set" in err and "Fix:" in err
    assert sorted(p.name for p in cache.iterdir()) == before
    assert not (tmp_path / "second").exists()  # refused before the run wrote anything
    # a build that stopped before its manifest (killed) leaves rank files only: the next run recomputes them
    (cache / "manifest.json").unlink()
    _train(tmp_path / "third", *other)
    assert json.loads((cache / "manifest.json").read_text())["data_sha256"] != first  # computed on the new data


@pytest.mark.parametrize("damage", ["manifest_cut", "manifest_list", "states_garbage", "index_missing"])
def test_a_damaged_cache_exits_2_before_the_run_writes(tmp_path, capsys, damage):
    """Each was a traceback (JSONDecodeError, AttributeError, SafetensorError), the last two after the run directory
    was written."""
    cache = tmp_path / "cache"
    args = ["revffn.distill_teacher=cached", f"revffn.teacher_cache={cache}", "max_steps=2"]
    _train(tmp_path / "first", *args)
    if damage == "manifest_cut":
        (cache / "manifest.json").write_text((cache / "manifest.json").read_text()[:20])
    elif damage == "manifest_list":
        (cache / "manifest.json").write_text("[]")
    elif damage == "states_garbage":
        (cache / "hidden-r0.safetensors").write_bytes(b"not a safetensors file")
    else:
        (cache / "index-r0.json").unlink()
    for command in ("validate", "train"):
        assert main([command, "", *TINY, *args, f"output_dir={tmp_path / 'second'}"]) == 2
        err = capsys.readouterr().err
        assert f"revffn.teacher_cache={str(cache)!r}: the cached teacher is damaged (" in err, err
        assert f"Fix: delete {cache} to compute it again" in err and "Traceback" not in err
    assert not (tmp_path / "second").exists()


def test_streaming_with_a_cached_teacher_is_refused():
    with pytest.raises(UserError, match="revffn.distill_teacher=cached.*Fix: revffn.distill_teacher=copy"):
        load_config(None, [*TINY, "revffn.distill_teacher=cached", "streaming=true", "output_dir=unused"])


def test_the_estimate_counts_each_teacher_route():
    from revffn.memory.estimate import estimate
    from revffn.models.loading import hf_config

    config, cls = hf_config("qwen1.5-moe-a2.7b"), method_class("revffn")
    plain = estimate(config, cls, batch=1, seq=512, dtype="bfloat16", coupling="additive")
    copy = estimate(config, cls, batch=1, seq=512, dtype="bfloat16", distill_coef=0.5, coupling="additive")
    cached = estimate(config, cls, batch=1, seq=512, dtype="bfloat16", distill_coef=0.5, distill_teacher="cached",
                    coupling="additive")
    head = config.vocab_size * config.hidden_size
    assert copy["weights"] - plain["weights"] == plain["total_params"] * 2
    assert cached["weights"] - plain["weights"] == head * 2  # the head's copy alone
    assert any("cached teacher" in n for n in cached["notes"]) and any("teacher copy" in n for n in cached["notes"])
    # the loading route's host memory: the whole model per process, the copy route's teacher with it
    for est in (plain, copy, cached):
        assert est["host_load_bytes"] == est["total_params"] * 2
    whole = estimate(config, cls, batch=1, seq=512, dtype="bfloat16", distill_coef=0.5, world_size=8,
                     distributed="fsdp", coupling="additive")
    assert whole["host_load_route"] == "whole"  # the teacher copy is taken of the calibrated model: loaded whole
    assert whole["host_load_bytes"] == copy["host_load_bytes"]
    assert any("8 processes on one node" in n for n in whole["notes"])
    # the cached route loads shard by shard: each rank its eighth, read straight into its shards, and a buffer of
    # one tensor's rows (the embedding's eighth, its largest) for a checkpoint in another dtype
    sharded = estimate(config, cls, batch=1, seq=512, dtype="bfloat16", distill_coef=0.5, distill_teacher="cached",
                       world_size=8, distributed="fsdp", coupling="additive")
    buffer = -(-config.vocab_size // 8) * config.hidden_size
    assert buffer > config.hidden_size * config.moe_intermediate_size  # more than one expert's matrix
    assert sharded["host_load_route"] == "sharded"
    assert sharded["host_load_bytes"] == -(-sharded["total_params"] * 2 // 8) + buffer * 2
    assert sharded["host_load_bytes"] < whole["host_load_bytes"] / 4

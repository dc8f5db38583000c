"""Sharded loading (`models.sharded`): a model built on the meta device and filled from its safetensors, one layer
at a time, equals `from_pretrained` bitwise; under torchrun each rank reads only its rows, and FSDP2's shards,
the method's adapters (RevFFN's calibration included) and the tied embeddings equal the whole-model load's."""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from revffn.methods import method_class
from revffn.models.loading import load_hf
from revffn.models.sharded import (
    check_loaded,
    huge_pages,
    load_shards,
    mark_unloaded,
    materialize,
    meta_hf,
    parameter_slots,
    sharded_loadable,
)
from revffn.training.config import load_config

REPO = Path(__file__).resolve().parents[2]
RUN = Path(__file__).with_name("sharded_load_run.py")


def test_which_models_load_shard_by_shard(tmp_path):
    assert sharded_loadable("builtin:base")
    assert sharded_loadable("builtin:base", {"num_hidden_layers": 2})  # fewer layers: the rest skipped
    assert not sharded_loadable("builtin:base", {"hidden_size": 128})  # random init at another width
    assert not sharded_loadable("tiny-qwen2-moe")  # random init
    (tmp_path / "final").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "final" / name).write_bytes((REPO / "revffn/assets/base" / name).read_bytes())
    assert sharded_loadable(str(tmp_path / "final"))
    (tmp_path / "final" / "revffn.json").write_text(json.dumps({"format": "revffn"}))  # converted: as it is
    assert sharded_loadable(str(tmp_path / "final"))
    assert not sharded_loadable(str(tmp_path / "final"), {"num_hidden_layers": 2})  # refused by `load_hf`


def test_the_methods_that_prepare_on_meta():
    def on_meta(*over):
        cfg = load_config(None, list(over))
        return method_class(cfg.method)(cfg).prepares_on_meta()

    assert on_meta("method=full") and on_meta("method=ckpt") and on_meta("method=revffn")
    assert not on_meta("method=lora")  # peft draws LoRA's A at random
    assert not on_meta("method=revffn", "revffn.coupling=additive", "revffn.adapter_init=random")
    assert not on_meta("method=revffn", "revffn.distill_coef=0.5")  # the teacher copy is of the calibrated model


def test_the_root_is_gathered_for_after_load_only_where_it_may_run_the_model():
    """Under FSDP `build_run` all-gathers the root (embeddings, head) for `after_load` only where it may call the
    model's modules: RevFFN's additive coupling (calibration, the streams' choice), a method with an `after_load` of
    its own; not `full`, nor the buffered coupling (nothing to calibrate)."""
    def runs(*over):
        cfg = load_config(None, list(over))
        return method_class(cfg.method)(cfg).after_load_runs_model()

    assert not runs("method=full") and not runs("method=revffn", "revffn.coupling=buffered")
    assert runs("method=revffn", "revffn.coupling=additive")

    class Own(method_class("full")):  # a method registered outside the package, say
        def after_load(self, model):
            pass

    assert Own(load_config(None, ["method=full"])).after_load_runs_model()


@pytest.mark.parametrize("layers", [4, 2])
def test_meta_then_layer_by_layer_equals_from_pretrained(layers):
    """One process, no sharding: the loader's conversion (qwen2_moe's per-expert tensors stacked) and its
    truncation to `num_hidden_layers` give what transformers loads, bit for bit."""
    hf = meta_hf("builtin:base", torch.float32, num_hidden_layers=layers)
    assert all(p.is_meta for p in hf.parameters()) and not any(b.is_meta for b in hf.buffers())
    slots = parameter_slots(hf)
    materialize(hf, torch.device("cpu"))
    check_loaded(hf, mark_unloaded(hf, slots, load_shards(slots, hf.config, "builtin:base", torch.float32)))
    ref = load_hf("builtin:base", dtype=torch.float32, num_hidden_layers=layers)
    ours, theirs = dict(hf.named_parameters()), dict(ref.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert all(torch.equal(a, b) for a, b in zip(hf.buffers(), ref.buffers()))


def _tiny_checkpoint(path: Path, model_type: str, **config) -> Path:
    """A tiny random `model_type` saved as an HF checkpoint, untied, its router biases (buffers the checkpoint
    holds: lfm2_moe's `expert_bias`, kolibri1's `e_score_correction_bias`) made nonzero."""
    from transformers import AutoModelForCausalLM

    from revffn.models.tiny_any import tiny_config_for

    cfg = tiny_config_for(model_type)
    for key, value in {"tie_word_embeddings": False, **config}.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("bias"):
                b.copy_(torch.randn_like(b))
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("model_type", ["lfm2_moe", "kolibri1"])
def test_buffers_the_checkpoint_holds_load_as_from_pretrained(tmp_path, model_type):
    """A router's bias kept as a buffer in the checkpoint (it steers routing) is read as `from_pretrained` reads
    it, not left at its initial zeros."""
    path = str(_tiny_checkpoint(tmp_path / "ckpt", model_type))
    hf = meta_hf(path, torch.float32)
    slots = parameter_slots(hf)
    materialize(hf, torch.device("cpu"))
    check_loaded(hf, mark_unloaded(hf, slots, load_shards(slots, hf.config, path, torch.float32)))
    ref = load_hf(path, dtype=torch.float32)
    theirs = dict(ref.named_buffers())
    biases = [name for name in theirs if name.endswith("bias")]
    assert biases and all(theirs[name].abs().sum() > 0 for name in biases)
    assert all(torch.equal(b, theirs[name]) for name, b in hf.named_buffers())
    assert all(torch.equal(a, b) for a, b in zip(hf.parameters(), ref.parameters()))


def test_a_checkpoint_in_another_dtype_reads_straight_into_the_model_and_casts(tmp_path, monkeypatch):
    """A bf16 checkpoint loaded in fp32, one process: the tensors only renamed are read straight into the model's
    and cast there, as `from_pretrained` casts them; the experts (not sharded: one process) through transformers'
    converter. Every parameter equals `from_pretrained`'s."""
    from transformers import AutoModelForCausalLM

    from revffn.models import sharded

    path = _tiny_checkpoint(tmp_path / "ckpt", "qwen2_moe")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    path = str(tmp_path / "bf16")
    direct, read_into = [], sharded._Stored.read_into
    monkeypatch.setattr(sharded._Stored, "read_into",
                        lambda self, key, *a, **k: (direct.append(key), read_into(self, key, *a, **k)))
    hf = meta_hf(path, torch.float32)
    slots = parameter_slots(hf)
    materialize(hf, torch.device("cpu"))
    written = load_shards(slots, hf.config, path, torch.float32)
    check_loaded(hf, mark_unloaded(hf, slots, written))
    assert any(k.endswith("q_proj.weight") for k in direct) and not any(".experts." in k for k in direct)
    assert written >= {name for name, _ in hf.named_parameters()}
    ref = load_hf(path, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(hf.parameters(), ref.parameters()))


def test_parameters_the_checkpoint_lacks_are_marked_for_after_load():
    """`mark_unloaded` NaN-fills only what the load did not write; `check_loaded` then finds any of them that
    `after_load` left unset, and only those are scanned."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    slots = parameter_slots(model)
    materialize(model, torch.device("cpu"))
    with torch.no_grad():
        model[0].weight.fill_(1.0)
        model[0].bias.fill_(float("nan"))  # a loaded value that is NaN is the checkpoint's, not checked
    pending = mark_unloaded(model, slots, {"0.weight", "0.bias"})
    assert pending == ["1.weight", "1.bias"] and model[1].weight.isnan().all()
    with torch.no_grad():
        model[1].weight.zero_()
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\) without a value: 1.bias"):
        check_loaded(model, pending)
    with torch.no_grad():
        model[1].bias.zero_()
    check_loaded(model, pending)


def test_materialize_keeps_a_tied_head_without_fsdp(tmp_path):
    """`to_empty` on an unsharded model makes a parameter per name, so a tied head would come back as a second,
    never-loaded tensor; `materialize` ties it again (under FSDP2 the tie holds already: the sharded tests)."""
    path = str(_tiny_checkpoint(tmp_path / "ckpt", "qwen2_moe", tie_word_embeddings=True))
    hf = meta_hf(path, torch.float32)
    assert hf.lm_head.weight is hf.get_input_embeddings().weight
    slots = parameter_slots(hf)
    materialize(hf, torch.device("cpu"))
    assert hf.lm_head.weight is hf.get_input_embeddings().weight
    check_loaded(hf, mark_unloaded(hf, slots, load_shards(slots, hf.config, path, torch.float32)))
    ref = load_hf(path, dtype=torch.float32)
    ours = dict(hf.named_parameters(remove_duplicate=False))
    assert all(torch.equal(ours[k], v) for k, v in ref.named_parameters(remove_duplicate=False))


def _mapping(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address` (AnonHugePages, VmFlags, ...)."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").is_file()
                    or "[madvise]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="transparent huge pages on advice (madvise) only: Linux with THP set so")
def test_fresh_shards_are_written_into_huge_pages():
    """`huge_pages`, which `materialize` calls on each fresh shard before `load_shards` writes it: memory written after
    the advice is backed by huge pages, the same memory written without it by none. Each tensor has a fresh mapping
    of its own (a heap block may sit in memory advised before); a strided view is not advised (only what it spans)."""
    size = 16 << 20
    maps = [mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE) for _ in range(2)]  # private: anonymous THP, not shmem
    plain, advised = (torch.frombuffer(m, dtype=torch.uint8) for m in maps)
    try:
        assert huge_pages(advised) and not huge_pages(torch.empty(1 << 20, dtype=torch.uint8))  # none whole inside
        assert not huge_pages(advised[: 4 << 20].view(1, -1).expand(4, -1))
        plain.fill_(1), advised.fill_(1)
        plain_map, advised_map = (_mapping(t.data_ptr() + size // 2) for t in (plain, advised))
        assert "hg" in advised_map["VmFlags"].split() and "hg" not in plain_map["VmFlags"].split()  # the advice
        assert plain_map["AnonHugePages"] == "0 kB"
        if advised_map["AnonHugePages"] == "0 kB":
            pytest.skip("the kernel had no free 2 MiB block for the advised memory (fragmented)")
    finally:
        del plain, advised
        for m in maps:
            m.close()


def test_every_arch_built_on_meta_without_its_init_has_the_buffers_of_one_built_with_it():
    """`_meta_model` skips transformers' weight init (it costs a rank start-up time on meta and sets no value):
    the buffers it keeps real (rotary frequencies, router biases) must be those a model built with its init has."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from revffn.archs.architectures import ARCHITECTURES
    from revffn.models.sharded import _meta_model
    from revffn.models.tiny_any import tiny_config_for

    for model_type in sorted(ARCHITECTURES):
        config = tiny_config_for(model_type)
        with init_empty_weights(include_buffers=False):
            initialized = dict(AutoModelForCausalLM.from_config(config).named_buffers())
        ours = dict(_meta_model(config, torch.float32).named_buffers())
        assert ours.keys() == initialized.keys(), model_type
        for name, b in ours.items():
            assert not b.is_meta and torch.equal(b, initialized[name]), (model_type, name)


def test_a_scratch_with_fewer_experts_only_where_the_arch_builds_one():
    """A rank's experts are stacked onto a copy of the model with that many; Jamba builds a dense MLP for one
    expert, so a rank holding one reads all of them (the old route) instead of leaving its rows unloaded."""
    from revffn.models.sharded import _expert_scratch, _meta_model
    from revffn.models.tiny_any import tiny_config_for

    for model_type, held, built in [("jamba", 1, False), ("jamba", 2, True), ("lfm2_moe", 2, True)]:
        config = tiny_config_for(model_type)
        whole = _meta_model(config, torch.float32)
        fused = {name: p.shape for name, p in whole.named_parameters() if ".experts." in name and p.dim() == 3}
        scratch = _expert_scratch(config, torch.float32, fused, held)
        assert (scratch is not None) == built, (model_type, held)
        assert config.num_experts == 4  # the model's own config is left as it is


def test_a_parameter_left_unloaded_is_an_error():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    materialize(model, torch.device("cpu"))
    pending = mark_unloaded(model, parameter_slots(model), set())  # nothing loaded: every one NaN-filled
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
        model[1].weight.zero_()
    with pytest.raises(RuntimeError, match=r"1 parameter\(s\) without a value: 1.bias"):
        check_loaded(model, pending)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(out: Path, model: str, method: str, *extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={_free_port()}", str(RUN), str(out), model, method, *extra]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.integration
@pytest.mark.parametrize("method", ["full", "revffn"])
def test_fsdp_sharded_load_equals_the_whole_load(tmp_path, method):
    """2 ranks, FSDP2: built on meta, each rank reading its rows, against the model loaded whole on every rank and
    then sharded; every parameter all-gathered and compared bitwise (RevFFN: its calibrated adapters, fitted by
    the ranks together through the sharded layers, against the fit on the whole model)."""
    extra = ["revffn.coupling=additive", "revffn.calibration_tokens=512"] if method == "revffn" else []
    r = _two_ranks(tmp_path / "out.json", "builtin:base", method, *extra)
    assert r["routes"] == {"loading": "sharded", "dtensors": True, "whole": "whole"}
    assert r["experts_read"] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # each rank its own 4 of the 8 experts' tensors
    assert r["experts_converted"] == [[], []]  # read straight into the fused shards
    assert r["keys_equal"] and r["diff"]
    assert r["bitwise"], {k: v for k, v in r["diff"].items() if v}


@pytest.mark.real
@pytest.mark.integration
def test_fsdp_sharded_load_of_the_real_moe_equals_the_whole_load(tmp_path):
    """builtin:smollm2-moe (Mixtral: per-expert w1/w2/w3 stacked by transformers into the fused experts, the gate
    renamed, the embeddings tied to the head), 2 layers: every parameter bitwise the whole load's."""
    r = _two_ranks(tmp_path / "out.json", "builtin:smollm2-moe", "full", "model_config={num_hidden_layers: 2}")
    assert r["routes"] == {"loading": "sharded", "dtensors": True, "whole": "whole"}
    assert r["experts_read"] == [[0, 1], [2, 3]]
    assert r["experts_converted"] == [[], []]
    assert r["keys_equal"] and r["bitwise"], {k: v for k, v in r["diff"].items() if v}


@pytest.mark.integration
def test_fsdp_sharded_load_of_an_uneven_expert_split_equals_the_whole_load(tmp_path):
    """lfm2_moe with 5 experts over 2 ranks (3 + 2), a dense first layer and router biases in the checkpoint:
    each rank reads its own experts only, and every parameter and buffer equals the whole load's."""
    path = _tiny_checkpoint(tmp_path / "ckpt", "lfm2_moe", num_experts=5)
    r = _two_ranks(tmp_path / "out.json", str(path), "full")
    assert r["routes"] == {"loading": "sharded", "dtensors": True, "whole": "whole"}
    assert r["experts_read"] == [[0, 1, 2], [3, 4]]
    assert r["experts_converted"] == [[], []]
    assert r["keys_equal"] and r["bitwise"], {k: v for k, v in r["diff"].items() if v}
    assert r["buffers_equal"]


@pytest.mark.integration
def test_fsdp_sharded_load_of_a_converted_directory_equals_the_whole_load(tmp_path):
    """A `revffn convert` directory (its adapters calibrated, then moved off their fit so that no init could pass
    for them) under 2 FSDP ranks: each rank reads only its rows of each tensor of model.safetensors; all-gathered,
    every parameter equals `load`'s whole model, sharded."""
    from revffn.cli import main
    from revffn.models.hf_remote import save_converted
    from revffn.models.loading import load

    out = tmp_path / "converted"
    assert main(["convert", "builtin:base", "--out", str(out), "--coupling", "additive",
                 "--calibration-tokens", "256"]) == 0
    model = load(str(out))
    with torch.no_grad():
        for i, p in enumerate(model.adapter_parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 1e-2)
    save_converted(model, out)
    r = _two_ranks(tmp_path / "out.json", str(out), "revffn")
    assert r["routes"] == {"loading": "sharded", "dtensors": True, "whole": "whole"}
    assert r["keys_equal"] and r["diff"]
    assert r["bitwise"], {k: v for k, v in r["diff"].items() if v}


@pytest.mark.integration
@pytest.mark.slow  # two 2-rank training runs (~20 s): the suite's budget
def test_a_sharded_load_trains_and_resumes_without_calibrating(tmp_path):
    """`revffn train` on 2 FSDP ranks loads `builtin:base` shard by shard, calibrates once (the additive coupling:
    the buffered default has nothing to calibrate), and a resume from its step-2 checkpoint (DCP shards into the
    meta-built model) skips the calibration and continues the same run."""
    import shutil

    over = ["model=builtin:base", "model_config={num_hidden_layers: 2}", "method=revffn", "revffn.coupling=additive",
            "revffn.calibration_tokens=512", "revffn.adapter_warmup_steps=2", "revffn.heal_data=task",
            "data=builtin:reversal_train", "eval_data=null",
            "max_seq_length=32", "per_device_train_batch_size=2", "distributed=fsdp", "max_steps=4", "save_steps=2",
            "logging_steps=1", "dtype=float32", "device=cpu", "learning_rate=1e-3", "warmup_steps=0"]

    def train(out: Path, *extra: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
               f"--master-port={_free_port()}", "-m", "revffn", "train", *over, *extra, f"output_dir={out}"]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    ref = train(tmp_path / "ref")
    assert "calibrating the adapters" in ref.stderr
    assert "each rank read only its shards" in ref.stderr  # the route, once (rank 0), and in events.jsonl
    events = [json.loads(line) for line in (tmp_path / "ref" / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["loading"], e["world_size"]) for e in events] == [("load", "sharded", 2)]
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    resumed = train(tmp_path / "run", f"resume={tmp_path / 'run' / 'checkpoints' / 'step-2'}")
    assert "calibration skipped" in resumed.stderr and "calibrating the adapters" not in resumed.stderr

    def losses(run: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = losses(tmp_path / "ref"), losses(tmp_path / "run")
    assert len(a) == len(b) == 4
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-6, (a, b)


def test_a_shallower_model_keeps_a_valid_config():
    """`model_config: {num_hidden_layers: 2}` on a 4-layer model: its per-layer `layer_types` are cut too, so the
    config validates when built again (a converted model's export builds it; it failed there, after training)."""
    for hf in (load_hf("builtin:base", num_hidden_layers=2), meta_hf("builtin:base", num_hidden_layers=2)):
        config = hf.config
        assert len(config.layer_types) == config.num_hidden_layers == 2
        assert type(config).from_dict(config.to_dict()).layer_types == config.layer_types


def test_the_first_model_build_freezes_the_imports_once_and_nothing_built_after():
    """`freeze_imports`: the objects alive at a process's first build (its imports) leave the collector's scans;
    the model built then, and a second build, stay collectable (a reference cycle among them is freed)."""
    code = """if True:
        import gc, json, torch
        from revffn.models.loading import load_hf
        from revffn.models.sharded import meta_hf
        before = gc.get_freeze_count()
        hf = meta_hf("builtin:base")
        first = gc.get_freeze_count()
        load_hf("builtin:base")
        second = gc.get_freeze_count()
        class Node: pass
        a, b = Node(), Node(); a.b, b.a = b, a  # a cycle made after the freeze
        probe = [id(a)]; del a, b
        freed = gc.collect() > 0 and not any(id(o) == probe[0] for o in gc.get_objects())
        print(json.dumps({"before": before, "first": first, "second": second, "frozen_model": gc.is_tracked(hf)
                          and any(m is hf for m in gc.get_objects()), "freed": freed}))
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["before"] == 0 and got["first"] > 100_000  # torch's and transformers' imports
    assert got["second"] <= got["first"]  # once a process (a frozen object that refcounting frees leaves the count)
    assert got["frozen_model"]  # gc.get_objects() lists only the collectable: the model built after is
    assert got["freed"]

"""Sparse upcycling: the MoE equals the dense model at init for every E, top-k and target, the check catches
one that does not (unrenormalized top-k: the negative control), and what cannot be exact is refused."""

import json
import subprocess
import sys

import pytest
import torch
import transformers

from revffn.cli import main
from revffn.conversion.upcycle import TOLERANCE, max_logit_delta, upcycle, upcycle_bytes
from revffn.errors import UserError

DENSE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)


def dense(cls="LlamaConfig", **over):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**DENSE, **over}))


@pytest.mark.parametrize("experts", [2, 4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("source,arch", [("LlamaConfig", "mixtral"), ("MistralConfig", "mixtral"),
                                         ("LlamaConfig", "qwen2_moe"), ("Qwen2Config", "qwen2_moe")])
def test_upcycle_equals_dense(source, arch, experts, top_k):
    d = dense(source)
    moe = upcycle(d, experts, top_k, arch)
    assert moe.config.model_type == arch
    n_experts = moe.config.num_local_experts if arch == "mixtral" else moe.config.num_experts
    assert (n_experts, moe.config.num_experts_per_tok) == (experts, top_k)
    assert max_logit_delta(d, moe, DENSE["vocab_size"]) <= TOLERANCE


@pytest.mark.parametrize("experts,top_k", [(4, 1), (4, 2), (8, 2)])
def test_without_renormalized_top_k_it_is_not_exact(experts, top_k):
    """The negative control: Qwen2-MoE with norm_topk_prob false weighs the k identical experts by less than 1."""
    d = dense()
    moe = upcycle(d, experts, top_k, "qwen2_moe", renormalize=False)
    assert max_logit_delta(d, moe, DENSE["vocab_size"]) > 100 * TOLERANCE


def test_tied_embeddings_stay_tied():
    d = dense(tie_word_embeddings=True)
    moe = upcycle(d, 4, 2, "mixtral")
    assert moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr()
    assert max_logit_delta(d, moe, DENSE["vocab_size"]) <= TOLERANCE


@pytest.mark.parametrize("source,over,experts,top_k,arch,words", [
    ("LlamaConfig", {}, 2, 3, "mixtral", "--top-k 3"),
    ("LlamaConfig", {}, 1, 1, "mixtral", "--experts 1"),
    ("Qwen2Config", {}, 4, 2, "mixtral", "q_proj.bias"),
    ("LlamaConfig", {"attention_bias": True}, 4, 2, "qwen2_moe", "attention_bias"),
    ("LlamaConfig", {"mlp_bias": True}, 4, 2, "mixtral", "mlp_bias"),
    ("Qwen3Config", {"head_dim": 16}, 4, 2, "mixtral", "'qwen3'"),
])
def test_refuses_what_cannot_be_exact(source, over, experts, top_k, arch, words):
    with pytest.raises(UserError, match=words.replace(".", r"\.").replace("-", r"\-")):
        upcycle(dense(source, **over), experts, top_k, arch)


def test_refuses_an_moe():
    moe = upcycle(dense(), 4, 2, "mixtral")
    with pytest.raises(UserError, match="already a Mixture-of-Experts"):
        upcycle(moe, 4, 2, "mixtral")


def _save_dense(tmp_path):
    d = dense(tie_word_embeddings=True)
    d.save_pretrained(tmp_path / "dense")
    from revffn.data.tokenizer import load_tokenizer

    load_tokenizer(None).save_pretrained(tmp_path / "dense")
    return tmp_path / "dense"


def test_cli_writes_the_measured_delta_and_the_moe_reloads(tmp_path, capsys):
    src = _save_dense(tmp_path)
    assert main(["upcycle", str(src), "--experts", "4", "--top-k", "2", "--out", str(tmp_path / "moe"), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    written = json.loads((tmp_path / "moe" / "revffn.json").read_text())
    assert manifest == written and written["format"] == "hf"
    assert written["files"] == sorted(p.name for p in (tmp_path / "moe").iterdir())  # what --overwrite may replace
    assert {"config.json", "model.safetensors", "revffn.json", "tokenizer.json"} <= set(written["files"])
    assert 0 <= written["max_abs_dlogit"] <= TOLERANCE
    # the directory is plain transformers, and equals the dense model as loaded from disk
    moe = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    d = transformers.AutoModelForCausalLM.from_pretrained(src)
    assert isinstance(moe, transformers.MixtralForCausalLM)
    assert max_logit_delta(d, moe, DENSE["vocab_size"]) <= TOLERANCE
    # revffn trains it: the reversible conversion takes the upcycled MoE
    assert main(["check", "--model", str(tmp_path / "moe")]) == 0


@pytest.mark.integration
@pytest.mark.parametrize("args,words", [
    (["--experts", "2", "--top-k", "3"], "--top-k 3"),
    (["--experts", "4", "--top-k", "2", "--arch", "qwen2_moe"], None),  # exact: a control that it does write
])
def test_cli_bad_input_exits_2_and_writes_nothing(tmp_path, args, words):
    src = _save_dense(tmp_path)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "revffn", "upcycle", str(src), *args, "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    if words is None:
        assert r.returncode == 0, r.stderr
        assert (out / "revffn.json").is_file()
        return
    assert r.returncode == 2
    assert words in r.stderr and "Fix:" in r.stderr
    assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["dense"]


def test_cli_refuses_upcycling_an_moe_dir(tmp_path, capsys):
    moe = upcycle(dense(), 4, 2, "mixtral")
    moe.save_pretrained(tmp_path / "moe")
    assert main(["upcycle", str(tmp_path / "moe"), "--experts", "4", "--top-k", "2", "--out",
                 str(tmp_path / "again")]) == 2
    assert "already a Mixture-of-Experts" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen2-moe"])
def test_cli_refuses_a_preset_in_one_line(tmp_path, capsys, preset):
    """A tiny preset is a MODEL elsewhere, but it has no files to upcycle: one line and exit 2, not a traceback."""
    assert main(["upcycle", preset, "--experts", "4", "--top-k", "2", "--out", str(tmp_path / "up")]) == 2
    err = capsys.readouterr().err
    assert f"{preset!r} names no model directory" in err and "Fix:" in err and "Traceback" not in err
    assert not (tmp_path / "up").exists()


def test_cli_keeps_a_non_empty_out(tmp_path, capsys):
    src = _save_dense(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    assert main(["upcycle", str(src), "--experts", "2", "--top-k", "3", "--out", str(tmp_path / "out"),
                 "--overwrite"]) == 2
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"  # a refused run leaves it as it was
    assert main(["upcycle", str(src), "--experts", "4", "--top-k", "2", "--out", str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err


def test_overwrite_replaces_only_a_model_directory_revffn_wrote(tmp_path, capsys):
    """--overwrite replaces an upcycle's (or a convert's) output, never a directory of other files."""
    src = _save_dense(tmp_path)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    argv = ["upcycle", str(src), "--experts", "4", "--top-k", "2", "--out", str(tmp_path / "out"), "--overwrite"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "not a model directory revffn wrote" in err and "mine.txt" in err and "Fix:" in err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["mine.txt"]
    (tmp_path / "out" / "mine.txt").unlink()
    assert main(argv) == 0 and (tmp_path / "out" / "revffn.json").is_file()
    assert main(argv) == 0  # its own output: replaced
    (tmp_path / "out" / "notes.md").write_text("mine")  # the user's file beside the model: kept, refused
    (tmp_path / "out" / "evals").mkdir()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds evals/, notes.md beside the model revffn wrote" in err and "Fix: move those out" in err, err
    assert (tmp_path / "out" / "notes.md").read_text() == "mine" and (tmp_path / "out" / "revffn.json").is_file()
    (tmp_path / "out" / "notes.md").unlink()
    (tmp_path / "out" / "evals").rmdir()
    (tmp_path / "out" / "eval_results.json").write_text("{}")  # named like a model's file: revffn.json's `files` says
    assert main(argv) == 2                                        # it is not one revffn wrote
    assert "holds eval_results.json beside the model revffn wrote" in capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "revffn.json").read_text())
    del manifest["files"]  # a directory written before revffn.json listed its files: judged by the names
    (tmp_path / "out" / "revffn.json").write_text(json.dumps(manifest))
    assert main(argv) == 0 and not (tmp_path / "out" / "eval_results.json").exists()
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "ch1.tex").write_text("keep")
    assert main(["convert", "tiny-qwen2-moe", "--out", str(tmp_path / "thesis"), "--overwrite"]) == 2
    assert "not a model directory revffn wrote" in capsys.readouterr().err
    assert (tmp_path / "thesis" / "ch1.tex").read_text() == "keep"


def _save_on_rank(rank: int, port: int, out: str) -> None:
    """A gloo rank of two: rank 1 saves a tiny model with plain save_pretrained and with save_here."""
    import os
    from pathlib import Path

    import torch.distributed as dist

    from revffn.conversion.upcycle import save_here
    from revffn.models.presets import tiny_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 1:
            model = tiny_model("tiny-mixtral")
            model.save_pretrained(Path(out) / "plain")
            save_here(model, Path(out) / "here")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
def test_a_cache_entry_built_off_rank_0_of_a_process_group_is_written_whole(tmp_path):
    """The file lock of a cache entry (`models.cache`) can fall to any torchrun rank; save_here writes the model
    there, where transformers' own save_pretrained may write nothing (it did in 5.25: an entry of tokenizer files
    only, found by a clean-clone run of test_sharded's real-model test)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_save_on_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    here = tmp_path / "here"
    assert (here / "config.json").is_file() and any(here.glob("*.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(here)
    assert loaded.config.model_type == "mixtral"
    if hasattr(transformers.PreTrainedModel, "should_save_on_this_rank"):  # the failure it guards against
        assert not (tmp_path / "plain" / "config.json").exists()


def test_more_experts_than_the_memory_holds_exits_2_before_the_weights_are_read(tmp_path, capsys, monkeypatch):
    """`--experts 100000` allocated until the OOM killer ended it. The fp32 dense model and its MoE twin, counted
    on the meta device (`upcycle_bytes`: exactly their parameters), are checked against the free memory first."""
    src = _save_dense(tmp_path)
    d = transformers.AutoModelForCausalLM.from_pretrained(src)
    need = upcycle_bytes(d.config, 4, 2, "mixtral")
    assert need == 4 * sum(p.numel() for m in (d, upcycle(d, 4, 2)) for p in m.parameters())
    monkeypatch.setattr("revffn.memory.measure.free_memory_bytes", lambda device: need - 1)
    assert main(["upcycle", str(src), "--experts", "4", "--top-k", "2", "--out", str(tmp_path / "moe")]) == 2
    err = capsys.readouterr().err
    assert "--experts 4: upcycling MODEL (the dense model and the MoE, fp32) needs at least" in err, err
    assert "Fix: fewer --experts" in err and not (tmp_path / "moe").exists()
    monkeypatch.setattr("revffn.memory.measure.free_memory_bytes", lambda device: need)
    assert main(["upcycle", str(src), "--experts", "4", "--top-k", "2", "--out", str(tmp_path / "moe")]) == 0

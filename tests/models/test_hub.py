"""Hub IDs (`ORG/NAME[@REVISION]`) as model references, offline: a real huggingface_hub cache layout is built
on disk from the shipped base (blobs, snapshot symlinks, refs) and loaded by ID as training loads it. No test
here touches the network: `HF_HUB_OFFLINE` is on (also in the constant huggingface_hub read at import)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from huggingface_hub import errors as hub_errors

from revffn.cli import main
from revffn.data.tokenizer import load_tokenizer
from revffn.errors import UserError
from revffn.models.hub import parse_hub_id
from revffn.models.loading import SHIPPED_MODELS, check_model_ref, hf_config, load_hf

REPO = "revffn-test/base"
COMMIT = hashlib.sha1(REPO.encode()).hexdigest()  # a snapshot folder is named by a 40-hex commit


def hub_cache(cache: Path, repo_id: str, src: Path, files=None, revision: str = "main") -> Path:
    """The layout huggingface_hub writes: blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
    refs/<revision> holding the commit. `files`: the names of `src` to cache (default: all)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(src.iterdir()):
        if files is None or f.name in files:
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, repo / "blobs" / digest)
            (snap / f.name).symlink_to(Path("../../blobs") / digest)
    (repo / "refs").mkdir()
    (repo / "refs" / revision).write_text(COMMIT)
    return snap


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, offline; the env for subprocesses, the constants for this process."""
    from huggingface_hub import constants

    root = tmp_path / "hf-cache"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root


@pytest.fixture
def base_cache(cache):
    hub_cache(cache, REPO, SHIPPED_MODELS["builtin:base"])
    return cache


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("ref", [REPO, f"{REPO}@main", f"{REPO}@{COMMIT}"])
def test_load_hf_by_hub_id_from_the_offline_cache(base_cache, ref):
    hf = load_hf(ref)
    assert_same_weights(hf, load_hf("builtin:base"))
    same = {"_name_or_path": ""}  # each config names its reference
    assert hf_config(ref).to_dict() | same == hf_config("builtin:base").to_dict() | same
    assert load_tokenizer(ref).get_vocab() == load_tokenizer(str(SHIPPED_MODELS["builtin:base"])).get_vocab()


def test_train_by_hub_id_through_the_cli(base_cache, tmp_path):
    """`revffn train model=ORG/NAME`: the tokenizer (validation) and the weights (the run) come from the cache;
    the loaded weights are the base's (test above), so a run from builtin:base is not repeated here."""
    run = tmp_path / "run"
    assert main(["train", f"model={REPO}", f"output_dir={run}", "method=full", "max_steps=2", "eval_data=null",
                 "per_device_train_batch_size=2", "max_seq_length=32", "save_steps=0", "device=cpu"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert load_tokenizer(str(run / "final")).get_vocab() == load_tokenizer(REPO).get_vocab()


def test_estimate_by_hub_id_reads_only_the_config(cache, capsys):
    base = SHIPPED_MODELS["builtin:base"]
    hub_cache(cache, REPO, base, files=[p.name for p in base.iterdir() if not p.name.endswith(".safetensors")])
    assert main(["estimate", "--model", REPO, "--json"]) == 0
    by_id = json.loads(capsys.readouterr().out)
    assert main(["estimate", "--model", "builtin:base", "--json"]) == 0
    assert by_id == json.loads(capsys.readouterr().out) | {"model": REPO}
    with pytest.raises(UserError, match=r"^model: 'revffn-test/base' has no \*\.safetensors weights"):
        load_hf(REPO)  # configs cached, weights not: named, not a transformers traceback


def test_missing_from_the_offline_cache_is_exit_2_with_the_download_command(cache, capsys):
    assert main(["train", "model=nobody/missing", f"output_dir={cache.parent / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("revffn train: error: model: 'nobody/missing' is not in the Hugging Face cache "
                          f"({cache}) and HF_HUB_OFFLINE=1 forbids downloading it. Fix: ")
    assert "hf download nobody/missing --include '*.json'" in err and "--include '*.safetensors'" in err
    assert not (cache.parent / "run").exists()
    from revffn.models.loading import resolve_model_ref

    with pytest.raises(UserError) as e:  # a command that reads no weights (estimate) asks for none
        resolve_model_ref("nobody/missing@v2", "--model", weights=False)
    assert "`hf download nobody/missing --revision v2 --include '*.json'" in str(e.value)
    assert "'*.tiktoken'` (what this command reads; add --include '*.safetensors' for the commands that load it)" \
        in str(e.value)


def test_a_missing_path_read_as_a_hub_id_names_what_its_directory_holds(cache, tmp_path, monkeypatch, capsys):
    """`runs/typo` beside a local runs/ is likelier a mistyped path than a Hub ID: the error says what runs/ holds."""
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "runs/typo", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "as a path, there is no 'runs/typo' here: runs/ holds quickstart. Fix: point " \
        "MODEL_DIR at an existing directory, or if 'runs/typo' is a Hub ID, download it" in err, err
    assert main(["generate", "nobody/missing", "--prompt", "hi"]) == 2
    assert "as a path" not in capsys.readouterr().err  # no local nobody/: a Hub ID, said as before


@pytest.mark.parametrize("error, says", [
    (hub_errors.LocalEntryNotFoundError, "not in the Hugging Face cache .* and the Hugging Face Hub could not be"),
    (hub_errors.GatedRepoError, "'org/name' is gated on the Hugging Face Hub .* Fix: accept its conditions"),
    (hub_errors.RepositoryNotFoundError, "neither a local directory nor a model on the Hugging Face Hub .* Fix: check"),
    (hub_errors.RevisionNotFoundError, "'org/name' has no revision 'v9' on the Hugging Face Hub. Fix: "),
    (ConnectionResetError, r"fetching 'org/name@v9' from the Hugging Face Hub failed \(ConnectionResetError: "
                           r"reset\). Fix: check the network"),
])
def test_hub_failures_online_are_user_errors(cache, monkeypatch, error, says):
    """What huggingface_hub raises online (no request made: snapshot_download is replaced) becomes one line."""
    import huggingface_hub
    from huggingface_hub import constants

    from revffn.models.hub import snapshot

    exc = error.__new__(error)  # the hub's HTTP errors want a live response in __init__
    exc.args = ("reset",)

    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(UserError, match=f"^model: .*{says}") as e:
        snapshot("org/name@v9")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad", ["a/b/c", "Qwen/Qwen 1.5!", "org/--name", "org/name@", "/no/such/dir"])
def test_a_malformed_hub_id_is_exit_2_naming_the_key(bad, cache, capsys):
    assert parse_hub_id(bad) is None
    assert main(["estimate", "--model", bad]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--model: {bad!r} is neither a local directory nor a Hugging Face Hub ID" in err
    with pytest.raises(UserError, match=r"^model: .* Fix: give an existing directory"):
        check_model_ref(bad)


def test_a_local_directory_wins_over_a_hub_id(tmp_path, monkeypatch, cache):
    """`org/name` that exists on disk is the directory, as from_pretrained reads it."""
    shutil.copytree(SHIPPED_MODELS["builtin:base"], tmp_path / "revffn-test" / "base")
    monkeypatch.chdir(tmp_path)
    assert_same_weights(load_hf(REPO), load_hf("builtin:base"))


def test_generate_by_hub_id(base_cache, capsys):
    """`revffn generate ORG/NAME` (and eval, the same loader): the model and its tokenizer from the cache."""
    assert main(["generate", REPO, "--prompt", "Put commas between: red cat sun", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def test_a_hub_id_is_resolved_once_per_process(cache, monkeypatch, tmp_path):
    """The model, the converted check and the tokenizer of one run ask the Hub once; another cache asks again."""
    import huggingface_hub

    from revffn.models.hub import snapshot

    calls = []
    where = tmp_path / "snap"
    where.mkdir()

    def fake(repo_id, revision=None, allow_patterns=None, local_files_only=False):
        assert local_files_only  # HF_HUB_OFFLINE=1 (conftest): the cache only, on every huggingface_hub
        calls.append((repo_id, revision, tuple(allow_patterns)))
        return str(where)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert snapshot("org/once") == snapshot("org/once") == snapshot("org/once", weights=False) == str(where)
    assert len(calls) == 1  # the snapshot with weights answers the ask without them too
    assert snapshot("org/lean", weights=False) and snapshot("org/lean") and len(calls) == 3  # but not the reverse
    from huggingface_hub import constants

    other = tmp_path / "other-cache"
    other.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(other))
    snapshot("org/once")
    assert len(calls) == 4


def test_every_load_turns_hub_kernels_off(monkeypatch):
    """transformers >= 5.2x defaults `use_kernels` on where `kernels` is installed and a GPU is visible, then fetches
    kernels from the Hub (fails offline): every revffn load asks for none, whatever the transformers default."""
    from transformers import AutoModelForCausalLM

    real, asked = AutoModelForCausalLM.from_pretrained, []

    def spy(*args, **kwargs):
        asked.append(kwargs.get("use_kernels"))
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    load_hf("builtin:base")
    load_hf("builtin:base", num_hidden_layers=2)  # the cut-depth route
    assert asked == [False, False]

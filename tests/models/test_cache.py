"""revffn's model cache and GGUF references, without the real model: a missing package, a changed wheel file,
GGUF files transformers cannot read, and the atomic build (a failed build leaves nothing behind)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from revffn.cli import main
from revffn.errors import UserError
from revffn.models import cache
from revffn.models.loading import model_kind, resolve_model_ref


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("REVFFN_CACHE", str(root))
    return root


def write_gguf(path: Path, arch: str = "llama", qtype: str = "F32") -> Path:
    """A small GGUF file: header fields and one tensor of type `qtype` (its bytes need not mean anything)."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    kind = gguf.GGMLQuantizationType[qtype]
    if kind == gguf.GGMLQuantizationType.F32:
        w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    else:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        w.add_tensor("token_embd.weight", np.zeros((8, 32 // block * size), dtype=np.uint8), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("REVFFN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == tmp_path / "xdg" / "revffn"
    monkeypatch.setenv("REVFFN_CACHE", str(tmp_path / "mine"))
    assert cache.cache_root() == tmp_path / "mine"


def test_builtin_smollm2_is_a_model_reference_without_touching_anything(empty_cache):
    assert model_kind("builtin:smollm2") == model_kind("builtin:smollm2-moe") == "shipped"
    assert not empty_cache.exists()  # naming it builds nothing
    with pytest.raises(UserError, match="builtin:smollm2"):
        model_kind("builtin:smollm3")


def test_missing_package_exits_2_with_the_install_command(empty_cache, monkeypatch, capsys):
    real = cache.importlib.util.find_spec
    monkeypatch.setattr(cache.importlib.util, "find_spec", lambda name, *a: None if name == cache.SMOLLM2_PACKAGE
                        else real(name, *a))
    for ref in ("builtin:smollm2", "builtin:smollm2-moe"):
        assert main(["generate", ref, "--prompt", "hi"]) == 2
        err = capsys.readouterr().err
        assert cache.SMOLLM2_INSTALL in err and len(err.strip().splitlines()) == 1
    assert not (empty_cache / "smollm2").exists() and not (empty_cache / "smollm2-moe").exists()


def test_a_built_cache_needs_no_package(empty_cache, monkeypatch):
    """Offline and without the package, a cache built earlier is read as it is."""
    (empty_cache / "smollm2").mkdir(parents=True)
    (empty_cache / "smollm2" / "config.json").write_text("{}")
    monkeypatch.setattr(cache.importlib.util, "find_spec", lambda name, *a: None)
    assert resolve_model_ref("builtin:smollm2") == str(empty_cache / "smollm2")


@pytest.mark.integration
def test_changed_wheel_file_exits_2_naming_the_hash(tmp_path, empty_cache):
    fake = tmp_path / "site" / cache.SMOLLM2_PACKAGE
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    write_gguf(fake / cache.SMOLLM2_GGUF)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    r = subprocess.run([sys.executable, "-m", "revffn", "generate", "builtin:smollm2", "--prompt", "hi"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert cache.SMOLLM2_SHA256 in r.stderr and str(fake / cache.SMOLLM2_GGUF) in r.stderr
    assert "--force-reinstall" in r.stderr
    assert not (empty_cache / "smollm2").exists()


@pytest.mark.parametrize("arch,qtype,words", [
    ("llama", "Q8_1", "quantized as Q8_1"),
    ("llama", "I64", "quantized as I64"),
    ("rwkv6", "F32", "GGUF architecture 'rwkv6'"),
])
def test_unreadable_gguf_exits_2_naming_it(tmp_path, empty_cache, monkeypatch, capsys, arch, qtype, words):
    """A relative path to an existing .gguf is a GGUF reference (it was taken for a Hub ID), refused by type."""
    write_gguf(tmp_path / "fx" / "model.gguf", arch, qtype)
    monkeypatch.chdir(tmp_path)
    assert model_kind("fx/model.gguf") == "dir"
    assert main(["eval", "fx/model.gguf", "--data", "builtin:commas_test"]) == 2
    err = capsys.readouterr().err
    assert words in err and str(tmp_path / "fx" / "model.gguf") in err and "Fix:" in err
    assert "Hugging Face" not in err
    assert not (empty_cache / "gguf").exists() or not any((empty_cache / "gguf").iterdir())


def test_not_a_gguf_file(tmp_path, empty_cache, capsys):
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all" * 8)
    assert main(["eval", str(tmp_path / "junk.gguf"), "--data", "builtin:commas_test"]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err


def test_a_directory_of_gguf_files(tmp_path, empty_cache):
    write_gguf(tmp_path / "one" / "a.gguf", "llama", "Q8_1")
    with pytest.raises(UserError, match="Q8_1"):  # one file: the directory names it
        resolve_model_ref(str(tmp_path / "one"))
    write_gguf(tmp_path / "one" / "b.gguf")
    with pytest.raises(UserError, match=r"2 GGUF files \(a\.gguf, b\.gguf\).*Fix"):
        model_kind(str(tmp_path / "one"))


def test_staged_dir_is_all_or_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with cache.staged_dir(out) as tmp:
            (tmp / "half.txt").write_text("half")
            raise RuntimeError("killed mid-write")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "old.txt").read_text() == "old"
    with cache.staged_dir(out) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in out.iterdir()] == ["new.txt"] and [p.name for p in tmp_path.iterdir()] == ["out"]
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)


_SWAP_CHILD = """
import os, sys
from pathlib import Path
from revffn.models import cache
if sys.argv[3] == "fallback":
    cache._exchange = lambda a, b: False  # as on a system without renameat2(RENAME_EXCHANGE)
kill_at = int(sys.argv[2])
with cache.staged_dir(Path(sys.argv[1]), lambda k: os._exit(9) if k == kill_at else None) as tmp:
    (tmp / "model.txt").write_text("new")
"""


@pytest.mark.integration
@pytest.mark.parametrize("how", ["exchange", "fallback"])
def test_a_kill_at_every_step_of_a_swap_leaves_the_old_or_the_new_directory(tmp_path, how):
    """A process killed (os._exit: no handler runs) after each step of `staged_dir`'s swap leaves `out` complete,
    old or new, once `sweep_staged` (which every later swap and run start runs) has looked; no leftovers stay."""
    steps = 3 if how == "exchange" else 4
    seen = set()
    for kill_at in range(1, steps + 2):  # steps + 1: no kill
        root = tmp_path / f"{how}{kill_at}"
        out = root / "final"
        out.mkdir(parents=True)
        (out / "model.txt").write_text("old")
        child = subprocess.run([sys.executable, "-c", _SWAP_CHILD, str(out), str(kill_at), how])
        assert child.returncode == (9 if kill_at <= steps else 0), (kill_at, child.returncode)
        if how == "exchange" or kill_at != 2:  # only the fallback's step 2 leaves `out` missing until the sweep
            assert (out / "model.txt").read_text() in ("old", "new"), kill_at
        cache.sweep_staged(out)
        content = (out / "model.txt").read_text()
        assert content in ("old", "new") and [p.name for p in root.iterdir()] == ["final"], (kill_at, content)
        seen.add(content)
    assert seen == {"old", "new"}

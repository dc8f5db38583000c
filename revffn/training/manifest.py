"""A checkpoint's manifest: what it holds, so that a resume can tell a damaged checkpoint from a good one.

    checkpoints/step-N/manifest.json
        files           {relative path: sha256} of every other file, dcp/ shards included
        config          the config keys that change the math (`config.math_config`), dtype resolved
        config_sha256   sha256 of `config` (canonical JSON)
        versions        revffn, torch and transformers that wrote it

The manifest is written last, by the process that completes the checkpoint (rank 0 after every
shard is written), before the checkpoint is renamed into place. `verify_checkpoint` rehashes every
file: it reads the whole checkpoint once (docs/operations.md: the cost).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def config_sha256(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _files(root: Path) -> list[str]:
    """Every file under `root` but the manifest, as sorted relative POSIX paths."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(root: Path, config: dict) -> None:
    """Hash every file of the checkpoint being completed in `root` and write its manifest."""
    import torch
    import transformers

    import revffn

    manifest = {"files": {rel: sha256_file(root / rel) for rel in _files(root)},
                "config": config, "config_sha256": config_sha256(config),
                "versions": {"revffn": revffn.__version__, "torch": torch.__version__,
                             "transformers": transformers.__version__}}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(path: Path) -> dict:
    """The manifest of a checkpoint that `verify_checkpoint` passed."""
    return json.loads((Path(path) / MANIFEST).read_text())


def verify_checkpoint(path: Path, shard: tuple[int, int] = (0, 1), hash_files: bool = True) -> str | None:
    """None when every file of the checkpoint at `path` matches its manifest; otherwise the first
    problem, naming the file (and the expected and actual sha256).

    `shard=(rank, world)` with world > 1 (a process group up, every rank calling): rank r hashes files r, r + world,
    ... of the manifest, and the ranks all-gather what they found, so the job reads each file once, not once per
    rank, and every rank returns the same verdict. `hash_files=False`: the manifest and the files' presence only
    (what torchrun's ranks check before their process group exists; they hash together once it does)."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
        files, config = manifest["files"], manifest["config"]
    except FileNotFoundError:
        return f"{MANIFEST} missing (not a checkpoint, or written before revffn wrote manifests)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__}: {e})"
    if manifest.get("config_sha256") != config_sha256(config):
        return f"{MANIFEST}: config_sha256 does not match its config"
    extra = sorted(set(_files(path)) - set(files))
    if extra:
        return f"{extra[0]}: not in {MANIFEST}"
    rank, world = shard if hash_files else (0, 1)
    found = None  # (index, problem): the first problem among this rank's files
    for i, (rel, expected) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        if not (path / rel).is_file():
            found = (i, f"{rel}: missing")
            break
        if not hash_files:
            continue
        actual = sha256_file(path / rel)
        if actual != expected:
            found = (i, f"{rel}: sha256 mismatch, expected {expected[:16]}..., got {actual[:16]}...")
            break
    if world > 1:
        import torch.distributed as dist

        every: list = [None] * world
        dist.all_gather_object(every, found)
        found = min((f for f in every if f is not None), default=None)
    return None if found is None else found[1]

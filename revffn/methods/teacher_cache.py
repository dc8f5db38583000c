"""The cached distillation teacher (`revffn.distill_teacher: cached`): the unconverted model's final hidden states
for every training example, computed once before training and stored on disk, plus a frozen copy of the head.

`distill_coef` > 0 adds KL(original ‖ student) to the task loss in stage 2. The `copy` route keeps a frozen copy of
every weight (+1x weights on every rank) and runs it forward on each batch. The teacher's final hidden states
depend on the example alone (the original wiring, frozen weights, causal attention, right padding), so this route
computes them once per example, `data x d` values, and keeps only the head (V x d) to turn them into
log-probabilities: KL is then exactly what the copy route computes (`conversion.loss.distill_kl` with the head copy
as `teacher_head`; tests/methods/test_teacher_cache.py holds the two routes to 1e-6).

    directory/
      manifest.json          format, world size, d, dtype, the data's and the model's fingerprints (written last)
      hidden-r{rank}.safetensors   each rank's examples, (tokens, d), rows in the order of its index
      index-r{rank}.json     [sha1 of the example's token ids, first row, length] per example

Each process computes the examples `rank::world`, one at a time (under FSDP every rank runs as many forwards: they
are collective), writes its own file, and every process reads any example back through safetensors'
lazy slices: the directory must be shared by the ranks (one node, or a shared filesystem, as checkpoints).
A directory whose manifest names other data or another model is refused (exit 2, `revffn.teacher_cache`);
one without a manifest (a build that was cut short) is rebuilt.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from revffn.archs.spec import get_path
from revffn.conversion.teacher import teacher_hidden
from revffn.data.collate import data_shard
from revffn.errors import UserError
from revffn.progress import progress

FORMAT = "revffn-teacher-cache"
KEY = "revffn.teacher_cache"


def example_key(ids) -> str:
    """The sha1 of an example's token ids (int64): how a batch's rows find their hidden states."""
    return hashlib.sha1(torch.as_tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


def data_fingerprint(items: list) -> str:
    """sha256 over every example's token ids, in order: the data the cache was computed on."""
    h = hashlib.sha256()
    for ids, _ in items:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(torch.as_tensor(ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def check(path: Path, items: list, model_ref: str) -> dict | None:
    """None when `path` holds the cache of `items` and the model; the manifest to build otherwise (no manifest: none,
    or a build cut short). A cache of other data or another model, or a directory of other files, is a UserError
    naming `revffn.teacher_cache` (`training.setup.prepare_run` checks before the run writes anything)."""
    want = {"format": FORMAT, "data_sha256": data_fingerprint(items), "model": model_ref, "examples": len(items)}
    if path.exists() and not path.is_dir():
        raise UserError(f"{KEY}={str(path)!r} is a file, not a directory. Fix: point {KEY} at a new or empty "
                        "directory (or leave it empty for OUTPUT_DIR/teacher_cache).")
    if (path / "manifest.json").is_file():
        held = _read(path, lambda: json.loads((path / "manifest.json").read_text()))
        if not isinstance(held, dict):
            raise _damaged(path, f"manifest.json holds {type(held).__name__}, not the object a cache writes")
        for field in ("format", "model", "data_sha256"):
            if held.get(field) != want[field]:
                raise UserError(
                    f"{KEY}={str(path)!r}: the cached teacher was computed for another "
                    f"{'data set' if field == 'data_sha256' else field} ({field} {held.get(field)!r}, this run's "
                    f"{want[field]!r}). Fix: point {KEY} at a new directory, or delete {path} to recompute it.")
        _read(path, lambda: _rank_files(path, held))  # each rank's states and index open, before the run writes
        return None
    stray = [p.name for p in path.iterdir() if not p.name.startswith(("hidden-r", "index-r", "."))] \
        if path.is_dir() else []
    if stray:
        raise UserError(f"{KEY}={str(path)!r} holds files that are not a teacher cache ({', '.join(stray[:3])}). "
                        f"Fix: point {KEY} at a new or empty directory.")
    return want


def _rank_files(path: Path, manifest: dict) -> tuple[list, dict[str, tuple[int, int, int]]]:
    """The open states file of each rank the cache was built by, and the index: example key -> (rank, first row,
    length)."""
    files, index = [], {}
    for r in range(manifest["world"]):
        files.append(safe_open(str(path / f"hidden-r{r}.safetensors"), framework="pt"))
        for key, start, length in json.loads((path / f"index-r{r}.json").read_text()):
            index[key] = (r, start, length)
    return files, index


def _read(path: Path, read):
    """`read()`, a damaged or cut-short cache's error (unparseable JSON, a missing or garbled file) as the UserError
    naming it."""
    try:
        return read()
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise _damaged(path, f"{type(e).__name__}: {str(e)[:200]}") from None


def _damaged(path: Path, why: str) -> UserError:
    return UserError(f"{KEY}={str(path)!r}: the cached teacher is damaged ({why}). Fix: delete {path} to compute it "
                     f"again, or point {KEY} at a new directory.")


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


class TeacherCache:
    """Read side: `hidden(input_ids, attention_mask)` -> (B, T, d) on the batch's device, zeros on padding; `head`,
    the frozen copy of the LM head taken before training."""

    def __init__(self, path: Path, manifest: dict, head: nn.Module):
        self.path, self.manifest, self.head = path, manifest, head
        self.files, self.index = _read(path, lambda: _rank_files(path, manifest))  # (example key -> rank, row, length)

    @classmethod
    def open(cls, path: Path, model: nn.Module, items: list, model_ref: str) -> TeacherCache:
        """The cache at `path` for `items` (the tokenized training set): reused when its manifest matches the data
        and the model, built when there is none (`check`)."""
        want = check(path, items, model_ref)
        if want is None:
            from revffn.methods.calibration import log_line

            log_line(f"distill teacher: reusing the cached hidden states in {path}")
        else:
            _build(path, model, items, want)
        head = copy.deepcopy(get_path(model.hf, model.spec.head)).requires_grad_(False)
        return cls(path, json.loads((path / "manifest.json").read_text()), head)  # whole: the loop gathered the root

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        ids = input_ids.cpu()
        lengths = (attention_mask.sum(1) if attention_mask is not None else
                   torch.full((ids.shape[0],), ids.shape[1])).tolist()
        out = torch.zeros(*ids.shape, self.manifest["d"], dtype=getattr(torch, self.manifest["dtype"]))
        for row, n in enumerate(lengths):
            key = example_key(ids[row, :n])
            if key not in self.index:
                raise RuntimeError(f"a batch row ({n} tokens) is not in the teacher cache {self.path}: the cache "
                                   "holds the tokenized training set's examples only")
            r, start, length = self.index[key]
            out[row, :length] = self.files[r].get_slice("hidden")[start : start + length]
        return out.to(input_ids.device)


@torch.no_grad()
def _build(path: Path, model: nn.Module, items: list, manifest: dict) -> None:
    """Every process computes its examples (`rank::world`), one at a time: an example's hidden states are then a
    function of the example alone, bitwise the same whatever the world size (a batch's shape changes the kernels'
    rounding); under FSDP each forward is collective, so every rank runs as many. The main process writes the
    manifest once every rank has written its file and index."""
    rank, world = data_shard()
    path.mkdir(parents=True, exist_ok=True)
    n_forwards = math.ceil(len(items) / world)  # the same on every rank
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    chunks, index, row = [], [], 0
    with progress("distill teacher: caching hidden states", "example", n_forwards, disable=rank != 0) as bar:
        for k in range(n_forwards):
            i = rank + k * world
            ids = torch.tensor([items[min(i, len(items) - 1)][0]], device=device)  # an idle rank still joins in
            h = teacher_hidden(model, ids, torch.ones_like(ids))[0].cpu()
            if i < len(items):
                chunks.append(h)
                index.append((example_key(items[i][0]), row, len(h)))
                row += len(h)
            bar(k + 1, n_forwards)
    model.train(was_training)
    d = get_path(model.hf, model.spec.final_norm).weight.shape[-1]
    dtype = chunks[0].dtype if chunks else next(model.parameters()).dtype
    hidden = torch.cat(chunks) if chunks else torch.zeros(0, d, dtype=dtype)
    tmp = path / f".hidden-r{rank}.tmp"
    save_file({"hidden": hidden.contiguous()}, str(tmp))
    os.replace(tmp, path / f"hidden-r{rank}.safetensors")
    (path / f"index-r{rank}.json").write_text(json.dumps(index))
    _barrier()
    if rank == 0:
        full = {**manifest, "world": world, "d": d, "dtype": str(dtype).removeprefix("torch."),
                "tokens": sum(len(ids) for ids, _ in items)}
        tmp = path / ".manifest.tmp"
        tmp.write_text(json.dumps(full, indent=1))
        os.replace(tmp, path / "manifest.json")
    _barrier()

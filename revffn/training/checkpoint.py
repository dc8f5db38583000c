"""Checkpoints with exact resume, written atomically.

    checkpoints/step-N/
        model.safetensors     every parameter (safetensors: no pickled code)
        optimizer.pt          AdamW state (tensors and numbers only: loads with weights_only=True)
        dcp/                  instead of those two under FSDP: every rank's shards of both (DCP)
        rng.pt                CPU and CUDA RNG states
        trainer_state.json    step, data order position, method state (stage, queues), restarts
        config.yaml           the resolved config of the run
        manifest.json         sha256 of every file above, the math-relevant config, versions (manifest.py)

Under FSDP (`sharded=True`) the model and optimizer are saved by every rank, each its shards, with
torch.distributed.checkpoint (DCP) in `dcp/` instead of model.safetensors and optimizer.pt. DCP
reshards on load: such a checkpoint resumes on any number of processes, one included, under any
strategy.

A checkpoint is written to `checkpoints/.tmp-step-N` and renamed into place, so `step-N` exists
only when complete; a `kill -9` mid-write leaves a `.tmp-*` that is ignored and cleaned up. The
manifest is written last: `newest_verified` resumes the newest checkpoint whose files all match it.

Nothing here unpickles an arbitrary object: model.safetensors is safetensors, optimizer.pt and rng.pt
load with `weights_only=True`, and DCP's own pickles (its `.metadata`, the optimizer's non-tensor
entries) load through an allow-list (`_SafeReader`, `_WeightsOnlyPlanner`): torch's DCP reader uses
plain `pickle.load`, which runs whatever code a file names.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import resource
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_model, save_model
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from revffn.errors import DiskFull, UserError, disk_fault, one_line
from revffn.schema import shown
from revffn.training.manifest import verify_checkpoint, write_manifest
from revffn.training.parallel import barrier, is_main_process

_STEP = re.compile(r"^step-(\d+)$")
DCP_DIR = "dcp"  # a sharded checkpoint's model and optimizer (torch.distributed.checkpoint)


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def newest_verified(run_dir: Path, shard: tuple[int, int] = (0, 1),
                    hash_files: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint whose files match its manifest, or None; [(each newer one, its problem)]):
    what every resume of a run starts from, `resume=true` and restarts alike. `shard`, `hash_files`:
    `verify_checkpoint`'s."""
    rejected = []
    for path in reversed(checkpoint_dirs(run_dir)):
        problem = verify_checkpoint(path, shard, hash_files)
        if problem is None:
            return path, rejected
        rejected.append((path, problem))
    return None, rejected


def rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model, optimizer, trainer_state: dict, config_text: str,
                    math_config: dict, keep: int, fault=None, sharded: bool = False) -> Path:
    """Write checkpoints/step-{step} atomically, its manifest last, then delete all but the newest
    `keep`. Called by the one process that holds the whole model, or with `sharded` by every rank
    (rank 0 does the rest). `math_config`: `config.math_config` of the run, kept in the manifest."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    main = is_main_process()
    if main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    with disk_guard(f"checkpoint step-{step}", root, lambda: state_bytes(model, optimizer), tmp if main else None):
        _write_checkpoint(root, final, tmp, step, model, optimizer, trainer_state, config_text, math_config, keep,
                          fault, sharded, main)
    return final


def state_bytes(model, optimizer=None) -> int:
    """The bytes of the model's tensors and the optimizer's state: what a checkpoint writes, about."""
    tensors = list(model.state_dict().values())
    if optimizer is not None:
        tensors += [v for st in optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


@contextlib.contextmanager
def disk_guard(what: str, where: Path, needed, partial: Path | None = None):
    """A write of `what` in directory `where` that the disk refuses (no space, the file-size limit, a quota:
    `disk_fault`) becomes one `DiskFull` line, exit 1, with `partial` (what was written of it) removed; `needed()`
    estimates the bytes it needs."""
    try:
        yield
    except Exception as e:
        why = disk_fault(e)
        if why is None:
            raise
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        free = shutil.disk_usage(where).free
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        cap = "" if limit == resource.RLIM_INFINITY else f", and files are limited to {limit:,} bytes (ulimit -f)"
        raise DiskFull(f"cannot write {what} in {str(where)!r}: {why}. It needs about {needed():,} bytes; "
                       f"{free:,} are free{cap}. The partial write is removed; what was saved before is kept. Fix: "
                       "free disk space (or raise the limit), then resume=true.") from None


def _write_checkpoint(root, final, tmp, step, model, optimizer, trainer_state, config_text, math_config, keep,
                      fault, sharded, main) -> None:
    if sharded:
        barrier()  # tmp exists before any rank writes into it
        dcp.save(_dcp_state(model, optimizer), checkpoint_id=str(tmp / DCP_DIR))
    else:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if fault is not None:
        fault("save", step)  # tests: die in the middle of a checkpoint write
    if sharded:
        barrier()  # every shard written
    if main:
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        (tmp / "config.yaml").write_text(config_text)
        write_manifest(tmp, math_config)  # after every shard: it hashes them
        if final.exists():  # a re-run of the same step after a restart
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in checkpoint_dirs(root.parent)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def _dcp_state(model, optimizer) -> dict:
    """{"model", "optimizer"} state dicts keyed by parameter name, as DCP saves and loads them
    (sharded or whole: `get_state_dict` reads either)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP `.metadata` and refuses every global but the classes such a file holds."""

    MODULES = {"torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                                         "TensorStorageMetadata", "BytesStorageMetadata",
                                                         "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
               "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
               "torch.serialization": {"_get_layout"},  # a layout by name
               "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
               "collections": {"OrderedDict"}}

    def find_class(self, module: str, name: str):
        if name in self.MODULES.get(module, ()) or (
                module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which a checkpoint does not hold")


class _SafeReader(dcp.FileSystemReader):
    """torch's DCP file reader, its `.metadata` unpickled through `_MetadataUnpickler` (torch 2.13's
    `read_metadata` with the one call changed)."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor entries (the optimizer's hyperparameters) loaded
    with `weights_only=True` (torch's planner loads them with `weights_only=False`)."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def is_sharded_checkpoint(path: Path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def clean_partial(run_dir: Path) -> None:
    root = Path(run_dir) / "checkpoints"
    if root.is_dir():
        for p in root.glob(".tmp-step-*"):
            shutil.rmtree(p, ignore_errors=True)


def read_trainer_state(path: Path) -> dict:
    f = Path(path) / "trainer_state.json"
    if not f.is_file():
        raise UserError(f"resume: {str(path)!r} is not a checkpoint (no trainer_state.json). Fix: point resume at "
                        "a checkpoints/step-N directory, or use resume=true for the latest one.")
    try:
        state = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"resume: {str(f)!r} is not a trainer state ({one_line(e)}): the checkpoint is damaged. Fix: "
                        "resume from an earlier checkpoints/step-N, or start a new run.") from None
    if not isinstance(state, dict) or "step" not in state:
        raise UserError(f"resume: {str(f)!r} holds no step: not a revffn checkpoint. Fix: point resume at a "
                        "checkpoints/step-N directory, or use resume=true for the latest one.")
    if isinstance(state["step"], bool) or not isinstance(state["step"], int) or state["step"] < 0:
        raise UserError(f"resume: {str(f)!r} holds step {shown(state['step'])}, not a step count: the checkpoint is "
                        "damaged. Fix: resume from an earlier checkpoints/step-N, or start a new run.")
    return state


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore model, optimizer and RNG from `path` (verified: `newest_verified`, or
    `manifest.verify_checkpoint`); returns the trainer state."""
    path = Path(path)
    state = read_trainer_state(path)
    if is_sharded_checkpoint(path):
        loaded = _dcp_state(model, optimizer)
        prefix = "optimizer.state."  # DCP's flat keys: optimizer.state.{parameter name}.{state name}
        saved = {k[len(prefix):].rsplit(".", 1)[0]
                 for k in _SafeReader(str(path / DCP_DIR)).read_metadata().state_dict_metadata if k.startswith(prefix)}
        # `get_state_dict` gives every parameter that requires grad an optimizer state to load into;
        # the checkpoint holds those of the parameters trained so far (RevFFN's stage 1: the adapters)
        states = loaded["optimizer"]["state"]
        for name in [n for n in states if n not in saved]:
            del states[name]
        dcp.load(loaded, storage_reader=_SafeReader(str(path / DCP_DIR)), planner=_WeightsOnlyPlanner())
        set_model_state_dict(model, loaded["model"])
        set_optimizer_state_dict(model, optimizer, loaded["optimizer"], options=StateDictOptions(strict=False))
    else:
        load_model(model, str(path / "model.safetensors"))
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return state

"""Sharded loading under FSDP2: no rank ever holds the whole model.

    meta_hf(model)      the HF model (or the converted model) with its parameters on the meta device, buffers real
    (the method converts it, still on meta; the loop shards it: `training.step.build_run`)
    materialize(model)  each rank allocates its own shards (advised into huge pages) and gets its buffers back
    load_shards(hf)     each rank fills its shards from the safetensors, one layer at a time
    mark_unloaded       what it did not fill is NaN-filled, for the method's `after_load` (`check_loaded`)

The route: every rank reads the checkpoint itself and keeps only its rows. The other standard route, rank 0
reading and broadcasting (`set_model_state_dict(..., broadcast_from_rank0=True)`), has rank 0 hold the whole
model on its host, so that its peak is the unsharded one; here each rank's peak is its shards (plus one tensor's
rows in a host buffer where the checkpoint's dtype is another or the shards are on a GPU; FSDP2 shards the fused
experts by rows, expert by expert, so a rank reads only its own experts). The files are read through `pread`, not
`mmap`: the page cache is shared by the ranks of a node, and no page of the file counts in a rank's resident
memory.

An HF checkpoint's keys become the model's through transformers' own renaming (`core_model_loading`). A tensor
transformers only renames is read by rows, each rank its own, straight into its shard (one copy from the page
cache; no NaN-fill first, and no scan after: `mark_unloaded` fills only what the checkpoint lacks). Per-expert
tensors that transformers' converter only stacks into the fused 3-D experts (every MoE arch it fuses: gate and
up one above the other) are read straight into the rows of the experts the rank holds (`_read_experts`); any other
conversion runs through transformers on a second, meta-device copy of the model (with as many experts as the rank
holds, numbered from 0), one layer's tensors at a time. Either way the result is bitwise what `from_pretrained`
loads. A converted directory (`revffn convert`, a run's final/) holds the model's own parameter names: there each
rank reads only its rows of each tensor, and the result is bitwise what `models.loading.load` loads.

Measured (docs/multi_gpu.md: `revffn bench --model builtin:smollm2-moe --methods full,revffn --nproc 2`, 2 CPU
cores): reading through `safe_open`, stacking, NaN-filling and scanning made a rank's start-up 3.0-3.4 s; read
straight into the shards it is 0.65-0.77 s of work, of which 0.42 s is the read itself.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import json
import math
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from revffn.conversion.convert import local_rows, write_full
from revffn.models.loading import (
    converted_skeleton,
    freeze_imports,
    hf_config,
    is_converted,
    model_kind,
    resolve_model_ref,
    stored_config,
    stored_depth_config,
)

LAYER_KEY = re.compile(r"\.layers\.(\d+)\.")
EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")


def sharded_loadable(model: str, overrides: dict | None = None) -> bool:
    """Whether `model` loads shard by shard: an HF directory (shipped, cached, local or a Hub snapshot) with
    safetensors weights, its geometry unchanged but for its depth, or a converted directory (`revffn convert`, a
    run's final/) as it is. Tiny presets and config-only geometries are random-initialized: they load whole."""
    if model_kind(model) not in ("shipped", "dir", "hub") or "hidden_size" in (overrides or {}):
        return False
    path = Path(resolve_model_ref(model))
    if is_converted(str(path)):
        return not overrides and (path / "model.safetensors").is_file()
    return any(path.glob("*.safetensors"))


def _meta_model(config, dtype: torch.dtype) -> nn.Module:
    """The HF causal LM of `config`, its parameters on the meta device, its buffers (rotary frequencies) real. Its
    weight initialization is skipped (transformers' `no_init_weights`): on meta it computes nothing, yet its meta
    `normal_` calls cost a rank 0.14 s of start-up on builtin:smollm2-moe, and every arch's buffers come out
    the same without it (tests/models/test_sharded.py)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers: initialized as the model is
        no_init_weights = contextlib.nullcontext
    with init_empty_weights(include_buffers=False), no_init_weights():
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf.tie_weights()  # the meta parameters were made anew, each on its own: tie them again
    return hf


def meta_hf(model: str, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """`model`'s HF causal LM as `load_hf` builds it, but with no weights: parameters on the meta device (for a
    converted directory, the `RevFFNForCausalLM` it holds; a tiny preset or a config-only geometry from its config)."""
    freeze_imports()
    if model_kind(model) in ("tiny", "config"):
        return _meta_model(hf_config(model, **overrides), dtype)
    path = Path(resolve_model_ref(model))
    if is_converted(str(path)):
        return converted_skeleton(path, _meta_model(stored_config(path), dtype))
    return _meta_model(stored_depth_config(path, **overrides), dtype)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate every (sharded) parameter of a meta-device `model` on `device`, its values left as allocated
    (`load_shards` fills them; `mark_unloaded` NaN-fills the rest); its buffers, real since `meta_hf`, keep
    their values."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    if meta := [name for name, b in buffers.items() if b.is_meta]:
        raise RuntimeError(f"sharded loading: buffers {meta} were built on the meta device and have no value")
    tied: dict[int, list[str]] = {}  # a tied head and embedding: one parameter under two names
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(p), []).append(name)
    model.to_empty(device=device)
    for first, *others in (names for names in tied.values() if len(names) > 1):
        shared = model.get_parameter(first)  # to_empty makes one per name on an unsharded model (FSDP2 keeps one)
        for name in others:
            owner, _, attr = name.rpartition(".")
            if model.get_parameter(name) is not shared:
                setattr(model.get_submodule(owner), attr, shared)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    for p in {id(p): p for p in model.parameters()}.values():  # untouched yet: `load_shards` writes each page once
        huge_pages(local(p))


_HUGE = 2 << 20  # a transparent huge page on x86-64 (and arm64 with 4 KiB base pages)
_MADV_HUGEPAGE = 14


def huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back the whole 2 MiB pages inside `t`'s host memory with transparent huge pages
    (`madvise(MADV_HUGEPAGE)`; it changes nothing where `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or
    `never`, or off Linux). Only pages not yet touched are affected: the first write into a fresh shard then faults
    once every 2 MiB instead of every 4 KiB. Reading a rank's 0.75 GB of `builtin:smollm2-moe` took 0.36-0.47 s
    with it against 0.65 s without (2 CPU cores). Where the host takes free 2 MiB blocks back (a VM's free page
    reporting) a huge page must be backed again: there the first such read in a process took 1.0-1.8 s against
    0.40-0.46 s (`scripts/fresh_memory.py`, docs/multi_gpu.md). Whether the advice was taken."""
    nbytes = t.numel() * t.element_size()
    start = -(-t.data_ptr() // _HUGE) * _HUGE
    end = (t.data_ptr() + nbytes) // _HUGE * _HUGE
    libc = _libc()
    if t.device.type != "cpu" or not t.is_contiguous() or end <= start or libc is None:  # only memory `t` spans
        return False
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, or `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _groups(stored: dict[Path, _Stored]) -> list[tuple[int, dict[Path, list[str]]]]:
    """(layer, {file: keys}) per layer, -1 (the keys outside the layers) first: one layer is converted at a time,
    whichever files of a sharded checkpoint hold its tensors."""
    groups: dict[int, dict[Path, list[str]]] = defaultdict(lambda: defaultdict(list))
    for file, f in stored.items():
        for key in f.keys():
            m = LAYER_KEY.search(key)
            groups[int(m.group(1)) if m else -1][file].append(key)
    return sorted(groups.items(), key=lambda kv: kv[0])


def _open(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt", device="cpu", backend="pread")  # safetensors >= 0.7: no mmap
    except TypeError:
        return safe_open(file, framework="pt", device="cpu")


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class _Stored:
    """One safetensors file's header (each key's dtype, shape and byte range): a tensor, or rows of it, read
    straight into a rank's shard (`os.preadv` into its memory). That is one copy from the page cache; reading
    through `safe_open` and copying into the shard makes two, and stacking per-expert tensors (transformers'
    converter) three."""

    def __init__(self, file: Path):
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self.file, self.start, self.header = file, 8 + size, header
        self.fd: int | None = None
        self.opened = None  # `safe_open`'s handle, for what is not read directly

    def __enter__(self) -> _Stored:
        self.fd = os.open(self.file, os.O_RDONLY)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
        if self.opened is not None:
            self.opened.__exit__(None, None, None)
        self.fd = self.opened = None

    def keys(self) -> list[str]:
        return sorted(self.header)  # as `safe_open` lists them

    @property
    def f(self):
        """The file through `safe_open` (opened on first use)."""
        if self.opened is None:
            self.opened = _open(self.file).__enter__()
        return self.opened

    def shape(self, key: str) -> list[int]:
        return self.header[key]["shape"]

    def fits(self, key: str, dest: torch.Tensor, rows: slice | None = None) -> bool:
        """Whether `read_into(key, dest, rows)` can read it: `dest` contiguous, of the stored shape (of `rows` of
        it), of a floating dtype where the stored one is (the cast `from_pretrained` makes), else the same."""
        info = self.header[key]
        shape, stored = info["shape"], _DTYPES.get(info["dtype"])
        if not shape or stored is None or not dest.is_contiguous() or (
                stored != dest.dtype and not (stored.is_floating_point and dest.dtype.is_floating_point)):
            return False
        rows = rows or slice(0, shape[0])
        return list(dest.shape) == [rows.stop - rows.start, *shape[1:]]

    def read_into(self, key: str, dest: torch.Tensor, rows: slice | None = None) -> None:
        """dest <- the stored tensor `key`, or its `rows` (`fits` must hold): read into `dest` itself, or, stored
        in another dtype or `dest` on an accelerator, into a host buffer copied (and cast) into `dest`."""
        if dest.numel() == 0:
            return
        info = self.header[key]
        stored, dest = _DTYPES[info["dtype"]], dest.detach()
        cast = stored != dest.dtype or dest.device.type != "cpu"
        into = torch.empty(dest.shape, dtype=stored, pin_memory=dest.device.type == "cuda") if cast else dest
        row_bytes = into.element_size() * math.prod(info["shape"][1:])
        offset = self.start + info["data_offsets"][0] + (rows.start if rows else 0) * row_bytes
        self._pread(key, into, offset)
        if cast:
            dest.copy_(into)

    def _pread(self, key: str, into: torch.Tensor, offset: int) -> None:
        view = memoryview(into.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{self.file}: {key} ends {len(view) - done} bytes early")
            done += got


def _stacking(mapping: list) -> dict[str, tuple[int, int]]:
    """source pattern -> (its place, the number of patterns) of transformers' converters that stack per-expert
    2-D tensors into fused experts (`MergeModulelist(dim=0)`, then maybe `Concatenate(dim=1)`: gate and up
    projections one above the other), the layout that `_read_experts` reads into directly; every MoE arch that
    transformers 5 fuses is so."""
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    out = {}
    for t in mapping:
        ops = getattr(t, "operations", [])
        if isinstance(t, WeightConverter) and ops and type(ops[0]) is MergeModulelist and ops[0].dim == 0 and (
                len(ops) == 1 or (len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim == 1)):
            if len(ops) == 1 and len(t.source_patterns) != 1:
                continue
            out.update((pattern, (i, len(t.source_patterns))) for i, pattern in enumerate(t.source_patterns))
    return out


def _read_experts(where: dict[Path, list[str]], rename, stacking: dict, slots: dict, held: slice, fused: set,
                  stored: dict[Path, _Stored]) -> set[str] | None:
    """A layer's per-expert tensors (`where`: only this rank's experts, `held` its rows of the fused experts) read
    straight into the fused shards: expert e's j-th tensor into rows e - held.start, at the offset of the tensors
    before it. Returns the fused parameters' names; None, having read nothing, where a key is not so stacked (no
    arch transformers 5 fuses has another converter in a layer with per-expert tensors), a shape differs or a dtype
    cannot be cast, or the keys do not fill every row held (the converter's route then, for the whole layer)."""
    plan, parts = [], defaultdict(dict)  # parts: fused name -> {(expert, place): (file, key)}
    for file, keys in where.items():
        for key in keys:
            name, pattern = rename(key)
            m = EXPERT_KEY.search(key)
            if m is None or pattern not in stacking or name not in fused:
                return None
            parts[name][int(m.group(1)), stacking[pattern][0]] = (file, key)
    for name, found in parts.items():
        shard = local(_slot(slots, name))
        count = next(stacking[rename(key)[1]][1] for _, key in found.values())
        if set(found) != {(e, j) for e in range(held.start, held.stop) for j in range(count)}:
            return None
        heights = [stored[found[held.start, j][0]].shape(found[held.start, j][1])[0] for j in range(count)]
        if shard.dim() < 2 or shard.shape[0] != held.stop - held.start or shard.shape[1] != sum(heights):
            return None
        for (e, j), (file, key) in found.items():
            dest = shard[e - held.start].narrow(0, sum(heights[:j]), heights[j])
            if not stored[file].fits(key, dest):
                return None
            plan.append((stored[file], key, dest))
    with torch.no_grad():
        for source, key, dest in plan:
            source.read_into(key, dest)
    return set(parts)


def _read(where: dict[Path, list[str]], stored: dict[Path, _Stored], first_expert: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of `where` ({file: keys}), expert i's keyed as expert i - `first_expert`."""
    def key(k: str) -> str:
        return EXPERT_KEY.sub(lambda m: f".experts.{int(m.group(1)) - first_expert}.", k, 1) if first_expert else k

    return {key(k): stored[file].f.get_tensor(k) for file, keys in where.items() for k in keys}


def parameter_slots(hf: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """name -> (module, attribute) of each of `hf`'s parameters, tied ones under each name, and of its persistent
    buffers (those a checkpoint holds, e.g. a router's `e_score_correction_bias`; `from_pretrained` loads them):
    where `load_shards` finds them once the method has rearranged the modules (RevFFN's blocks hold the decoder
    layers) and FSDP2 has replaced the parameters (by DTensors, on the same modules)."""
    return {f"{prefix}{'.' if prefix else ''}{attr}": (module, attr)
            for prefix, module in hf.named_modules(remove_duplicate=False)
            for attr in (*module._parameters, *(b for b in module._buffers
                                               if b not in module._non_persistent_buffers_set))}


def _slot(slots: dict[str, tuple[nn.Module, str]], name: str) -> torch.Tensor:
    """The tensor the model holds now under `name`: the parameter (a DTensor once sharded) or the buffer."""
    module, attr = slots[name]
    return module._parameters[attr] if attr in module._parameters else module._buffers[attr]


def _copy_rows(stored: _Stored, key: str, param: torch.Tensor) -> None:
    """param <- the stored tensor `key`, reading only this rank's rows of it where `param` is sharded by rows, the
    whole tensor otherwise: straight into the shard where it `fits`, else through `safe_open`."""
    shape = stored.shape(key)
    rows = local_rows(param) if shape and shape[0] == param.shape[0] else None
    dest = local(param) if rows is not None or not hasattr(param, "to_local") else None
    if dest is not None and stored.fits(key, dest, rows):
        stored.read_into(key, dest, rows)
    elif rows is None:
        write_full(param, stored.f.get_tensor(key))
    elif rows.stop > rows.start:  # (a rank past the last row holds nothing of it)
        local(param).copy_(stored.f.get_slice(key)[rows])


def _load_rows(slots: dict[str, tuple[nn.Module, str]], where: dict[Path, list[tuple[str, str]]],
               stored: dict[Path, _Stored]) -> set[str]:
    """Tensors stored as the model holds them ({file: [(key, parameter name)]}): each rank reads only its rows.
    Returns the names written."""
    with torch.no_grad():
        for file, keys in where.items():
            for key, name in keys:
                _copy_rows(stored[file], key, _slot(slots, name))
    return {name for keys in where.values() for _, name in keys}


def conversion(hf: nn.Module) -> tuple[list, str] | None:
    """transformers' conversion mapping of the meta HF model `hf` (`meta_hf`) and its `base_model_prefix`, taken
    before the method rearranges its modules; None for a converted model (its keys are its own). With it,
    `load_shards` builds no copy of the model unless a layer needs transformers' converter."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping

    return (get_model_conversion_mapping(hf), hf.base_model_prefix) if isinstance(hf, PreTrainedModel) else None


def _renamer(mapping: list, prefix: str, slots: dict):
    """key -> (the model's name for it, the converter's source pattern or None): transformers' renaming of a
    checkpoint key (`rename_source_key`) by `mapping`, the model's names (`slots`: its meta state dict's keys)
    deciding whether `prefix` (its `base_model_prefix`) is added or dropped."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    return lambda key: rename_source_key(key, renamings, converters, prefix, slots)


def _direct(keys: dict[Path, list[str]], rename, slots: dict) -> tuple[dict, dict]:
    """({file: [(key, parameter name)]} of the keys transformers only renames, if at all, {file: [key]} of the keys
    a converter combines (per-expert tensors stacked into fused experts)."""
    direct: dict[Path, list[tuple[str, str]]] = defaultdict(list)
    rest: dict[Path, list[str]] = defaultdict(list)
    for file, names in keys.items():
        for key in names:
            name, combined = rename(key)
            if combined is None and name in slots:
                direct[file].append((key, name))
            else:
                rest[file].append(key)
    return direct, rest


def _own_experts(rest: dict[Path, list[str]], rename, slots: dict):
    """A layer's per-expert tensors cut to the experts this rank holds: FSDP2 shards the fused experts (E, ...) by
    rows, one expert a row, so a rank needs only its own experts' tensors, not all E. Returns ({file: keys} with
    the other experts' keys left out, the rows held, the fused parameters' names), or (rest, None, ()) where the
    fused experts are not sharded by experts (one process, or not FSDP's row split): then every key is read."""
    held, fused, experts = None, set(), set()
    for keys in rest.values():
        for key in keys:
            if (m := EXPERT_KEY.search(key)) is None:
                continue
            name, _ = rename(key)
            # an expert's tensor that stays one expert's (a converter within it) is no row of fused experts
            rows = local_rows(_slot(slots, name)) if name in slots and not EXPERT_KEY.search(name) else None
            if rows is None or held not in (None, rows):
                return rest, None, ()
            held = rows
            fused.add(name)
            experts.add(int(m.group(1)))
    # one row an expert: as many rows in each fused tensor as the layer has experts, numbered 0..E-1
    if held is None or any(_slot(slots, name).shape[0] != len(experts) for name in fused) \
            or experts != set(range(len(experts))):
        return rest, None, ()
    mine = {file: [k for k in keys if (m := EXPERT_KEY.search(k)) is None or held.start <= int(m.group(1)) < held.stop]
            for file, keys in rest.items()}
    return mine, held, fused


def _fewer_experts(config, total: int, held: int):
    """`config` with `held` experts instead of `total` (its MoE's count key, whichever the arch's spec names:
    `ArchSpec.num_experts_keys`), None where no such key holds `total`: the scratch copy onto which transformers
    stacks the experts a rank read, as rows 0..held-1."""
    from revffn.archs.architectures import ARCHITECTURES
    from revffn.archs.spec import ArchSpec, config_value, set_config_value

    spec = ARCHITECTURES.get(getattr(config, "model_type", None))
    keys = [k for k in (spec.num_experts_keys if spec else ArchSpec.num_experts_keys)
            if config_value(config, k) == total]
    if not keys:
        return None
    config = copy.deepcopy(config)
    for key in keys:
        set_config_value(config, key, held)
    return config


def _expert_scratch(config, dtype: torch.dtype, fused: dict[str, torch.Size], held: int) -> nn.Module | None:
    """A meta copy of the model with `held` experts, or None where the arch does not build one whose fused experts
    are `fused`'s ({name: whole shape}) with `held` rows (its count key unknown; or, as Jamba's with 1 expert, a
    layer of another kind): the experts are then all read, as one process reads them."""
    fewer = _fewer_experts(config, next(iter(fused.values()))[0], held)
    if fewer is None:
        return None
    scratch = _meta_model(fewer, dtype)
    shapes = {name: p.shape for name, p in scratch.named_parameters(remove_duplicate=False)}
    ok = all(shapes.get(name) == torch.Size((held, *shape[1:])) for name, shape in fused.items())
    return scratch if ok else None


def load_shards(slots: dict[str, tuple[nn.Module, str]], config, model: str, dtype: torch.dtype,
                mapping: tuple[list, str] | None = None) -> set[str]:
    """Fill the (sharded, materialized) parameters in `slots` (`parameter_slots` of the HF model of `config`) from
    `model`'s safetensors, each rank its own rows. Returns the names written (`mark_unloaded`).

    A tensor transformers only renames (if at all) is read by rows, each rank its own, straight into its shard
    (cast there where the checkpoint's dtype is another, as `from_pretrained` casts). A layer's per-expert tensors
    (only the experts whose rows of the fused experts this rank holds) are read straight into those rows where
    transformers' converter only stacks them (`_read_experts`). Any other converted tensors of a layer are read
    whole and converted by transformers onto a meta copy of the model (`scratch`), whose loaded parameters are then
    copied into the shards (cut into them where a converted tensor is not one of a rank's own) and dropped. Layers
    beyond the model's depth (`num_hidden_layers` overridden) are skipped, as `from_pretrained` drops them.
    `mapping`: `conversion` of the meta model (else taken from a scratch copy)."""
    path = Path(resolve_model_ref(model))
    with contextlib.ExitStack() as files:
        if is_converted(str(path)):
            stored = {path / "model.safetensors": files.enter_context(_Stored(path / "model.safetensors"))}
            return _load_rows(slots, {file: [(k, k) for k in f.keys()] for file, f in stored.items()}, stored)
        stored = {file: files.enter_context(_Stored(file)) for file in sorted(path.glob("*.safetensors"))}
        return _convert_shards(slots, config, dtype, stored, mapping)


def _convert_shards(slots: dict[str, tuple[nn.Module, str]], config, dtype: torch.dtype,
                    stored: dict[Path, _Stored], mapping: tuple[list, str] | None) -> set[str]:
    """`load_shards` of an HF checkpoint (`stored`: its open files), its keys renamed and converted as
    transformers converts them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    scratch = None if mapping else _meta_model(config, dtype)
    scratches = {}  # the number of experts a rank holds -> a scratch copy with that many
    mapping, prefix = mapping or (get_model_conversion_mapping(scratch), scratch.base_model_prefix)
    rename, stacking = _renamer(mapping, prefix, slots), _stacking(mapping)
    load_config = LoadStateDictConfig(dtype=dtype, weight_mapping=mapping)
    depth = config.num_hidden_layers
    written: set[str] = set()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar per layer otherwise
    try:
        for layer, where in _groups(stored):
            if layer >= depth:
                continue
            direct, where = _direct(where, rename, slots)
            written |= _load_rows(slots, direct, stored)
            if not where:
                continue
            mine, held, fused = _own_experts(where, rename, slots)
            if held is not None and held.stop > held.start:
                done = _read_experts(mine, rename, stacking, slots, held, fused, stored)
                if done is not None:
                    written |= done
                    continue
            if scratch is None:  # a copy of the model for transformers' converter to load onto
                scratch = _meta_model(config, dtype)
            target = scratch  # a rank holding no expert reads none, and converts the rest onto the whole scratch
            if held is not None and held.stop > held.start:
                count = held.stop - held.start
                if count not in scratches:
                    shapes = {name: _slot(slots, name).shape for name in fused}
                    whole = next(iter(shapes.values()))[0] == count
                    scratches[count] = scratch if whole else _expert_scratch(config, dtype, shapes, count)
                target = scratches[count]
                if target is None:  # the arch names its expert count otherwise: every expert read, as one process
                    mine, held, fused, target = where, None, (), scratch
            tensors = _read(mine, stored, first_expert=held.start if held is not None else 0)
            convert_and_load_state_dict_in_model(target, tensors, load_config)
            with torch.no_grad():
                for name, p in target.named_parameters(remove_duplicate=False):
                    if not p.is_meta:
                        if name in fused:  # already this rank's rows
                            local(_slot(slots, name)).copy_(p)
                        else:
                            write_full(_slot(slots, name), p)
                        written.add(name)
                        owner, _, attr = name.rpartition(".")
                        module = target.get_submodule(owner)
                        module._parameters[attr] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return written


def mark_unloaded(model: nn.Module, slots: dict[str, tuple[nn.Module, str]], written: set[str]) -> list[str]:
    """NaN-fill `model`'s parameters that `load_shards` did not write (`written`), and return their names: the
    method's `after_load` must set them (`check_loaded`). The loaded ones are not filled first: filling the whole
    model costs a pass over every shard for nothing."""
    loaded = {id(_slot(slots, name)) for name in written}
    pending = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) not in loaded:
                local(p).fill_(float("nan"))
                pending.append(name)
    return pending


def check_loaded(model: nn.Module, names: list[str]) -> None:
    """Every parameter of `names` (those `mark_unloaded` NaN-filled) holds a value: one the checkpoint and the
    method's `after_load` left out is an error, not silent garbage."""
    chosen = set(names)
    missing = [name for name, p in model.named_parameters() if name in chosen and local(p).isnan().any()]
    if missing:
        raise RuntimeError(f"sharded loading left {len(missing)} parameter(s) without a value: "
                           f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")

"""Sharded loading under FSDP2: no rank ever holds the whole model.

    meta_hf(model)      the HF model (or the converted model) with its parameters on the meta device, buffers real
    (the method converts it, still on meta; the loop shards it: `training.step.build_run`)
    materialize(model)  each rank allocates its own shards, NaN-filled, and gets its buffers back
    load_shards(hf)     each rank fills its shards from the safetensors, one layer at a time

The route: every rank reads the checkpoint itself and keeps only its rows. The other standard route, rank 0
reading and broadcasting (`set_model_state_dict(..., broadcast_from_rank0=True)`), has rank 0 hold the whole
model on its host, so that its peak is the unsharded one; here each rank's peak is its shards plus one layer's
experts of its own, read whole (transformers stacks them from per-expert tensors into the fused experts, which
FSDP2 shards by rows: expert by expert). The files are read through `pread`, not `mmap`: the page cache is shared
by the ranks of a node, and no page of the file counts in a rank's resident memory.

An HF checkpoint's keys become the model's through transformers' own conversion (`core_model_loading`: renames,
and per-expert tensors stacked into the fused 3-D experts), applied to one layer's tensors at a time on a second,
meta-device copy of the model (with as many experts as the rank holds, numbered from 0); the result is bitwise
what `from_pretrained` loads. A tensor transformers only renames is read by rows, each rank its own. A converted
directory (`revffn convert`, a run's final/) holds the model's own parameter names: there each rank reads only its
rows of each tensor, and the result is bitwise what `models.loading.load` loads.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch import nn

from revffn.conversion.convert import local_rows, write_full
from revffn.models.loading import (
    converted_skeleton,
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


def _meta_model(config, dtype: torch.dtype, scratch: bool = False) -> nn.Module:
    """The HF causal LM of `config`, its parameters on the meta device, its buffers (rotary frequencies) real.
    `scratch`: only a target for transformers' key conversion (`load_shards`), so its initialization is skipped
    (transformers' `no_init_weights`; on meta it computes nothing, but walks every module)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an older transformers: initialized as the model is
        no_init_weights = contextlib.nullcontext
    with init_empty_weights(include_buffers=False), no_init_weights() if scratch else contextlib.nullcontext():
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    hf.tie_weights()  # the meta parameters were made anew, each on its own: tie them again
    return hf


def meta_hf(model: str, dtype: torch.dtype = torch.float32, **overrides) -> nn.Module:
    """`model`'s HF causal LM as `load_hf` builds it, but with no weights: parameters on the meta device (for a
    converted directory, the `RevFFNForCausalLM` it holds)."""
    path = Path(resolve_model_ref(model))
    if is_converted(str(path)):
        return converted_skeleton(path, _meta_model(stored_config(path), dtype))
    return _meta_model(stored_depth_config(path, **overrides), dtype)


def materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate every (sharded) parameter of a meta-device `model` on `device`, filled with NaN so that one that is
    never loaded shows (`check_loaded`); its buffers, real since `meta_hf`, keep their values."""
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
        for p in model.parameters():
            local(p).fill_(float("nan"))
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, or `t` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _groups(files: list[Path]) -> list[tuple[int, dict[Path, list[str]]]]:
    """(layer, {file: keys}) per layer, -1 (the keys outside the layers) first: one layer is converted at a time,
    whichever files of a sharded checkpoint hold its tensors."""
    from safetensors import safe_open

    groups: dict[int, dict[Path, list[str]]] = defaultdict(lambda: defaultdict(list))
    for file in files:
        with safe_open(file, framework="pt") as f:
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


def _read(where: dict[Path, list[str]], first_expert: int = 0) -> dict[str, torch.Tensor]:
    """The tensors of `where` ({file: keys}), expert i's keyed as expert i - `first_expert`."""
    def key(k: str) -> str:
        return EXPERT_KEY.sub(lambda m: f".experts.{int(m.group(1)) - first_expert}.", k, 1) if first_expert else k

    tensors = {}
    for file, keys in where.items():
        with _open(file) as f:
            tensors.update((key(k), f.get_tensor(k)) for k in keys)
    return tensors


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


def _copy_rows(f, key: str, param: torch.Tensor) -> None:
    """param <- the tensor `key` of the open file `f`, reading only this rank's rows of it where `param` is sharded
    by rows (`get_slice`), the whole tensor otherwise."""
    piece = f.get_slice(key)
    shape = piece.get_shape()
    rows = local_rows(param) if shape and shape[0] == param.shape[0] else None
    if rows is None:
        write_full(param, f.get_tensor(key))
    elif rows.stop > rows.start:  # (a rank past the last row holds nothing of it)
        local(param).copy_(piece[rows])


def _load_rows(slots: dict[str, tuple[nn.Module, str]], where: dict[Path, list[tuple[str, str]]]) -> None:
    """Tensors stored as the model holds them ({file: [(key, parameter name)]}): each rank reads only its rows."""
    with torch.no_grad():
        for file, keys in where.items():
            with _open(file) as f:
                for key, name in keys:
                    _copy_rows(f, key, _slot(slots, name))


def _renamer(scratch: nn.Module, mapping: list):
    """key -> (the model's name for it, the converter's source pattern or None): transformers' renaming of a
    checkpoint key (`rename_source_key`), its rules and the scratch's meta state dict taken once per load."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    meta, prefix = scratch.state_dict(), scratch.base_model_prefix
    return lambda key: rename_source_key(key, renamings, converters, prefix, meta)


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
    scratch = _meta_model(fewer, dtype, scratch=True)
    shapes = {name: p.shape for name, p in scratch.named_parameters(remove_duplicate=False)}
    ok = all(shapes.get(name) == torch.Size((held, *shape[1:])) for name, shape in fused.items())
    return scratch if ok else None


def load_shards(slots: dict[str, tuple[nn.Module, str]], config, model: str, dtype: torch.dtype) -> None:
    """Fill the (sharded, materialized) parameters in `slots` (`parameter_slots` of the HF model of `config`) from
    `model`'s safetensors, each rank its own rows.

    A tensor transformers only renames (if at all) is read by rows, each rank its own. The others of a layer (a
    layer's per-expert tensors: only the experts whose rows of the fused experts this rank holds) are read whole
    and converted by transformers onto a meta copy of the model (`scratch`), whose loaded parameters are then
    copied into the shards (cut into them where a converted tensor is not one of a rank's own) and dropped. Layers
    beyond the model's depth (`num_hidden_layers` overridden) are skipped, as `from_pretrained` drops them."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    path = Path(resolve_model_ref(model))
    if is_converted(str(path)):
        with _open(path / "model.safetensors") as f:
            keys = list(f.keys())
        return _load_rows(slots, {path / "model.safetensors": [(k, k) for k in keys]})
    scratch = _meta_model(config, dtype, scratch=True)
    scratches = {}  # the number of experts a rank holds -> a scratch copy with that many
    mapping = get_model_conversion_mapping(scratch)
    rename = _renamer(scratch, mapping)
    load_config = LoadStateDictConfig(dtype=dtype, weight_mapping=mapping)
    depth = config.num_hidden_layers
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one bar per layer otherwise
    try:
        for layer, where in _groups(sorted(path.glob("*.safetensors"))):
            if layer >= depth:
                continue
            direct, where = _direct(where, rename, slots)
            _load_rows(slots, direct)
            if not where:
                continue
            mine, held, fused = _own_experts(where, rename, slots)
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
            tensors = _read(mine, first_expert=held.start if held is not None else 0)
            convert_and_load_state_dict_in_model(target, tensors, load_config)
            with torch.no_grad():
                for name, p in target.named_parameters(remove_duplicate=False):
                    if not p.is_meta:
                        if name in fused:  # already this rank's rows
                            local(_slot(slots, name)).copy_(p)
                        else:
                            write_full(_slot(slots, name), p)
                        owner, _, attr = name.rpartition(".")
                        module = target.get_submodule(owner)
                        module._parameters[attr] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def check_loaded(model: nn.Module) -> None:
    """Every parameter holds a value (`materialize` NaN-filled them): one the checkpoint and the method's
    `after_load` left out is an error, not silent garbage."""
    missing = [name for name, p in model.named_parameters() if local(p).isnan().any()]
    if missing:
        raise RuntimeError(f"sharded loading left {len(missing)} parameter(s) without a value: "
                           f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")

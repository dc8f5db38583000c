"""`model_config` checked before anything is built: each key a setting of the model's config, of its type, in its
range; a geometry that fits together; a model that builds with it (on the meta device); a pretrained model's weights
still fitting it. `revffn validate` and `revffn train` both run it, before the run directory is touched."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from revffn.errors import UserError, closest, one_line
from revffn.models.generation import positions
from revffn.models.loading import (
    WIDTH_KEYS,
    config_overrides,
    hf_config,
    model_kind,
    resolve_model_ref,
    stored_depth_config,
)
from revffn.models.sharded import meta_hf

POSITIVE_KEYS = ("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size",
                 "num_attention_heads", "num_key_value_heads", "num_experts", "num_local_experts",
                 "num_experts_per_tok")


def check_model_config(model: str, overrides: dict, key: str = "model_config", compute: torch.dtype | None = None,
                       device: str = "cpu") -> None:
    """`model_config` before the model is loaded (it reads configs, and builds on the meta device): every key a
    setting of the model's config class, each value of the type the model's own is (an integer for an integer, a
    number for a float, a boolean for a boolean), a geometry at least 1 (`POSITIVE_KEYS`), transformers' own checks
    of the config built with them, a geometry the first step would not fail on and a model that builds (where the
    model without the overrides does), and a pretrained model's weight shapes unchanged.

    Raises:
        UserError: naming `key.NAME` (a misspelled key would otherwise be stored unread and the model built without it).
    """
    if not overrides:
        return
    _BUILT.clear()
    base = hf_config(model)
    known = set(base.to_dict())
    if hasattr(base, "rope_parameters"):  # transformers 5 still takes the older keywords into rope_parameters
        known |= {"rope_theta", "rope_scaling"}
    if model_kind(model) == "dir" and (Path(model).expanduser() / "config.json").is_file():
        known |= set(json.loads((Path(model).expanduser() / "config.json").read_text()))
    for name, value in overrides.items():
        if name not in known and not hasattr(base, name):
            raise UserError(f"{key}.{name}: {type(base).__name__} ({model}) has no setting {name!r}."
                            f"{closest(name, known)} Fix: a key of the model's config.json, e.g. num_hidden_layers.")
        held = getattr(base, name, None)
        wrong = (not isinstance(value, bool) if isinstance(held, bool) else
                 isinstance(value, bool) or not isinstance(value, int) if isinstance(held, int) else
                 isinstance(value, bool) or not isinstance(value, int | float) if isinstance(held, float) else False)
        if wrong:
            kind = "a boolean" if isinstance(held, bool) else "an integer" if isinstance(held, int) else "a number"
            fix = "true or false" if isinstance(held, bool) else f"{held!r} or another {kind.split()[-1]}"
            raise UserError(f"{key}.{name}: expected {kind} (the model's is {held!r}), got {value!r}. Fix: "
                            f"{key}.{name}={fix}.")
        if name in POSITIVE_KEYS and value < 1:
            raise UserError(f"{key}.{name}: must be at least 1, got {value!r}. Fix: a positive {name}.")
    ref = _ref(model)
    try:
        _config(ref, overrides)
    except UserError:
        raise
    except Exception as e:  # transformers' validation of the config (a strict dataclass since 5.x)
        raise UserError(f"{key}: {type(base).__name__} refuses {overrides}: {_reason(e)}. Fix: values that fit "
                        "together (e.g. num_attention_heads dividing hidden_size).") from None
    if problem := _new_problem(ref, overrides, _geometry_problem):
        raise UserError(f"{key}: {problem}")
    if problem := _new_problem(ref, overrides, _build_problem):
        raise UserError(f"{key}: {type(base).__name__} ({model}) cannot be built with {overrides}: {problem}. Fix: a "
                        "value the model's config.json could hold (see its documentation in transformers).")
    if compute is not None and (problem := _new_problem(ref, overrides, lambda r, o: _stride_problem(r, o, compute,
                                                                                                     device))):
        raise UserError(f"{key}: {problem}")
    if model_kind(model) not in ("tiny", "config") and set(overrides) - {"num_hidden_layers"}:
        _check_weight_shapes(model, ref, overrides, key)


def geometry_problem(model: str, overrides: dict) -> str | None:
    """What the overrides give `model` that its first step would fail on (`_geometry_problem`), or None: for the
    commands that build it at another size themselves (`revffn check --hidden`)."""
    return _new_problem(_ref(model), overrides, _geometry_problem)


def check_width(model: str, layers: int | None, hidden: int | None, key: str = "--hidden",
                compute: torch.dtype | None = None, device: str = "cpu") -> None:
    """`--hidden` of the commands that build a model at another size themselves (check, estimate, bench): UserError
    naming `key` where the width gives the model a geometry its first step fails on (`geometry_problem`), or, where
    `compute` is given, expert widths grouped_mm cannot take in it on `device` (`_stride_problem`)."""
    if hidden is None:
        return
    _BUILT.clear()
    if problem := _width_problem(model, layers, hidden, compute, device):
        sep = "" if key.endswith("=") else " "
        fit = next((w for w in range(hidden + 1, hidden + 129)
                    if not _width_problem(model, layers, w, compute, device)), -(-hidden // 128) * 128)
        raise UserError(f"{key}{sep}{hidden}: {problem} (Here: e.g. {key}{sep}{fit}.)")


def _width_problem(model: str, layers: int | None, hidden: int, compute: torch.dtype | None, device: str) -> str | None:
    overrides = config_overrides(model, layers, hidden, shipped_vocab=False)
    if problem := geometry_problem(model, overrides):
        return problem
    if compute is None:
        return None
    return _new_problem(_ref(model), overrides, lambda ref, over: _stride_problem(ref, over, compute, device,
                                                                                   suggest=False))


# what changes the shape of a weight (a pretrained model's would not load), as the message names them
SHAPE_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
              "vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts",
              "num_local_experts", "n_routed_experts", "n_shared_experts", "tie_word_embeddings")


def context_length(model: str, overrides: dict) -> int | None:
    """The model's positions (`generation.positions`, with `overrides`) read from its config, without building it;
    None where it has none or the config does not read (the build will say why)."""
    try:
        config = _config(_ref(model), overrides)
    except Exception:
        return None
    return positions(config)


def check_vocabulary(model: str, tokenizer, key: str) -> None:
    """UserError naming `key` when `tokenizer` has more tokens than `model`'s config has embeddings (`vocab_size`):
    an id from vocab_size on fails in the embedding with an IndexError (a directory saved without its tokenizer reads
    the shipped one, 2048 tokens). A tiny preset is built with the tokenizer's vocabulary: nothing to check."""
    if model_kind(model) == "tiny":
        return
    try:
        vocab = _get(_config(_ref(model), {}), "vocab_size")
    except Exception:  # a config that does not read: the load will say why
        return
    if isinstance(vocab, int) and not isinstance(vocab, bool) and len(tokenizer) > vocab:
        raise UserError(f"{key}: its tokenizer has {len(tokenizer)} tokens but the model's config.json has vocab_size "
                        f"{vocab}: the ids from {vocab} on have no embedding. Fix: save the model's own tokenizer in "
                        "its directory (tokenizer.save_pretrained), or give the one it was trained with.")


def _new_problem(ref: str, overrides: dict, find) -> str | None:
    """`find(ref, overrides)`'s problem where the model without the overrides has none (one it has already is not
    the overrides' doing: training will tell)."""
    problem = find(ref, overrides)
    return problem if problem is not None and find(ref, {}) is None else None


def _ref(model: str) -> str:
    """What the configs are read from: a tiny or config-only preset's name, else the model's directory (a Hub
    model's snapshot of configs only: no weights are downloaded to check them)."""
    return model if model_kind(model) in ("tiny", "config") else resolve_model_ref(model, weights=False)


def _config(ref: str, overrides: dict):
    return hf_config(ref, **overrides) if model_kind(ref) in ("tiny", "config") else \
        stored_depth_config(ref, **overrides)


def _get(config, name: str):
    """A config attribute, or None (a per-layer config raises on the global ones: gemma4's head_dim)."""
    try:
        return getattr(config, name, None)
    except Exception:
        return None


def _reason(error: BaseException) -> str:
    """An exception as one line for a message: its text, else its type (a bare assert says nothing)."""
    return f"{type(error).__name__}: {one_line(error)[:300]}" if str(error).strip() else type(error).__name__


def _geometry_problem(ref: str, overrides: dict) -> str | None:
    """What in the model's HF config (with `overrides`) it would build with but fail on at its first step, with the
    fix; None when it fits together."""
    config = _config(ref, overrides)
    heads, kv = _get(config, "num_attention_heads"), _get(config, "num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and kv and heads % kv:
        return (f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv} (each key/value head "
                "serves a group of query heads). Fix: num_key_value_heads dividing num_attention_heads, e.g. "
                f"num_key_value_heads={math.gcd(heads, kv)}.")
    hidden, head_dim = _get(config, "hidden_size"), _get(config, "head_dim")
    if isinstance(heads, int) and heads and isinstance(hidden, int) and head_dim is None and hidden % heads:
        return (f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}. Fix: num_attention_heads "
                "dividing hidden_size, or set head_dim.")
    rotary = _get(config, "rope_parameters") is not None or _get(config, "rope_theta") is not None
    width = None  # a head's
    if isinstance(head_dim, int):
        width = head_dim
    elif isinstance(hidden, int) and isinstance(heads, int) and heads:
        width = hidden // heads
    if rotary and width and width % 2 and _get(config, "partial_rotary_factor") in (None, 1, 1.0):
        return (f"the attention heads would be {width} wide (hidden_size={hidden} / num_attention_heads={heads}"
                f"{'' if head_dim is None else f', head_dim={head_dim}'}): rotary embeddings rotate pairs of "
                "coordinates, so a head's width must be even. Fix: a hidden_size and num_attention_heads whose "
                "quotient is even (e.g. hidden_size=64, num_attention_heads=4).")
    experts = next((n for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(n := _get(config, k), int)), None)
    top_k = _get(config, "num_experts_per_tok")
    if isinstance(top_k, int) and experts and top_k > experts:
        return (f"num_experts_per_tok={top_k} is more than the {experts} experts there are. Fix: "
                f"num_experts_per_tok between 1 and {experts}.")
    for name, value in sorted(config.to_dict().items()):
        if name.endswith("dropout") and isinstance(value, int | float) and not 0 <= value <= 1:
            return f"{name}={value} is not a probability. Fix: {name} between 0 and 1 (0: no dropout)."
    return None


_BUILT: dict[tuple[str, str], object] = {}  # the meta models of the check running now (`_meta`), least recent first


def _meta(ref: str, overrides: dict):
    """`meta_hf(ref, **overrides)`, built once for the checks of one call of `check_model_config` or `check_width`
    (which empty the memo first: a directory may change between calls); the checks read it, none changes it."""
    key = (ref, json.dumps(overrides, sort_keys=True, default=repr))
    model = _BUILT.pop(key, None)
    model = meta_hf(ref, **overrides) if model is None else model
    _BUILT[key] = model  # the most recent last; the least recent of more than 4 goes (a search over widths)
    while len(_BUILT) > 4:
        _BUILT.pop(next(iter(_BUILT)))
    return model


def _build_problem(ref: str, overrides: dict) -> str | None:
    """Why the model does not build with `overrides` (on the meta device: no weights), or None."""
    try:
        _meta(ref, overrides)
    except UserError:
        raise
    except Exception as e:  # e.g. an activation transformers does not know, a padding id outside the vocabulary
        return _reason(e)
    return None


def grouped_mm_runs(device: str) -> bool:
    """Whether transformers' experts kernel `grouped_mm` runs on `device` ("cpu" or "cuda") with this torch, as
    transformers decides (`integrations.moe._can_use_grouped_mm`); elsewhere it loops over the experts. A "cuda" with
    no GPU here (an estimate) is taken to be sm80 or later."""
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    version = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2])
    if device != "cuda":
        return version >= (2, 9)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    if hasattr(torch.nn.functional, "grouped_mm") or version >= (2, 9):
        return capability >= (8, 0)
    return capability[0] == 9


def _stride_problem(ref: str, overrides: dict, compute: torch.dtype, device: str, suggest: bool = True) -> str | None:
    """An expert width whose rows torch's grouped_mm (transformers' default experts kernel) cannot take: each row must
    start on a 16-byte boundary, so in the weights' dtype `compute` every width of an expert weight is a multiple of
    16 / its byte size (4 in fp32, 8 in bf16). Otherwise the first step fails with "strides should be multiple of 16
    bytes". None where the widths fit or the kernel does not run (`grouped_mm_runs`; experts of another kernel)."""
    if not grouped_mm_runs(device):
        return None
    multiple = 16 // torch.empty((), dtype=compute).element_size()
    bad = _misaligned(ref, overrides, multiple)
    if bad is None:
        return None
    name, shape, widths = bad
    config = _config(ref, overrides)
    keys = [k for k in ("hidden_size", *WIDTH_KEYS) if _get(config, k) in widths]
    fix = f"{', '.join(keys) or 'the expert widths'} multiples of {multiple}"
    hidden = overrides.get("hidden_size")
    if suggest and model_kind(ref) == "tiny" and isinstance(hidden, int):  # its expert widths follow hidden_size
        fit = next((h for h in range(hidden + 1, hidden + 16 * multiple)
                    if _misaligned(ref, {**overrides, "hidden_size": h}, multiple) is None), None)
        fix += f" (this preset derives its expert widths from hidden_size: e.g. hidden_size={fit})" if fit else ""
    return (f"the experts' weight {name} would be {shape}: torch's grouped_mm, transformers' experts kernel, needs "
            f"every expert width a multiple of {multiple} in {str(compute).removeprefix('torch.')} (16-byte rows), "
            f"and {widths[0]} is not. Fix: {fix}.")


def _misaligned(ref: str, overrides: dict, multiple: int) -> tuple[str, list[int], list[int]] | None:
    """The first weight of an experts module that runs on grouped_mm (transformers' `use_experts_implementation`
    classes, with `grouped_mm` their config's choice) with widths not a multiple of `multiple`: its name, shape and
    those widths."""
    for prefix, module in _meta(ref, overrides).named_modules():
        if not hasattr(module, "is_concatenated") or \
                getattr(getattr(module, "config", None), "_experts_implementation", None) != "grouped_mm":
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.dim() == 3 and (bad := [d for d in p.shape[1:] if d % multiple]):
                return f"{prefix}.{name}", list(p.shape), bad
    return None


def _check_weight_shapes(model: str, ref: str, overrides: dict, key: str) -> None:
    """A pretrained model's stored weights still fit it: an override that changes a weight's shape is refused."""
    depth = {k: v for k, v in overrides.items() if k == "num_hidden_layers"}
    stored = {name: p.shape for name, p in _meta(ref, depth).named_parameters()}
    for name, p in _meta(ref, overrides).named_parameters():
        if name in stored and p.shape != stored[name]:
            keys = [k for k in overrides if k in SHAPE_KEYS] or [k for k in overrides if k != "num_hidden_layers"]
            changed = ", ".join(f"{k}={overrides[k]}" for k in keys)
            raise UserError(f"{key}: {model} is pretrained, and with {changed} its weight {name} would have shape "
                            f"{list(p.shape)}, not the stored {list(stored[name])}: its weights would not load. Fix: "
                            "drop those keys (model_config may cut num_hidden_layers and change settings that keep the "
                            "weights' shapes), or train a random model of that geometry (model=tiny-qwen2-moe or "
                            "another tiny preset, with model_config).")

"""Config-key schema: a `Key` per option (type, default, range, meaning) and its checks.

Dependency-free (only `revffn.errors`), so methods can declare their options here without
importing the training package: `training.config` validates the YAML against the top-level
schema and every method's `SCHEMA`.
"""

from __future__ import annotations

import copy
import functools
import math
import operator
import os
import re
import reprlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any

from revffn.errors import closest


@dataclass(frozen=True)
class Key:
    """One config key: its type, default, allowed range or choices, and a one-line meaning."""

    type: type | tuple
    default: Any
    help: str
    min: float | None = None
    min_exclusive: bool = False
    max: float | None = None
    choices: tuple | None = None
    required: bool = False
    multiple: bool = False  # a comma-separated list of `choices` ("tensorboard,wandb"); a YAML list is joined
    path: bool = False  # a file or directory: `KEY=VALUE` on the command line is that string, as written


SHOWN_CHARS = 200  # at most this much of a value in a message
_REPR = reprlib.Repr()  # (attributes, not keywords: Python 3.11)
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, SHOWN_CHARS, SHOWN_CHARS, 40
_REPR.maxdict = _REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 8


def shown(value) -> str:
    """`repr(value)` cut to about SHOWN_CHARS characters, never expanding more of a nested value than that."""
    text = _REPR.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def list_items(value: str) -> list[str]:
    """The items of a `multiple` key's value, in order, without repeats: `"a, b,a"` -> `["a", "b"]`."""
    return list(dict.fromkeys(item.strip() for item in value.split(",")))


_E_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # what YAML 1.1 reads as a string: 1e-5


def coerce(value, key: Key):
    """Accept what YAML users write: ints for floats, '1e-4' strings for floats (in a mapping's values too, e.g.
    model_config's), a list for a `multiple` key, `~/` in a path (the shell expands it on the command line only),
    null for a mapping whose default is one (`model_config=null`: clears what the config file sets)."""
    types = key.type if isinstance(key.type, tuple) else (key.type,)
    if value is None and dict in types and isinstance(key.default, dict):
        return dict(key.default)
    if key.path and isinstance(value, str) and value.startswith("~"):
        return os.path.expanduser(value)
    if dict in types and isinstance(value, dict):
        return {k: float(v) if isinstance(v, str) and _E_FLOAT.fullmatch(v.strip()) else v for k, v in value.items()}
    if key.multiple and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    if float in types and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    if float in types and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def check_value(name: str, value, key: Key) -> str | None:
    """A problem description for `value`, with its fix, or None if it is valid."""
    types = key.type if isinstance(key.type, tuple) else (key.type,)
    default = f" (the default: {shown(key.default)})" if key.default is not None else ""
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        got = shown(value) if isinstance(value, bool) else f"{shown(value)} ({type(value).__name__})"
        return f"{name}: expected {_type_names(types)}, got {got}. Fix: {_type_names(types)}{default}."
    if key.required and value == "":
        return f"{name}: is empty. Fix: give it a value ({key.help[:SHOWN_CHARS]})."
    if key.choices:
        for item in list_items(value) if key.multiple else [value]:
            if item not in key.choices:
                return (f"{name}: {shown(item)} is not one of {', '.join(map(str, key.choices))}."
                        f"{closest(str(item), key.choices)} Fix: one of those{default}.")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name}: must be a finite number, got {shown(value)}. Fix: a finite number{default}."
        low = key.min is not None and (value < key.min or (key.min_exclusive and value == key.min))
        if low or (key.max is not None and value > key.max):
            span = " and ".join(([f"{'>' if key.min_exclusive else '>='} {key.min:g}"] if key.min is not None else [])
                                + ([f"<= {key.max:g}"] if key.max is not None else []))
            bound = f">{'' if key.min_exclusive else '='} {key.min:g}" if low else f"<= {key.max:g}"
            return f"{name}: must be {bound}, got {shown(value)}. Fix: a value {span}{default}."
    return None


def _type_names(types) -> str:
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string", type(None): "null",
             dict: "a mapping"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def annotation(key: Key):
    """The Python type of a key's validated value: `Key(int, ...)` -> int, `Key((str, NoneType))` -> str | None."""
    types = key.type if isinstance(key.type, tuple) else (key.type,)
    return functools.reduce(operator.or_, types)


@dataclass(frozen=True)
class Record(Mapping):
    """A validated set of key values, typed and frozen: read as attributes (`opts.stream_width`) or, for code
    that iterates or unpacks them, as a read-only mapping (`opts["stream_width"]`, `dict(opts)`, `**opts`).
    A changed copy is `opts.replace(key=value)`. Subclasses are made from a schema by `record_type`."""

    def __getitem__(self, name: str):
        if name not in self.__dataclass_fields__:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(f.name for f in fields(self))

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)

    def replace(self, **changes):
        return replace(self, **changes)


def record_type(name: str, schema: dict[str, Key], base: type = Record, extra: list | None = None,
                module: str | None = None, qualname: str | None = None) -> type:
    """A frozen dataclass with one typed field per key of `schema`, each defaulting to the key's default
    (copied, so a dict default is never shared), then `extra` fields (`make_dataclass` specs). `module` and
    `qualname` say where the class is reachable, so that its instances pickle (a config crosses processes)."""
    specs = [(k, annotation(key), field(default_factory=functools.partial(copy.deepcopy, key.default)))
             for k, key in schema.items()]
    cls = make_dataclass(name, specs + list(extra or []), bases=(base,), frozen=True)
    cls.__module__, cls.__qualname__ = module or cls.__module__, qualname or name
    return cls

"""Fine-tuning methods, one file each; the registry below is the only list of methods.

Adding a method: one file with a `Method` subclass, one `register` line here (or, for a method that
lives outside the package, a `register` call in its own module), its tests and a README row.
"""

from __future__ import annotations

import importlib

from revffn.errors import UserError, closest
from revffn.methods.base import Method
from revffn.methods.ckpt import CkptMethod
from revffn.methods.dora import DoRAMethod
from revffn.methods.full import FullMethod
from revffn.methods.hift import HiFTMethod
from revffn.methods.lora import LoRAMethod
from revffn.methods.refta import ReFTAMethod
from revffn.methods.revffn import RevFFNMethod

METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Add a method to the registry (usable as a class decorator)."""
    METHODS[cls.name] = cls
    return cls


# The order of every method list (bench and study tables): the reference (full) first.
for _cls in (FullMethod, CkptMethod, RevFFNMethod, LoRAMethod, DoRAMethod, HiFTMethod, ReFTAMethod):
    register(_cls)


def method_class(name: str, module: str | None = None, key: str = "method") -> type[Method]:
    """The registered class of `name`. `module`: import it first (a method registered outside the
    package, e.g. in a worker process that must see what its parent registered)."""
    if module and name not in METHODS:
        importlib.import_module(module)
    if name not in METHODS:
        raise UserError(f"{key}: unknown method {name!r}.{closest(name, METHODS)} Fix: one of {', '.join(METHODS)}.")
    return METHODS[name]


def method_section_schema() -> dict:
    """YAML section name -> {option: Key} for every registered method."""
    return {name: m.SCHEMA for name, m in METHODS.items() if m.SCHEMA}

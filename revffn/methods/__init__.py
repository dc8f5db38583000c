"""Fine-tuning methods, one file each; registration is one line here."""

from revffn.methods.ckpt import CkptMethod
from revffn.methods.dora import DoRAMethod
from revffn.methods.full import FullMethod
from revffn.methods.hift import HiFTMethod
from revffn.methods.lora import LoRAMethod
from revffn.methods.refta import ReFTAMethod
from revffn.methods.revffn import RevFFNMethod

METHODS = {m.name: m for m in (RevFFNMethod, FullMethod, CkptMethod, LoRAMethod, DoRAMethod, HiFTMethod, ReFTAMethod)}


def method_section_schema() -> dict:
    """YAML section name -> {option: Key} for every registered method."""
    return {name: m.SCHEMA for name, m in METHODS.items() if m.SCHEMA}

"""Where `revffn.conversion.convert` lived before the conversion got its own package. Converted directories
written before then carry a `modeling_revffn.py` that imports `convert` from here; this keeps them loading."""

from revffn.conversion.convert import convert

__all__ = ["convert"]

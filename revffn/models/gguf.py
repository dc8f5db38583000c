"""GGUF files as model references, read through transformers' GGUF loader (the `gguf` package).

`model: path/to/file.gguf` (relative or absolute), or a directory without config.json that holds exactly
one `*.gguf`, names a GGUF checkpoint. transformers dequantizes it to an ordinary HF model
(`from_pretrained(dir, gguf_file=NAME)`), but refuses to `save_pretrained` the result ("quantized with
gguf and is not serializable"); `materialize` copies the dequantized weights into a model built from the
same config without its `quantization_config`, and saves that (safetensors, fp32) with the tokenizer
transformers rebuilt from the GGUF metadata. The rest of revffn then sees a plain HF directory.

`check_gguf` reads only the header (memory-mapped, no dequantizing) and refuses, before the slow load, a
file that is not GGUF, an architecture transformers cannot read, or a tensor type `gguf` cannot dequantize.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from revffn.conversion.upcycle import save_here
from revffn.errors import UserError, one_line

SUFFIX = ".gguf"


def gguf_file(model: str) -> Path | None:
    """The GGUF file `model` names (a `*.gguf` path, or a directory without config.json holding exactly one),
    else None. Never reads the file."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix.lower() == SUFFIX:
        return path.resolve()
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob(f"*{SUFFIX}"))
        if len(found) == 1:
            return found[0].resolve()
    return None


def several_gguf_error(path: Path, key: str) -> UserError | None:
    """The error for a directory without config.json holding several `*.gguf` (None otherwise)."""
    found = sorted(path.glob(f"*{SUFFIX}")) if path.is_dir() else []
    if len(found) < 2:
        return None
    return UserError(f"{key}: {str(path)!r} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}) and "
                     f"no config.json. Fix: name one of them, e.g. {key}: {path / found[0].name}.")


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _field_str(reader, name: str) -> str | None:
    field = reader.fields.get(name)
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def check_gguf(path: Path, key: str = "model") -> str:
    """The file's architecture, after checking transformers and `gguf` can load it (header only).

    Raises:
        UserError: naming `key` and the file, for a file that is not GGUF, an architecture transformers'
            GGUF loader does not support, or tensors of a type `gguf` cannot dequantize.
    """
    try:
        import gguf
        from gguf.quants import _type_traits
    except ImportError:
        raise UserError(f"{key}: {path} is a GGUF file, and reading it needs the `gguf` package. Fix: "
                        "pip install 'gguf>=0.10'.") from None
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # bad magic, truncated, unknown version
        raise UserError(f"{key}: {path} is not a readable GGUF file ({one_line(e)}). Fix: point {key} at a "
                        "complete .gguf file (or a directory written by save_pretrained).") from None
    arch = _field_str(reader, "general.architecture") or "?"
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        raise UserError(f"{key}: {path} has GGUF architecture {arch!r}, which transformers' GGUF loader does not "
                        f"read (it reads {', '.join(a for a in GGUF_SUPPORTED_ARCHITECTURES if a != 'general')}). "
                        "Fix: convert the original checkpoint with save_pretrained and point at that directory.")
    readable = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, *_type_traits}
    bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in readable})
    if bad:
        names = [t.name for t in reader.tensors if t.tensor_type.name in bad]
        raise UserError(f"{key}: {path} holds tensors quantized as {', '.join(bad)} ({len(names)} tensors, e.g. "
                        f"{names[0]}), which the gguf package cannot dequantize. Fix: use a GGUF of a supported "
                        "quantization (F32, F16, BF16, Q8_0, Q4_K_M, ...), or the original safetensors checkpoint.")
    return arch


def materialize(path: Path, out: Path, key: str = "model") -> None:
    """Dequantize GGUF `path` into `out` (an empty directory): config.json, model.safetensors (fp32) and the
    tokenizer, as save_pretrained writes them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_gguf(path, key)
    where = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
        quantized = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32, use_kernels=False)
    except Exception as e:
        raise UserError(f"{key}: transformers could not load the GGUF file {path} ({one_line(e)}). Fix: use a GGUF "
                        "of a supported architecture and quantization, or the original checkpoint.") from None
    fields = quantized.config.to_dict()
    fields.pop("quantization_config", None)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.config.name_or_path = path.stem
    save_here(model, out)  # (any rank of a torchrun job may build the cache)
    tokenizer.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)

"""Model references and loading: one place that knows what a `model` string may name.

A reference is one of (`model_kind`):

- ``tiny``: a tiny preset (`tiny-qwen2-moe`, ...): a real HF config class, random init;
- ``config``: a config-only geometry (`qwen1.5-moe-a2.7b`, ... in `models/geometries/`): a public
  model's config without weights (estimate, bench and check build it with random init);
- ``shipped``: a model shipped in the package (`builtin:base`), or built once into revffn's cache from a
  local package (`builtin:smollm2`, `builtin:smollm2-moe`: `models.cache`);
- ``dir``: a local HF `save_pretrained` directory with config.json (a run's `final/` included), or a GGUF
  file (`path/to/file.gguf`, or a directory holding one and no config.json), dequantized once into the
  cache (`models.gguf`);
- ``hub``: a Hugging Face Hub ID `ORG/NAME[@REVISION]` that is not a local directory: resolved to its
  snapshot in huggingface_hub's cache (`models.hub`), downloaded unless `HF_HUB_OFFLINE=1`.

`model_kind` never touches the network; `resolve_model_ref` turns any reference into a directory.
"""

from __future__ import annotations

import functools
import gc
import json
from pathlib import Path

import torch

from revffn.errors import UserError, closest, one_line
from revffn.models.cache import CACHED_MODELS, cached_model, gguf_model
from revffn.models.gguf import gguf_file, several_gguf_error
from revffn.models.hub import parse_hub_id, snapshot
from revffn.models.presets import TINY_PRESETS, tiny_config, tiny_model

SHIPPED_MODELS = {"builtin:base": Path(__file__).resolve().parent.parent / "assets" / "base"}
GEOMETRY_DIR = Path(__file__).resolve().parent / "geometries"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
WIDTH_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
SHIPPED_VOCAB = 2048  # len(load_tokenizer(None)); asserted in tests


def parse_dtype(name: str, key: str = "dtype") -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"{key}: unknown dtype {name!r}. Fix: use float32 or bfloat16 "
                        "(float16 is not supported: its range overflows in MoE training; use bfloat16).")
    return DTYPES[name]


def config_presets() -> list[str]:
    """Names of the config-only geometries (full-size public configs, no weights)."""
    return sorted(p.stem for p in GEOMETRY_DIR.glob("*.json"))


def resolve_model_ref(model: str, key: str = "model", weights: bool = True) -> str:
    """The directory a reference names: `builtin:base` -> the shipped base model; `builtin:smollm2[-moe]` and
    GGUF files -> their directory in revffn's cache (built on first use); a Hub ID -> its snapshot
    in the Hugging Face cache (`weights=False`: configs and tokenizer only), downloaded if missing unless
    offline; any other reference unchanged.

    Raises:
        UserError: naming `key`, when a Hub ID cannot be resolved or lacks config.json or safetensors weights.
    """
    if model in SHIPPED_MODELS:
        return str(SHIPPED_MODELS[model])
    if model in CACHED_MODELS:
        return str(cached_model(model, key))
    if (gguf := gguf_file(model)) is not None:
        return str(gguf_model(gguf, key))
    if Path(model).expanduser().is_dir() or parse_hub_id(model) is None:
        return model
    path = Path(snapshot(model, key, weights))
    _check_model_dir(path, model, key)
    if weights and not any(path.glob("*.safetensors")):
        raise UserError(f"{key}: {model!r} has no *.safetensors weights on the Hub (revffn loads safetensors "
                        f"only). Fix: convert its weights to safetensors in a local directory and point {key} "
                        "there.")
    return str(path)


def _check_model_dir(path: Path, model: str, key: str) -> None:
    """A model directory is whole before anything reads it: config.json there and valid, every safetensors file
    as long as its header says."""
    if not (path / "config.json").is_file():
        raise UserError(f"{key}: {model!r} has no config.json. Fix: point {key} at a directory written by "
                        "save_pretrained (it holds config.json and *.safetensors), or a Hub ID of such a model.")
    check_config_json(path, key)
    for weights in sorted(path.glob("*.safetensors")):
        check_safetensors(weights, key)


def check_config_json(path: Path, key: str = "model") -> None:
    """config.json parses and its values have the types the model's config class declares (transformers
    validates them), reported as config.json's problem, with the key it names."""
    config = Path(path) / "config.json"
    try:
        json.loads(config.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{key}: {str(config)!r} is not valid JSON ({one_line(e)}). Fix: repair config.json, or "
                        "write the model again with save_pretrained.") from None
    try:
        stored_config(path)
    except Exception as e:  # transformers raises ValueError, TypeError, its strict-dataclass errors, ...
        raise UserError(f"{key}: {str(config)!r} does not validate: {type(e).__name__}: {one_line(e)} Fix: correct "
                        "that key in config.json (a value of the type the model's config declares), or write the "
                        "model again with save_pretrained.") from None


def check_safetensors(file: Path, key: str = "model") -> None:
    """The file is as long as its header says (8-byte header length, JSON header, then the tensors' bytes): a
    truncated copy or download is caught here, before anything is loaded or written."""
    size = file.stat().st_size
    fix = "Fix: copy or download it again (it is incomplete), or point {key} at a complete model."
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"{size:,} bytes, shorter than its own header")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as e:
        raise UserError(f"{key}: {str(file)!r} is not a complete safetensors file ({e}). " + fix.format(key=key)) \
            from None
    if size < 8 + n + end:
        raise UserError(f"{key}: {str(file)!r} is truncated: {size:,} bytes, its header says {8 + n + end:,}. "
                        + fix.format(key=key))


def model_kind(model: str, key: str = "model",
               allow: tuple[str, ...] = ("tiny", "config", "shipped", "dir", "hub")) -> str:
    """'tiny', 'config', 'shipped', 'dir' or 'hub' (see the module docstring); never touches the network.

    Raises:
        UserError: naming `key`, when `model` is none of the kinds in `allow` (a malformed Hub ID included).
    """
    kinds = {"tiny": list(TINY_PRESETS), "config": config_presets(), "shipped": [*SHIPPED_MODELS, *CACHED_MODELS]}
    names = [n for kind in allow if kind not in ("dir", "hub") for n in kinds[kind]]
    for kind in ("tiny", "config", "shipped"):
        if model in kinds[kind] and kind in allow:
            return kind
    path = Path(model).expanduser()
    if "dir" in allow and gguf_file(model) is not None:
        return "dir"
    if "dir" in allow and path.is_dir():
        if (several := several_gguf_error(path, key)) is not None:
            raise several
        _check_model_dir(path, model, key)
        return "dir"
    if "hub" in allow and parse_hub_id(model):
        return "hub"
    where = ", a local HF model directory" if "dir" in allow else ""
    where += ", a Hugging Face Hub ID (ORG/NAME)" if "hub" in allow else ""
    if model.startswith("builtin:"):
        shipped = [*SHIPPED_MODELS, *CACHED_MODELS]
        others = ", ".join(n for n in names if n not in shipped)
        raise UserError(f"{key}: unknown shipped model {model!r}.{closest(model, shipped)} Fix: use "
                        f"{', '.join(shipped)}, or one of {others}{where}.")
    if "/" in model and "hub" in allow:  # a path that does not exist, or a malformed Hub ID
        raise UserError(f"{key}: {model!r} is neither a local directory nor a Hugging Face Hub ID (ORG/NAME or "
                        "ORG/NAME@REVISION; letters, digits, '-', '_', '.'). Fix: give an existing directory holding "
                        "config.json, or a Hub ID such as Qwen/Qwen1.5-MoE-A2.7B.")
    raise UserError(f"{key}: unknown model {model!r}.{closest(model, names)} Fix: use one of {', '.join(names)}"
                    f"{where}.")


def check_model_ref(model: str, key: str = "model") -> None:
    """Raise a UserError unless `model` is a model that can be trained (tiny preset, shipped model, local
    directory or Hub ID; a config-only geometry has no weights). Never touches the network."""
    kind = model_kind(model, key, allow=("tiny", "shipped", "dir", "hub"))
    path = Path(model).expanduser()
    if kind == "dir" and path.is_dir() and gguf_file(model) is None and not has_weights(path):
        raise UserError(f"{key}: {model!r} holds no weights (*.safetensors, or pytorch_model*.bin). Fix: save the "
                        "model with save_pretrained(DIR), or copy its weight files there.")


def has_weights(path: Path) -> bool:
    """Whether a model directory holds weight files transformers loads (safetensors, or PyTorch's .bin)."""
    return any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin"))


def hf_config(model: str, **overrides):
    """The HF config of any reference (never weights)."""
    import transformers

    kind = model_kind(model)
    if kind == "tiny":
        config = tiny_config(model, **overrides)
    elif kind == "config":
        fields = {k: v for k, v in json.loads((GEOMETRY_DIR / f"{model}.json").read_text()).items()
                  if not k.startswith("_")}
        config = transformers.AutoConfig.for_model(fields.pop("model_type"), **{**fields, **overrides})
    else:
        config = stored_config(resolve_model_ref(model, weights=False), **overrides)
    config.name_or_path = model
    return config


def stored_config(path: str | Path, **overrides):
    """The HF config a model directory holds; for a converted model written as transformers loads it
    (config.json of model_type `revffn`, `models.hf_remote`), the base model's config inside it."""
    from transformers import AutoConfig

    from revffn.models.hf_remote import RevFFNConfig

    if json.loads((Path(path) / "config.json").read_text()).get("model_type") != RevFFNConfig.model_type:
        return AutoConfig.from_pretrained(path, local_files_only=True, **overrides)
    config = RevFFNConfig.from_pretrained(path, local_files_only=True).text_config
    config.update(overrides)
    return config


def config_overrides(model: str, layers: int | None = None, hidden: int | None = None,
                     shipped_vocab: bool = True) -> dict:
    """HF config overrides for `--layers` / `--hidden`: the other widths (intermediate sizes) keep their
    ratio to the hidden size (multiples of 8), as `tiny_config` does; a tiny preset gets the shipped
    tokenizer's vocabulary, as training builds it (unless `shipped_vocab` is off)."""
    kind = model_kind(model)
    out: dict = {"vocab_size": SHIPPED_VOCAB} if kind == "tiny" and shipped_vocab else {}
    if layers is not None:
        out["num_hidden_layers"] = int(layers)
    if hidden is not None:
        out["hidden_size"] = int(hidden)
        if kind != "tiny":  # tiny_config scales its own widths
            base = hf_config(model)
            scale = hidden / base.hidden_size
            for k in WIDTH_KEYS:
                v = getattr(base, k, None)
                if isinstance(v, int) and v > 0:
                    out[k] = max(8, round(v * scale / 8) * 8)  # multiples of 8: bf16 grouped_mm strides
            head_dim = getattr(base, "head_dim", None)
            if isinstance(head_dim, int) and head_dim * base.num_attention_heads == base.hidden_size:
                out["head_dim"] = hidden // base.num_attention_heads
    return out


def random_init(model: str, dtype: torch.dtype, seed: int, device: torch.device | None = None, **overrides):
    """An HF causal LM with random weights from `model`'s config (any reference kind)."""
    import transformers

    config = hf_config(model, **overrides)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if device is not None and device.type == "cuda":
            torch.cuda.manual_seed_all(seed)
        with torch.device(device or "cpu"):
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return hf.to(dtype)


def is_converted(model: str, key: str = "model") -> bool:
    """True for a directory (or Hub ID) holding a RevFFN-converted model (`revffn convert`, a revffn run's
    final/): its revffn.json says `format: revffn`."""
    return read_revffn_json(Path(resolve_model_ref(str(model), key, weights=False)).expanduser(), key).get(
        "format") == "revffn"


def read_revffn_json(root: Path, key: str = "model") -> dict:
    """A model directory's `revffn.json` (how revffn wrote it), {} where there is none.

    Raises:
        UserError: naming `key`, when it is there but not a JSON object (damaged).
    """
    f = Path(root) / "revffn.json"
    if not f.is_file():
        try:
            architectures = json.loads((Path(root) / "config.json").read_text()).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            architectures = []
        if "RevFFNModelForCausalLM" in architectures:  # read as a plain model, its weights would load as none
            raise UserError(f"{key}: {str(root)!r} holds a RevFFN-converted model (its config.json) but no "
                            "revffn.json, which says how its blocks are built. Fix: copy revffn.json there from the "
                            "directory the model came from (save_pretrained of the trust_remote_code class does not "
                            "write it), or copy that whole directory again.")
        return {}
    try:
        manifest = json.loads(f.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        manifest = e
    if not isinstance(manifest, dict):
        raise UserError(f"{key}: {str(f)!r} is not the JSON object revffn writes ({one_line(str(manifest))[:100]}): "
                        "the directory is damaged. Fix: copy the model directory again from where it was written.")
    return manifest


# absent from directories written before them
CONVERTED_DEFAULTS = {"adapter_skip": False, "stream_width": "half", "coupling": "additive", "buffer_bits": 6,
                      "buffer_momentum": "negative"}


def converted_option(model: str, name: str, key: str = "model"):
    """A structural option of a converted directory's blocks, from its config.json: `adapter_skip` (the
    skip adapters) or `stream_width` (half | full); `CONVERTED_DEFAULTS` where the file predates it."""
    config = Path(resolve_model_ref(str(model), key, weights=False)).expanduser() / "config.json"
    held = json.loads(config.read_text()).get(name) if config.is_file() else None
    return CONVERTED_DEFAULTS[name] if held is None else held


@functools.cache  # once a process
def freeze_imports() -> None:
    """Exempt what the process holds now from the cyclic garbage collector (`gc.freeze`), once a process: before
    its first model build, that is torch's, transformers' and revffn's imports, ~414k objects, which every full
    collection would otherwise scan again. A model's build makes enough objects to start one: 0.25-0.29 s of
    builtin:smollm2-moe's start-up, in one process and on each rank alike (`revffn bench --nproc 2`). Refcounting
    still frees a frozen object once unreferenced; only a reference cycle among objects alive at the first build
    is never collected. Called by the two builders, `load_hf` and `models.sharded.meta_hf`."""
    gc.freeze()


def load_hf(model: str, dtype: torch.dtype = torch.float32, seed: int = 0, **config_overrides):
    """An HF causal LM from a tiny preset (random init), a shipped model, a local directory or a Hub ID
    (`resolve_model_ref`: from the cache, downloaded unless offline).

    A converted directory (`is_converted`) loads as the `RevFFNForCausalLM` it holds (`load`), in
    train mode: only the revffn method accepts it (`Method.ACCEPTS_CONVERTED`)."""
    check_model_ref(model)
    freeze_imports()
    if model in TINY_PRESETS:
        return tiny_model(model, seed=seed, dtype=dtype, **config_overrides)
    path = resolve_model_ref(model)
    if is_converted(path):
        if config_overrides:
            raise UserError(f"model_config: {model!r} holds a converted RevFFN model; its geometry is fixed. Fix: "
                            "remove model_config, or convert the base model again with the overrides.")
        return load(path, dtype=dtype).train()
    from transformers import AutoConfig, AutoModelForCausalLM

    config = stored_depth_config(path, **config_overrides)
    stored = AutoConfig.from_pretrained(path, local_files_only=True).num_hidden_layers
    if config.num_hidden_layers >= stored:
        # use_kernels=False wherever revffn loads: newer transformers default it on with `kernels` installed and a GPU,
        # then fetch kernels from the Hub (fails offline; revffn's blocks replace those layers anyway)
        return AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True, dtype=dtype,
                                                    use_kernels=False)
    import logging

    report = logging.getLogger("transformers.modeling_utils")  # its load report: the dropped layers are UNEXPECTED
    level = report.level
    report.setLevel(logging.ERROR)
    try:
        return AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True, dtype=dtype,
                                                    use_kernels=False)
    finally:
        report.setLevel(level)


def stored_depth_config(path: str | Path, **overrides):
    """The HF config of a model directory with `overrides`; a `num_hidden_layers` override also cuts the per-layer
    `layer_types` to the new depth (transformers validates their lengths when the config is built again, as a
    converted model's export does, and would refuse it after training)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True, **overrides)
    types = getattr(config, "layer_types", None)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides and isinstance(types, list):
        config.layer_types = types[: config.num_hidden_layers]
    return config


def build_hf(model: str, dtype: torch.dtype = torch.float32, seed: int = 0, device: torch.device | None = None,
             **overrides):
    """The HF model as training builds it (`load_hf`) for presets, shipped models and directories; random
    init for config-only geometries (built on `device` directly: they can be large) and for directories
    whose hidden size is overridden."""
    kind = model_kind(model)
    if kind == "config" or (kind in ("dir", "shipped", "hub") and "hidden_size" in overrides):
        return random_init(model, dtype, seed, device, **overrides)
    return load_hf(model, dtype=dtype, seed=seed, **overrides)


def load(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """A model from a run's `final/` (or any save_pretrained) directory or a Hub ID, ready for eval and generation.

    `final/revffn.json` says how it was written: `format: hf` (a plain HF directory: full, ckpt, hift,
    and LoRA/DoRA/ReFTA merged) or `format: revffn` (the converted weights, with the base HF config
    inside a `revffn` config.json, or, as revffn wrote it before, as config.json itself). Weights
    are cast to `dtype` (fp32 by default, whatever the dtype on disk).
    """
    from safetensors.torch import load_model
    from transformers import AutoModelForCausalLM

    from revffn.conversion.causal_lm import CausalLM

    root = Path(resolve_model_ref(str(path)))
    if not (root / "config.json").is_file():
        raise UserError(f"{path!r} is not a model directory (no config.json). Fix: point at a run's final/ "
                        "directory or an HF save_pretrained directory.")
    manifest = read_revffn_json(root)
    weights = (root / "model.safetensors").is_file() if manifest.get("format") == "revffn" else has_weights(root)
    if not weights:
        raise UserError(f"{path!r} holds no weights. Fix: copy the model directory again from where it was written "
                        "(a run's final/ holds model.safetensors).")
    if manifest.get("format") == "revffn":  # a revffn run's final/ or a `revffn convert` directory
        model = converted_skeleton(root, AutoModelForCausalLM.from_config(stored_config(root), dtype=dtype))
        load_model(model, str(root / "model.safetensors"))
    else:
        model = CausalLM(AutoModelForCausalLM.from_pretrained(root, local_files_only=True, dtype=dtype,
                                                              use_kernels=False))
    return model.to(device=device, dtype=dtype).eval()


def converted_skeleton(root: Path, hf):
    """The `RevFFNForCausalLM` a converted directory holds, built around `hf` (the base model from its config, in
    the dtype to load: from_config would take the config's own, bf16 for builtin:base, and round the weights), its
    weights not yet read: `load` reads them whole, sharded loading (`models.sharded`) each rank its rows."""
    from revffn.conversion.convert import STREAM_DTYPES, convert

    manifest = read_revffn_json(root)
    # "auto": a buffered `revffn convert` wrote what it was asked before stop 67; it built float32 streams, as its
    # config.json says (transformers' load reads that)
    stream = STREAM_DTYPES.get(manifest.get("stream_dtype", "float32"), torch.float32)
    return convert(hf, adapter_init=manifest.get("adapter_init", "coordinate"), stream_dtype=stream,
                   adapter_skip=bool(converted_option(str(root), "adapter_skip")),
                   stream_width=converted_option(str(root), "stream_width"),
                   coupling=converted_option(str(root), "coupling"),
                   buffer_bits=converted_option(str(root), "buffer_bits"),
                   buffer_momentum=converted_option(str(root), "buffer_momentum"))

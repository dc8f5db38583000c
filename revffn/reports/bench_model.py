"""Model references for `revffn bench`, `revffn check` and `revffn estimate`.

A reference is one of:

- a tiny preset (`tiny-qwen2-moe`, ...): random init, built with the shipped tokenizer's vocabulary
  (2048), exactly as `revffn train` builds it;
- a config-only preset (`qwen1.5-moe-a2.7b`, ... from `revffn/memory/presets`): the public model's
  geometry, random init (no weights exist here);
- a local HF directory with `config.json`: its weights, or random init from its config when
  `--hidden` changes the geometry.

`--layers` / `--hidden` override `num_hidden_layers` / `hidden_size`; the other widths (intermediate
sizes) keep their ratio to the hidden size (rounded to multiples of 8), as `tiny_config` does for the
tiny presets.
"""

from __future__ import annotations

from pathlib import Path

import torch

from revffn.errors import UserError, closest
from revffn.memory.estimate import config_presets
from revffn.memory.estimate import load_config as load_hf_config
from revffn.models.presets import TINY_PRESETS

WIDTH_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
SHIPPED_VOCAB = 2048  # len(load_tokenizer(None)); asserted in tests


def model_kind(model: str, key: str = "--model") -> str:
    """'tiny', 'config' or 'dir'; a UserError naming the presets otherwise."""
    if model in TINY_PRESETS:
        return "tiny"
    if model in config_presets():
        return "config"
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{key}: {model!r} has no config.json. Fix: point {key} at a directory written by "
                            "save_pretrained (it holds config.json and *.safetensors).")
        return "dir"
    names = [*TINY_PRESETS, *config_presets()]
    raise UserError(f"{key}: unknown model {model!r}.{closest(model, names)} Presets: {', '.join(names)}; "
                    "or give a local HF model directory. revffn never downloads.")


def config_overrides(model: str, layers: int | None = None, hidden: int | None = None,
                     shipped_vocab: bool = True) -> dict:
    """HF config overrides for `model` with `--layers` / `--hidden` (widths scaled with hidden); a tiny
    preset gets the shipped tokenizer's vocabulary, as training builds it (unless `shipped_vocab` is off)."""
    kind = model_kind(model)
    out: dict = {"vocab_size": SHIPPED_VOCAB} if kind == "tiny" and shipped_vocab else {}
    if layers is not None:
        out["num_hidden_layers"] = int(layers)
    if hidden is not None:
        out["hidden_size"] = int(hidden)
        if kind != "tiny":  # tiny_config scales its own widths
            base = load_hf_config(model)
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

    config = load_hf_config(model, **overrides)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if device is not None and device.type == "cuda":
            torch.cuda.manual_seed_all(seed)
        with torch.device(device or "cpu"):
            hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return hf.to(dtype)


def build_hf(model: str, dtype: torch.dtype = torch.float32, seed: int = 0, device: torch.device | None = None,
             **overrides):
    """The HF model as training builds it (`load_hf`) for tiny presets and directories; random init
    from the config for config-only presets (built on `device` directly: they can be large) and for
    directories whose hidden size is overridden."""
    from revffn.models.loading import load_hf

    kind = model_kind(model)
    if kind == "config" or (kind == "dir" and "hidden_size" in overrides):
        return random_init(model, dtype, seed, device, **overrides)
    return load_hf(model, dtype=dtype, seed=seed, **overrides)


def train_config(args: dict):
    """The validated `TrainConfig` of one bench measurement: the built-in quickstart plus model,
    method, dtype, device and seed, `model_config` replaced by the bench's overrides, then the
    user's `--set key=value` items (dotted keys reach method sections). Raises UserError."""
    from revffn.training.config import load_config, parse_overrides

    overrides = [f"model={args['model']}", f"method={args['method']}", "max_steps=100000",
                 f"dtype={args.get('dtype', 'auto')}", f"device={args.get('device', 'auto')}",
                 f"seed={args.get('seed', 0)}", *args.get("set", [])]
    cfg = load_config(None, overrides)
    user = parse_overrides(list(args.get("set", []))).get("model_config", {})
    cfg.values["model_config"] = {**args.get("model_config", {}), **(user if isinstance(user, dict) else {})}
    return cfg

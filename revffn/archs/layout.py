"""What a spec's pieces compute, and whether a model fits: the layout checks behind every refusal.

A decoder layer converts when it is, at full width d (`ArchSpec` names the pieces),

    h' = h + attn_branch(h)                     attn_branch = s * attn_post_norm(mixer(attn_norm(.)))
    h'' = h' + mlp_branch(h')                   mlp_branch  = s * mlp_post_norm(mlp(mlp_norm(.)) + shared)

(or h + attn_branch(h) + mlp_branch(h) for a parallel block), and nothing else: `HFRevBlock`'s F
and G are these branches between the projection adapters. A model whose layers or config hold
more than that would convert into a model that silently leaves part of it out, so `convert`
refuses it (`check_convertible`), naming every piece, layer and key at once:

- a piece the spec names is missing, or is a ModuleList / ModuleDict rather than one module (in a
  layer, or the model's embedding, final norm, head and rotary embedding);
- a layer holds a module with parameters, or a parameter of its own, that no spec piece uses
  (a learnable residual weight, a hyper-connection, an extra norm);
- the model holds parameters outside the layers, the embedding, the final norm and the head;
- a model-level config key that acts outside the sub-blocks (`OUTSIDE_KEYS`) has a non-neutral
  value and the spec does not apply it.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import nn

from revffn.archs.spec import ArchSpec, config_value, get_path
from revffn.errors import UserError

# Model-level config keys that act outside the decoder layers' sub-blocks (on the embedding, the
# residual stream or the logits), with their neutral value. Attention's own scales and soft-caps
# (`attention_multiplier`, `attn_logit_softcapping`) are part of attention and need nothing.
OUTSIDE_KEYS: dict[str, float | None] = {
    "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0, "logit_scale": 1.0,
    "final_logit_softcapping": None, "logits_mup_width_multiplier": 1.0,
}
# the kwargs a token mixer may take; each is passed only where its forward accepts it
MIXER_KWARGS = ("position_embeddings", "attention_mask")
# what a module's forward calls the KV cache, newest first (transformers 5.24 renamed past_key_values)
CACHE_KWARGS = ("cache", "past_key_values")


# -- the branches ------------------------------------------------------------------------------------
@functools.cache
def _accepted(cls: type) -> frozenset[str] | None:
    """The keyword names `cls.forward` accepts (None: any, it has **kwargs)."""
    params = inspect.signature(cls.forward).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


@functools.cache
def _cache_kwarg(cls: type) -> str | None:
    params = inspect.signature(cls.forward).parameters
    return next((name for name in CACHE_KWARGS if name in params), None)


def cache_kwarg(module: nn.Module) -> str | None:
    """The name `module.forward` takes a KV cache under (`cache` or `past_key_values`), or None.

    Only a name in the signature counts: a cache passed to a forward that merely has **kwargs would
    vanish there, and the next token would attend to nothing cached."""
    return _cache_kwarg(type(module))


def output_cache(out):
    """The KV cache an HF model output carries (`out.cache`; `out.past_key_values` before 5.24), or None."""
    return next((getattr(out, name) for name in CACHE_KWARGS if getattr(out, name, None) is not None), None)


def call_mixer(mixer: nn.Module, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """mixer(x, **the kwargs it accepts) as one (B, T, d) tensor: attention returns a tuple (its
    output first), linear-attention / SSM / convolution mixers often a bare tensor."""
    accepted = _accepted(type(mixer))
    out = mixer(x, **{k: v for k, v in kwargs.items() if accepted is None or k in accepted})
    return out[0] if isinstance(out, tuple) else out


def _norm(layer: nn.Module, path: str | None, x: torch.Tensor) -> torch.Tensor:
    return x if path is None else get_path(layer, path)(x)


def attn_branch(layer: nn.Module, spec: ArchSpec, mixer: str, x: torch.Tensor, position_embeddings,
                attention_mask, scale: float = 1.0, p_drop: float = 0.0, cache=None) -> torch.Tensor:
    """The attention (token-mixer) branch of `layer` at full width: (B, T, d) -> (B, T, d).

    With a transformers `cache`, the mixer stores this call's keys and values (or recurrent state) in
    it and attends over everything cached: x then holds only the new tokens."""
    module = get_path(layer, mixer)
    extra = {cache_kwarg(module): cache} if cache is not None else {}
    x = call_mixer(module, _norm(layer, spec.attn_norm, x), position_embeddings=position_embeddings,
                   attention_mask=attention_mask, **extra)
    x = _norm(layer, spec.attn_post_norm, x)
    if p_drop:
        x = F.dropout(x, p=p_drop, training=layer.training)
    return x * scale if scale != 1.0 else x


def mlp_branch(layer: nn.Module, spec: ArchSpec, x: torch.Tensor, scale: float = 1.0,
               p_drop: float = 0.0) -> torch.Tensor:
    """The MoE (or dense MLP) branch of `layer` at full width: (B, T, d) -> (B, T, d)."""
    h = _norm(layer, spec.mlp_norm, x)
    out = get_path(layer, spec.mlp)(h)
    out = out[0] if isinstance(out, tuple) else out  # some MoE blocks return (hidden, router_logits)
    out = out.reshape(x.shape)  # some return (B*T, d)
    shared = get_path(layer, spec.shared_mlp, None) if spec.shared_mlp else None
    if shared is not None:
        out = out + shared(h)
    out = _norm(layer, spec.mlp_post_norm, out)
    if p_drop:
        out = F.dropout(out, p=p_drop, training=layer.training)
    return out * scale if scale != 1.0 else out


def reference_layer(layer: nn.Module, spec: ArchSpec, config, h: torch.Tensor, position_embeddings,
                    attention_mask) -> torch.Tensor:
    """What the spec says `layer` computes at full width (h: (B, T, d)); equal to the HF layer's
    output when the spec leaves nothing out (the sweep's `layer_gap`)."""
    scale = float(config_value(config, spec.branch_scale_key, 1.0))
    a = attn_branch(layer, spec, spec.mixer_name(layer), h, position_embeddings, attention_mask, scale)
    return h + a + mlp_branch(layer, spec, h if spec.parallel else h + a, scale)


def logits_transform(spec: ArchSpec, config) -> tuple[float, float | None]:
    """(scale, softcap): the LM head's logits become softcap * tanh(scale * logits / softcap)."""
    scale = float(config_value(config, spec.logits_scale_key, 1.0)) / float(
        config_value(config, spec.logits_divisor_key, 1.0))
    softcap = config_value(config, spec.logits_softcap_key)
    return scale, (float(softcap) if softcap else None)


# -- the checks --------------------------------------------------------------------------------------
def _layers(hf_model, spec: ArchSpec) -> nn.ModuleList | None:
    layers = get_path(hf_model, spec.layers, None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


def _children(layer: nn.Module) -> str:
    names = [n for n, _ in layer.named_children()] + [n for n, _ in layer.named_parameters(recurse=False)]
    return ", ".join(f"`{n}`" for n in names) or "nothing"


def _group(problems: dict[int, str]) -> list[str]:
    """{layer index: problem} -> ["layers 0, 2 have ...", ...] (identical problems merged)."""
    by_text: dict[str, list[int]] = {}
    for i, text in problems.items():
        by_text.setdefault(text, []).append(i)
    out = []
    for text, idx in by_text.items():
        who = f"layer {idx[0]}" if len(idx) == 1 else f"layers {', '.join(map(str, idx))}"
        out.append(f"{who} {text}" if len(idx) == 1 else f"{who} {_plural(text)}")
    return out


def _plural(text: str) -> str:
    for a, b in (("has ", "have "), ("(it has ", "(each has ")):
        text = text.replace(a, b, 1) if text.startswith(a) or a.startswith("(") else text
    return text


def _piece_paths(spec: ArchSpec, layer: nn.Module) -> list[str]:
    paths = [spec.attn_norm, spec.mixer_name(layer), spec.attn_post_norm, spec.mlp_norm, spec.mlp,
             spec.mlp_post_norm]
    if spec.shared_mlp and get_path(layer, spec.shared_mlp, None) is not None:
        paths.append(spec.shared_mlp)
    return [p for p in paths if p]


def missing_pieces(hf_model, spec: ArchSpec) -> list[str]:
    """Per layer: the spec's pieces it lacks (and what it has instead), or that are not one module."""
    layers = _layers(hf_model, spec)
    if layers is None:
        return [f"the model has no decoder layers at `{spec.layers}` (a non-empty ModuleList)"]
    problems: dict[int, str] = {}
    for i, layer in enumerate(layers):
        lacks, lists = [], []
        mixer = spec.mixer_name(layer)
        if mixer is None:
            lacks.append(" or ".join(f"`{n}`" for n in (spec.attn, *spec.mixers)))
        for path in [p for p in (spec.attn_norm, mixer, spec.attn_post_norm, spec.mlp_norm, spec.mlp,
                                 spec.mlp_post_norm) if p]:
            piece = get_path(layer, path, None)
            if not isinstance(piece, nn.Module):
                lacks.append(f"`{path}`")
            elif isinstance(piece, (nn.ModuleList, nn.ModuleDict)):
                lists.append(f"`{path}` ({type(piece).__name__}, {len(piece)} sub-layers)")
        text = []
        if lacks:
            text.append(f"has no {', '.join(lacks)} (it has {_children(layer)})")
        if lists:
            text.append(f"{'has' if not lacks else 'and'} {', '.join(lists)} as lists of sub-layers, not one module "
                        f"each")
        if text:
            problems[i] = " ".join(text)
    return _group(problems)


def missing_model_pieces(hf_model, spec: ArchSpec) -> list[str]:
    """The model-level pieces the spec names that the model lacks (embedding, final norm, head). A missing
    rotary embedding is allowed: NoPE models (jamba, granite-hybrid with `position_embedding_type: nope`)
    and mixers that place positions themselves get `position_embeddings=None`, as HF passes them."""
    out = []
    for what, path in (("embedding", spec.embed), ("final norm", spec.final_norm), ("LM head", spec.head)):
        if path and not isinstance(get_path(hf_model, path, None), nn.Module):
            out.append(f"the model has no {what} at `{path}`")
    return out


def _uncovered(names: list[str], used: list[str]) -> list[str]:
    """The pieces (shortest dotted prefixes inside no used path) that own the parameters `names`."""
    pieces = []
    for name in names:
        if any(name.startswith(u + ".") for u in used):
            continue
        parts = name.split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if not any(u == prefix or u.startswith(prefix + ".") for u in used):
                break
        if prefix not in pieces:
            pieces.append(prefix)
    return pieces


def unused_pieces(hf_model, spec: ArchSpec) -> list[str]:
    """Per layer: the modules with parameters, and the parameters of its own, that no piece uses;
    then the model's parameters outside the layers, embedding, final norm and head."""
    layers = _layers(hf_model, spec)
    problems: dict[int, str] = {}
    for i, layer in enumerate(layers):
        pieces = _uncovered([n for n, _ in layer.named_parameters()], _piece_paths(spec, layer))
        if pieces:
            own = {n for n, _ in layer.named_parameters(recurse=False)}
            why = ("learnable residual weights or gates do not fit Y = X + F(X)" if set(pieces) <= own
                   else "RevFFN computes only the pieces its spec names; a norm, gate or module on the "
                        "residual stream does not fit Y = X + F(X)")
            problems[i] = (f"has {', '.join(f'`{p}`' for p in pieces)} that RevFFN's layout does not use ({why})")
    out = _group(problems)
    model_level = [p for p in (spec.layers, spec.embed, spec.final_norm, spec.head, spec.rotary) if p]
    outside = _uncovered([n for n, _ in hf_model.named_parameters()], model_level)
    if outside:
        out.append(f"the model has parameters outside its decoder layers, embedding, final norm and head: "
                   f"{', '.join(f'`{p}`' for p in outside)}")
    return out


def unhandled_config(config, spec: ArchSpec) -> list[str]:
    """The model-level keys with a non-neutral value (see `OUTSIDE_KEYS`) that the spec does not apply."""
    handled = spec.scale_keys()
    out = []
    for key, neutral in OUTSIDE_KEYS.items():
        value = config_value(config, key)
        if key in handled or value is None or value == neutral or (neutral is None and not value):
            continue
        out.append(f"config `{key}` = {value!r} acts outside the sub-blocks and the spec does not apply it")
    return out


def check_convertible(hf_model, spec: ArchSpec) -> None:
    """Raise one `UserError` naming every reason `hf_model` cannot convert exactly (module docstring).

    Raises:
        UserError: the spec is marked unsupported, or a piece is missing, unused or unapplied.
    """
    model_type = getattr(hf_model.config, "model_type", "?")
    problems = [spec.unsupported] if spec.unsupported else []
    missing_in_layers = missing_pieces(hf_model, spec)
    missing = missing_in_layers + missing_model_pieces(hf_model, spec)
    problems += missing
    if not missing_in_layers:
        problems += unused_pieces(hf_model, spec) + unhandled_config(hf_model.config, spec)
    if problems:
        extra = len(problems) - len(missing) - bool(spec.unsupported)  # unused pieces, unapplied keys
        fixes = []
        if missing:
            fixes.append("if the model has these pieces under other names, name them in a spec file under "
                         "revffn/archs/ (ArchSpec: attn, mixers, mlp, attn_norm, mlp_norm, embed, final_norm, "
                         "head, rotary)")
        if extra:
            fixes.append("if HF applies such a piece inside a branch (a post-norm, a shared MLP, a scale), declare "
                         "it in a spec file under revffn/archs/ (ArchSpec: attn_post_norm, mlp_post_norm, "
                         "shared_mlp, *_key)")
        fixes.append(("otherwise the architecture does not fit norm / attention / norm / MoE branches: "
                      if fixes else "") + "fine-tune it with a baseline method (full, ckpt, lora)")
        raise UserError(f"cannot convert model_type={model_type!r}: " + "; ".join(problems) + ". Fix: "
                        + "; ".join(fixes) + ".")

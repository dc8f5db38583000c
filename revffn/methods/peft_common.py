"""Shared code of `lora` and `dora`: adapters injected by the real `peft` library.

Targets are resolved against the loaded model:

- `nn.Linear` modules (attention q/k/v/o, the shared expert's or a dense MLP's gate/up/down) go to
  `LoraConfig.target_modules` (peft's `lora.Linear`, DoRA-capable);
- fused expert tensors (transformers 5 stores `mlp.experts.gate_up_proj` (E, 2I, d) and
  `mlp.experts.down_proj` (E, d, I) as 3-D parameters) and the router weight (`mlp.gate.weight`, a
  non-Linear module) go to `LoraConfig.target_parameters` (peft's `lora.ParamWrapper`: a rank-r
  adapter per expert). peft's ParamWrapper refuses `use_dora`, `lora_dropout > 0` and `lora_bias`,
  so DoRA covers only the Linear modules, and LoRA with dropout must leave the parameters out.

On transformers 5, peft also reads each module target as a transformers-v4 expert name (`gate_proj`,
`up_proj`, `down_proj`, `w1`-`w3`, `gate`) for the model types whose experts transformers fuses: peft 0.21
moves such a target to the fused expert parameters, which silently skips a shared-expert or dense-MLP Linear of
that name (glm4_moe); peft 0.22 keeps the Linear but adds the fused experts as parameter targets at twice the rank
(qwen2_moe, glm4_moe: DoRA then fails, LoRA's experts get rank 2r). `peft_names` passes a target that peft's
mapping reads as an expert name by its layer-relative module names (`mlp.shared_expert.gate_proj`), which it
leaves alone (0.22); a target peft still moves (0.21) is adapted by LoRA through its `.weight` parameter (the same
update), and left out by DoRA (recorded as `not_covered` in revffn.json). What peft would still change is refused.

The trained model is `CausalLM(hf)` with the adapters injected in place; the `PeftModel` stays on
the method for `save_pretrained` (adapters) and `merge_and_unload` (the merged HF model).
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

from torch import nn

from revffn.archs.architectures import spec_for
from revffn.conversion.causal_lm import CausalLM
from revffn.errors import UserError
from revffn.memory.estimate import Dims, MemoryContext, MemoryTerms
from revffn.memory.saved import Grad
from revffn.methods.base import Method, check_not_head, write_manifest
from revffn.schema import Key

# Linear modules (suffixes of module names): attention and shared-expert / dense-MLP projections.
DEFAULT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_MARK = "lora_"  # lora_A, lora_B, lora_magnitude_vector (DoRA)


def peft_schema() -> dict:
    return {
        "r": Key(int, 16, "adapter rank (more capacity, more adapter memory)", min=1),
        "lora_alpha": Key(float, 32.0, "scale numerator: the update is (lora_alpha / r) * B A", min=0,
                          min_exclusive=True),
        "lora_dropout": Key(float, 0.0, "dropout on the adapter input (Linear targets only)",
                            min=0, max=1),
        "target_modules": Key((list, type(None)), None, "module/parameter name suffixes to adapt (null: defaults)"),
        "include_router": Key(bool, False, "also adapt the MoE router weights (mlp.gate)"),
    }


def _linear_names(hf: nn.Module) -> list[str]:
    return [n for n, m in hf.named_modules() if isinstance(m, nn.Linear)]


def _matches(name: str, suffix: str) -> bool:
    return name == suffix or name.endswith("." + suffix)


def _layer_relative(name: str, layers_path: str) -> str:
    """'model.layers.3.mlp.experts.down_proj' -> 'mlp.experts.down_proj' (peft matches by suffix)."""
    m = re.match(rf"^{re.escape(layers_path)}\.\d+\.(.+)$", name)
    return m.group(1) if m else name


def resolve_targets(hf: nn.Module, targets: list[str] | None, include_router: bool,
                    allow_parameters: bool, method: str) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) for peft, from the model's actual modules and parameters.

    A name matches by suffix (as in peft). Linear modules become module targets; parameters not owned
    by a Linear (fused experts, the router weight) become parameter targets, if `allow_parameters`.
    """
    spec = spec_for(hf)
    linears = set(_linear_names(hf))
    loose = {n: p for n, p in hf.named_parameters() if n.rsplit(".", 1)[0] not in linears and p.ndim in (2, 3)}
    router = f"{spec.mlp}.{spec.router}"

    def is_router(n: str) -> bool:
        return _matches(n, router) or _matches(n, f"{router}.weight")

    if targets is None:
        modules = [t for t in DEFAULT_MODULES if any(_matches(n, t) for n in linears)]
        # every fused (3-D) expert tensor, named relative to its decoder layer
        parameters = sorted({_layer_relative(n, spec.layers) for n, p in loose.items() if p.ndim == 3}) \
            if allow_parameters else []
    else:
        modules, parameters = [], []
        for t in targets:
            hit_module = [n for n in linears if _matches(n, t)]
            hit_param = [n for n in loose if _matches(n, t)]
            check_not_head(method, t, hit_module, spec.head)
            if any(map(is_router, hit_module + hit_param)) and not include_router:
                raise UserError(f"{method}.target_modules: {t!r} matches the router ({router}). Fix: set "
                                f"{method}.include_router: true to adapt it, or drop {t!r}.")
            if hit_module:
                modules.append(t)
            if hit_param and allow_parameters:
                parameters.append(t)
            if not hit_module and not (hit_param and allow_parameters):
                why = (f" It names a non-Linear parameter, which peft's ParamWrapper cannot adapt with {method}."
                       if hit_param else "")
                raise UserError(f"{method}.target_modules: {t!r} matches no nn.Linear module in "
                                f"{spec.model_type}.{why} Fix: use names like {', '.join(DEFAULT_MODULES[:4])}, "
                                "or null for the defaults.")
    if include_router:
        if any(is_router(n) for n in linears):
            modules.append(router)
        elif any(is_router(n) for n in loose) and allow_parameters:
            parameters.append(f"{router}.weight")
        elif any(is_router(n) for n in loose):
            raise UserError(f"{method}.include_router: the router ({router}) is not an nn.Linear, and peft's "
                            f"parameter adapters (ParamWrapper) refuse {method}. Fix: set include_router: false, "
                            "or use method lora.")
    if not modules and not parameters:
        raise UserError(f"{method}: no target found in {spec.model_type}. Fix: set {method}.target_modules.")
    return list(dict.fromkeys(modules)), list(dict.fromkeys(parameters))


def v4_changes(config, hf: nn.Module) -> tuple[set[str], set[str], dict]:
    """What peft's transformers-v4 -> v5 config mapping would do to `config` on `hf`: (the module targets it moves
    away, the parameter targets it adds, the rank and alpha patterns it sets). Runs peft's own mapping on a copy;
    a mapping that refuses the config (a fused pair named in part) moves every module target."""
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # older peft/transformers: no such mapping, nothing is rewritten
        return set(), set(), {}
    probe = copy.deepcopy(config)
    try:
        convert_peft_config_for_transformers(probe, model=hf, conversions=get_model_conversion_mapping(hf))
    except ValueError:
        return set(config.target_modules or []), set(), {}
    patterns = {k: v for k, v in {**(probe.rank_pattern or {}), **(probe.alpha_pattern or {})}.items()
                if k not in (config.rank_pattern or {}) and k not in (config.alpha_pattern or {})}
    return (set(config.target_modules or []) - set(probe.target_modules or []),
            set(probe.target_parameters or []) - set(config.target_parameters or []), patterns)


def peft_names(hf: nn.Module, modules: list[str], config_for) -> list[str]:
    """`modules` (suffixes) as peft should get them: each one peft's v4 mapping reads (`v4_changes` of it alone is
    not empty) replaced by the layer-relative names of the Linear modules it matches (`gate_proj` ->
    `mlp.shared_expert.gate_proj`), the others as they are. `config_for(mods)` makes the LoraConfig."""
    spec = spec_for(hf)
    linears = _linear_names(hf)
    out = []
    for t in modules:
        if any(v4_changes(config_for([t]), hf)):
            out += sorted({_layer_relative(n, spec.layers) for n in linears if _matches(n, t)})
        else:
            out.append(t)
    return list(dict.fromkeys(out))


class PeftMethod(Method):
    """The LoRA family's shared base (not registered itself): `lora` and `dora` set `name`, `SCHEMA`,
    `STUDY_LR_GRID` and `use_dora`; neither subclasses the other."""

    use_dora = False
    ESTIMATE_KEYS = ("r",)  # (the default targets are assumed)
    LIBRARIES = ("peft",)

    def __init__(self, cfg):
        super().__init__(cfg)
        self.peft_model = None
        self.targets: tuple[list[str], list[str]] = ([], [])
        self.not_covered: list[str] = []

    @classmethod
    def validate(cls, cfg) -> None:
        opts = cfg.section(cls.name)
        tm = opts["target_modules"]
        if tm is not None and (not tm or not all(isinstance(t, str) and t for t in tm)):
            raise UserError(f"{cls.name}.target_modules: expected a non-empty list of names or null, got {tm!r}. "
                            f"Fix: {cls.name}.target_modules=[q_proj, v_proj], or null for the defaults.")

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        from peft import LoraConfig, get_peft_model

        o, model_type = self.opts, hf_model.config.model_type
        modules, parameters = resolve_targets(hf_model, o["target_modules"], o["include_router"],
                                              allow_parameters=not self.use_dora, method=self.name)

        def lora_config(mods, params):
            return LoraConfig(r=o["r"], lora_alpha=o["lora_alpha"], lora_dropout=o["lora_dropout"],
                              target_modules=mods, target_parameters=params or None, use_dora=self.use_dora,
                              bias="none")

        modules = peft_names(hf_model, modules, lambda mods: lora_config(mods, parameters))
        moved = sorted(v4_changes(lora_config(modules, parameters), hf_model)[0])
        if moved:  # (peft 0.21: a name of a v4 expert projection is moved, even a shared expert's)
            modules = [t for t in modules if t not in moved]
            if not self.use_dora:  # adapt those Linears through their weight parameter instead (same update)
                parameters = [*parameters, *(f"{t}.weight" for t in moved)]
                moved = []
            elif o["target_modules"] is not None:
                raise UserError(f"{self.name}.target_modules: peft would silently retarget {moved} to the fused "
                                f"expert parameters of {model_type} (its transformers-v4 mapping), which DoRA "
                                "cannot adapt. Fix: drop them from target_modules.")
        left = v4_changes(lora_config(modules, parameters), hf_model)
        if any(left):
            import peft

            raise UserError(f"{self.name}: peft {peft.__version__} would change the adapters on {model_type} through "
                            f"its transformers-v4 mapping (moved {sorted(left[0])}, added {sorted(left[1])}, "
                            f"ranks {left[2]}). Fix: install peft 0.21 or 0.22, the versions revffn is tested with.")
        if not modules and not parameters:
            raise UserError(f"{self.name}: no target left for {model_type}. Fix: set {self.name}.target_modules.")
        if parameters and o["lora_dropout"] > 0:
            raise UserError(f"{self.name}.lora_dropout={o['lora_dropout']} cannot apply to the parameter targets "
                            f"{parameters} (peft's ParamWrapper has no dropout). Fix: set lora_dropout: 0, or "
                            "list only Linear modules in target_modules.")
        self.targets, self.not_covered = (modules, parameters), moved  # not_covered: DoRA defaults left out
        with warnings.catch_warnings():  # peft probes HF's deprecated gradient-checkpointing attribute
            warnings.simplefilter("ignore", FutureWarning)
            self.peft_model = get_peft_model(hf_model, lora_config(modules, parameters))
        # CausalLM after injection: an adapted router is tapped through its wrapper, so the
        # load-balancing loss reaches the router's adapter.
        return CausalLM(hf_model, self.cfg.router_aux_loss_coef)

    def optimizer_parameters(self, model) -> list[nn.Parameter]:
        return [p for n, p in model.named_parameters() if ADAPTER_MARK in n]

    # -- memory estimate ---------------------------------------------------------------------------
    @classmethod
    def memory_terms(cls, ctx: MemoryContext, r: int) -> MemoryTerms:
        """Adapters on the default targets (fp32 on a bf16 model, as peft keeps them); the frozen base's
        activations that input gradients need, plus the adapters' (lora: W + BA of every expert, kept)."""
        m, s, kind = ctx.m, ctx.s, "dora" if cls.use_dora else "lora"
        trainable = lora_trainable(m, r, cls.use_dora)
        cast = s != 4  # peft keeps adapters in fp32 on a bf16 model
        g = Grad(w=False, router=False, adapter=kind, rank=r, rewritten=m.peft_rewrites, cast=cast)
        notes = [f"{cls.name}: rank {r} on q/k/v/o, shared-expert and dense MLP projections"
                 + (" (not the fused experts: peft's ParamWrapper refuses DoRA)" if cls.use_dora
                    else ", every expert's gate_up and down (W + BA materialised per forward and kept)")
                 + "; activations: the frozen model's (what input gradients need) + the adapters'"]
        if cls.use_dora:
            notes.append("dora: + magnitude vectors; activations also keep the base and LoRA outputs per "
                         "targeted matrix and its weight-norm path (an in x in identity through A)")
        return MemoryTerms(trainable=trainable, activations_forward=ctx.adapted_activations(g), extra_params=trainable,
                           trainable_bytes=4 if cast else s, notes=tuple(notes))

    def export(self, model, out_dir: Path) -> None:
        """`adapter/`: peft `save_pretrained`; out_dir itself: the merged HF model (format hf).

        Merges in place (`merge_and_unload`), so the model the loop holds afterwards is the merged one.
        """
        self.peft_model.save_pretrained(out_dir / "adapter")
        merged = self.peft_model.merge_and_unload()
        if self.opts["include_router"]:  # the router taps sat on the removed wrappers: re-tap
            model._taps = CausalLM(merged, model.aux_loss_coef)._taps
        merged.save_pretrained(out_dir)
        modules, parameters = self.targets
        write_manifest(out_dir, format="hf", method=self.name, adapter_dir="adapter", r=self.opts["r"],
                       lora_alpha=self.opts["lora_alpha"], target_modules=modules, target_parameters=parameters,
                       not_covered=self.not_covered)


# -- memory estimate: the default targets' trainable parameters ------------------------------------
def lora_targets(m: Dims, i: int, dora: bool) -> list[tuple[int, int, int]]:
    """Layer i's matrices that peft adapts by default: (fan_in, fan_out, copies). DoRA adapts only
    Linear modules (not the fused experts, nor MLP Linears that peft retargets to their weights)."""
    q, kv = m.heads * m.hd, m.kv * m.hd
    mats = [(m.d, q, 1), (m.d, kv, 1), (m.d, kv, 1), (q, m.d, 1)]
    inter = m.dense_inter if not m.moe[i] else m.shared_inter
    if inter and not (dora and m.peft_rewrites):
        mats += [(m.d, inter, 1)] * 2 + [(inter, m.d, 1)]
    if m.moe[i] and not dora:
        mats += [(m.d, 2 * m.moe_inter, m.experts), (m.moe_inter, m.d, m.experts)]
    return mats


def lora_trainable(m: Dims, rank: int, dora: bool) -> int:
    """r (in + out) per adapted matrix and copy, + out for DoRA's magnitude vector."""
    return sum(copies * (rank * (fan_in + fan_out) + (fan_out if dora else 0))
               for i in range(m.layers) for fan_in, fan_out, copies in lora_targets(m, i, dora))

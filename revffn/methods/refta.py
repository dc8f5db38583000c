"""`refta`: tensorized, reconstruction-free adaptation (the ReFTA idea).

Each targeted Linear gets the update `ΔW_l = (alpha / r) · B_l · G_l · A`:

- `A` (r × in) is shared across layers: one factor per distinct (in, out) shape, so a module shares
  it only with same-shaped modules (e.g. q/o share one, k/v another, in GQA models);
- `B_l` (out × r) is the module's own output factor, `G_l` (r × r) its small core.

It is applied on activations as a chain of small matmuls, `y = W x + (alpha / r) · B_l(G_l(A x))`,
never materialising ΔW in the forward or backward pass ("reconstruction-free"). Init: `B_l = 0` (so
ΔW = 0 and the model is unchanged at step 0), `A` orthogonal rows, `G_l` orthogonal. Each target
is wrapped in `ReFTALinear`, which keeps the original as `base_layer` (like PEFT); the shared
factors live once in `model.refta_shared` (a `ParameterDict` keyed by shape).

Trainable parameters: r·in per distinct shape + (r·out + r²) per module, below LoRA's r·(in + out)
per module at equal rank on the same targets once a shape repeats over layers.

Export merges ΔW into the base weights in place, restores the plain Linears and writes a plain HF
model (format hf).

Trades: fewer trainable parameters (and AdamW states) than LoRA at equal rank; the shared input
factor couples the layers' updates (less freedom per layer); one extra r × r matmul per target.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from revffn.conversion.causal_lm import CausalLM
from revffn.errors import UserError
from revffn.memory.estimate import Dims, MemoryContext, MemoryTerms
from revffn.memory.saved import Grad
from revffn.methods.base import Method, check_not_head, write_manifest
from revffn.schema import Key

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def shape_key(in_features: int, out_features: int) -> str:
    return f"in{in_features}_out{out_features}"


class ReFTALinear(nn.Module):
    """`base_layer(x) + scale · B(G(A x))`, with `A` read from the shared bank (not owned here)."""

    def __init__(self, base_layer: nn.Linear, bank: nn.ParameterDict, r: int, scale: float):
        super().__init__()
        self.base_layer = base_layer
        self.__dict__["bank"] = bank  # a plain reference: the shared A is registered once, in the bank
        self.key = shape_key(base_layer.in_features, base_layer.out_features)
        self.r, self.scale = r, scale
        w = base_layer.weight
        self.G = nn.Parameter(torch.empty(r, r, dtype=w.dtype, device=w.device))
        self.B = nn.Parameter(torch.zeros(base_layer.out_features, r, dtype=w.dtype, device=w.device))
        with torch.no_grad():
            self.G.copy_(nn.init.orthogonal_(torch.empty(r, r, dtype=torch.float32)).to(w.dtype))

    @property
    def A(self) -> nn.Parameter:
        return self.bank[self.key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.scale * F.linear(F.linear(F.linear(x, self.A), self.G), self.B)

    def delta_weight(self) -> torch.Tensor:
        """The materialised ΔW (out × in), for merging and tests only."""
        return self.scale * (self.B.float() @ self.G.float() @ self.A.float())

    def extra_repr(self) -> str:
        return f"r={self.r}, scale={self.scale:g}, shared A={self.key}"


class ReFTAMethod(Method):
    name = "refta"
    SCHEMA = {
        "r": Key(int, 16, "rank of the shared input factor and the cores (capacity vs adapter memory)", min=1),
        "alpha": Key(float, 32.0, "update scale numerator: ΔW = (alpha / r) B G A", min=0, min_exclusive=True),
        "target_modules": Key((list, type(None)), None, "Linear module name suffixes (null: q/k/v/o_proj)"),
    }
    ESTIMATE_KEYS = ("r",)  # (the default targets are assumed)
    STUDY_LR_GRID = (1e-3, 3e-3)  # an adapter method: ~10x full's

    @classmethod
    def validate(cls, cfg) -> None:
        tm = cfg.section(cls.name)["target_modules"]
        if tm is not None and (not tm or not all(isinstance(t, str) and t for t in tm)):
            raise UserError(f"refta.target_modules: expected a non-empty list of names or null, got {tm!r}. Fix: "
                            "refta.target_modules=[q_proj, v_proj], or null for q/k/v/o_proj.")

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        model = CausalLM(hf_model, self.cfg.router_aux_loss_coef)
        wrap(model, self.opts["target_modules"] or list(DEFAULT_TARGETS), self.opts["r"], self.opts["alpha"])
        return model

    def optimizer_parameters(self, model) -> list[nn.Parameter]:
        return adapter_parameters(model)

    def export(self, model, out_dir: Path) -> None:
        """Merge ΔW into the base weights (in place), then a plain HF `save_pretrained` directory."""
        merge(model)
        model.hf.save_pretrained(out_dir)
        write_manifest(out_dir, format="hf", method=self.name, r=self.opts["r"], alpha=self.opts["alpha"])

    # -- memory estimate ---------------------------------------------------------------------------
    @classmethod
    def memory_terms(cls, ctx: MemoryContext, r: int) -> MemoryTerms:
        """The default q/k/v/o targets in the model dtype; the frozen base's activations that input
        gradients need, plus A x and G A x per projection."""
        m = ctx.m
        trainable = refta_trainable(m, r)
        g = Grad(w=False, router=False, adapter="refta", rank=r, rewritten=m.peft_rewrites, cast=False)
        note = (f"refta: rank {r}; shared A per input width, per-layer B and core on q/k/v/o; activations: the "
                "frozen model's (what input gradients need) + 2 (rows x rank) per projection")
        return MemoryTerms(trainable=trainable, activations_forward=ctx.adapted_activations(g), extra_params=trainable,
                           notes=(note,))


def refta_trainable(m: Dims, rank: int) -> int:
    """Trainable parameters on the default q/k/v/o targets: one A per distinct shape, B and G per module."""
    q, kv = m.heads * m.hd, m.kv * m.hd
    mats = [(m.d, q), (m.d, kv), (m.d, kv), (q, m.d)]
    shared_a = sum(rank * fan_in for fan_in, _ in set(mats))  # one A per distinct (in, out) shape
    return shared_a + m.layers * sum(fan_out * rank + rank * rank for _, fan_out in mats)


def _suffix(name: str, t: str) -> bool:
    return name == t or name.endswith("." + t)


def wrap(model: CausalLM, targets: list[str], r: int, alpha: float) -> list[ReFTALinear]:
    """Replace every targeted Linear of `model.hf` by a `ReFTALinear`; the shared factors go in
    `model.refta_shared`."""
    found = [(n, m) for n, m in model.hf.named_modules() if isinstance(m, nn.Linear)
             and any(_suffix(n, t) for t in targets)]
    missing = [t for t in targets if not any(_suffix(n, t) for n, _ in found)]
    for t in targets:
        check_not_head("refta", t, [n for n, _ in found if _suffix(n, t)], model.spec.head)
    if missing:
        raise UserError(f"refta.target_modules: {missing} match no nn.Linear module. Fix: use names like "
                        f"{', '.join(DEFAULT_TARGETS)}, or null for the defaults.")
    bank = nn.ParameterDict()
    wrappers = []
    for name, lin in found:
        key = shape_key(lin.in_features, lin.out_features)
        if key not in bank:
            a = nn.init.orthogonal_(torch.empty(r, lin.in_features, dtype=torch.float32))
            bank[key] = nn.Parameter(a.to(lin.weight.dtype).to(lin.weight.device))
        w = ReFTALinear(lin, bank, r, alpha / r)
        parent, _, child = name.rpartition(".")
        setattr(model.hf.get_submodule(parent), child, w)
        wrappers.append(w)
    model.refta_shared = bank
    return wrappers


def wrappers_of(model: nn.Module) -> list[tuple[str, ReFTALinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ReFTALinear)]


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    params = list(model.refta_shared.parameters()) if hasattr(model, "refta_shared") else []
    for _, w in wrappers_of(model):
        params += [w.G, w.B]
    return params


@torch.no_grad()
def merge(model: CausalLM) -> None:
    """W <- W + ΔW for every wrapper (computed in fp32), and put the plain Linears back."""
    for name, w in wrappers_of(model.hf):
        base = w.base_layer
        base.weight.copy_((base.weight.float() + w.delta_weight()).to(base.weight.dtype))
        parent, _, child = name.rpartition(".")
        setattr(model.hf.get_submodule(parent), child, base)
    if hasattr(model, "refta_shared"):
        del model.refta_shared


def trainable_count(model: nn.Module) -> int:
    return sum(p.numel() for p in adapter_parameters(model))


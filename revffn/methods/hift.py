"""`hift`: hierarchical block-wise full fine-tuning (HiFT, Liu et al. 2024, arXiv:2401.15207).

Units, bottom to top: the token embedding, each decoder layer, and the final norm + LM head (any
parameter outside these joins the head unit; a tied head weight stays with the embedding). Units
are grouped `group_size` at a time, bottom up, into k groups. Each optimizer step trains exactly one
group; every other parameter has requires_grad False, so it gets no gradient and AdamW skips it.
Groups are visited in a queue that the `strategy` sets: `bottom2up` (alias `down2up`), `top2down`
(alias `up2down`), or `random`: one permutation drawn once from the run's `seed` and kept for every
cycle (as the HiFT reference shuffles once), so each cycle visits every group exactly once.

Delayed LR: the schedule advances once per full cycle of k steps (`schedule_position = step // k`),
so every group sees the same LR within a cycle. The schedule length is `ceil(max_steps / k)`
positions (one per cycle, the last one possibly partial), so the schedule spans the run exactly as
it spans `max_steps` for the other methods. Note `warmup_steps` counts schedule positions, i.e.
cycles, under hift. (A schedule of max_steps positions advanced once per cycle, as in the reference
implementation, is silently stretched k-fold: the run ends 1/k of the way through it, the LR barely
decayed. Deliberately not reproduced.)

Optimizer state: only the active group's AdamW state lives on the compute device; the others wait
on the CPU (moved in `set_trainable`). `log_metrics` reports the group the step trained
(`hift_group`, e.g. `g2:layer1`), `optimizer_state_bytes_active` (the active group's),
`optimizer_state_bytes_device` (resident on an accelerator now; 0 on CPU runs) and
`optimizer_state_bytes_total`. The queue and its position are in `state_dict` (trainer_state.json);
the per-group AdamW states are in the loop's optimizer.pt, so resume is exact.

Trades: gradients and AdamW states for one group at a time on the device (about 1/k of full
fine-tuning's), activations as in full fine-tuning; each parameter is updated once per k steps,
so it needs about k times more steps for the same number of updates per parameter.
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from torch import nn

from revffn.archs.spec import get_path
from revffn.conversion.causal_lm import CausalLM
from revffn.errors import UserError
from revffn.memory.estimate import Dims, MemoryContext, MemoryTerms, unit_params
from revffn.memory.saved import hift_saved
from revffn.methods.base import Method, export_hf, set_requires_grad
from revffn.schema import Key

STRATEGIES = {"bottom2up": "bottom2up", "down2up": "bottom2up", "top2down": "top2down", "up2down": "top2down",
              "random": "random"}


class HiFTMethod(Method):
    name = "hift"
    OPTIMIZER_IN_BACKWARD = False  # moves the idle groups' optimizer state off the device between steps
    DISTRIBUTED = ()
    DISTRIBUTED_NOTE = "a different group trains every step, its optimizer state moved to the device and back"
    SCHEMA = {
        "strategy": Key(str, "bottom2up", "group visiting order (down2up/up2down are aliases)",
                        choices=tuple(STRATEGIES)),
        "group_size": Key(int, 1, "units (embedding, each layer, norm+head) trained together: larger = fewer, "
                                  "bigger groups, more device memory per step", min=1),
    }
    ESTIMATE_KEYS = ("group_size",)
    STUDY_LR_GRID = (3e-4, 1e-3)  # a full-parameter method: full's grid

    def __init__(self, cfg):
        super().__init__(cfg)
        self.strategy = STRATEGIES[self.opts["strategy"]]
        self.groups: list[list[nn.Parameter]] = []
        self.group_names: list[str] = []
        self.order: list[int] = []
        self.position = 0  # queue position of the next step

    # -- groups ------------------------------------------------------------------------------------
    def _units(self, model: CausalLM) -> list[tuple[str, list[nn.Parameter]]]:
        spec, hf = model.spec, model.hf
        named = [("embed", get_path(hf, spec.embed))]
        named += [(f"layer{i}", layer) for i, layer in enumerate(get_path(hf, spec.layers))]
        named += [("head", get_path(hf, spec.final_norm)), ("head", get_path(hf, spec.head))]
        seen: set[int] = set()
        units: dict[str, list[nn.Parameter]] = {}
        for unit, module in named:
            for p in module.parameters():
                if id(p) not in seen:  # a tied head weight stays with the embedding
                    seen.add(id(p))
                    units.setdefault(unit, []).append(p)
        units.setdefault("head", []).extend(p for p in model.parameters() if id(p) not in seen)
        return [(n, ps) for n, ps in units.items() if ps]

    def _build(self, model) -> None:
        units, g = self._units(model), self.opts["group_size"]
        chunks = [units[i : i + g] for i in range(0, len(units), g)]
        self.groups = [[p for _, ps in chunk for p in ps] for chunk in chunks]
        self.group_names = ["+".join(n for n, _ in chunk) for chunk in chunks]
        k = len(self.groups)
        if self.strategy == "bottom2up":
            self.order = list(range(k))
        elif self.strategy == "top2down":
            self.order = list(range(k - 1, -1, -1))
        else:
            self.order = list(range(k))
            random.Random(self.cfg.seed).shuffle(self.order)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def group_at(self, step: int) -> int:
        return self.order[step % self.num_groups]

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        model = CausalLM(hf_model, self.cfg.router_aux_loss_coef)
        self._build(model)
        return model

    def optimizer_parameters(self, model) -> list[nn.Parameter]:
        return [p for grp in self.groups for p in grp]

    # -- per step --------------------------------------------------------------------------------
    def set_trainable(self, model, step: int, optimizer=None) -> str:
        g = self.group_at(step)
        active = {id(p) for p in self.groups[g]}
        set_requires_grad(model, active)
        if optimizer is not None:  # idle states out first, then the active group's in: one group resident at a time
            for to_device in (False, True):
                for p, state in optimizer.state.items():
                    if (id(p) in active) != to_device:
                        continue
                    device = p.device if to_device else torch.device("cpu")
                    for key, t in state.items():
                        if key != "step" and torch.is_tensor(t) and t.device != device:
                            state[key] = t.to(device)
        self.position = step % self.num_groups
        return self.name  # one stage: a per-group stage would force a log line and a report entry every step

    def schedule_position(self, step: int) -> int:
        return step // self.num_groups

    def schedule_length(self, max_steps: int) -> int:
        return math.ceil(max_steps / self.num_groups)

    def after_step(self, step, model, optimizer) -> None:
        self.position = (step + 1) % self.num_groups

    def log_metrics(self, model, optimizer) -> dict:
        g = self.order[(self.position - 1) % self.num_groups]  # the group the last step trained
        active = {id(p) for p in self.groups[g]}
        total = on_active = on_device = 0
        for p, state in optimizer.state.items():
            for key, t in state.items():
                if key == "step" or not torch.is_tensor(t):
                    continue
                n = t.numel() * t.element_size()
                total += n
                on_active += n if id(p) in active else 0
                on_device += n if t.device.type != "cpu" else 0
        return {"hift_group": f"g{g}:{self.group_names[g]}", "optimizer_state_bytes_active": on_active,
                "optimizer_state_bytes_device": on_device,
                "optimizer_state_bytes_total": total}

    def state_dict(self) -> dict:
        return {"strategy": self.strategy, "order": list(self.order), "position": self.position,
                "groups": list(self.group_names)}

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        if state.get("strategy") != self.strategy or state.get("groups") != self.group_names:
            raise UserError(f"hift: the checkpoint has strategy={state.get('strategy')!r}, groups "
                            f"{state.get('groups')}; this run has strategy={self.strategy!r}, groups "
                            f"{self.group_names}. Fix: resume with the same hift options and model.")
        self.order = [int(i) for i in state["order"]]
        self.position = int(state["position"])

    def export(self, model, out_dir: Path) -> None:
        """A plain HF `save_pretrained` directory, loadable by HF and `revffn.load`."""
        export_hf(model, out_dir, method=self.name, strategy=self.strategy, group_size=self.opts["group_size"],
                  num_groups=self.num_groups)

    # -- memory estimate ---------------------------------------------------------------------------
    @classmethod
    def memory_terms(cls, ctx: MemoryContext, group_size: int) -> MemoryTerms:
        """Grads and states for the largest group only; activations the largest over the groups."""
        groups = group_params(ctx.m, ctx.counts, group_size)
        note = (f"hift: {len(groups)} groups of {group_size} unit(s) (embedding, each layer, norm+head); grads "
                "and optimizer states for the largest group only (all params are trained in turn); "
                "activations: the largest over groups (the active group's, plus what input gradients need "
                "in the frozen layers above it)")
        return MemoryTerms(trainable=max(groups), activations_forward=hift_saved(
            ctx.m, ctx.B, ctx.T, ctx.s, ctx.padded, ctx.impl, group_size), notes=(note,))


def group_params(m: Dims, counts: dict[str, int], group_size: int) -> list[int]:
    """Parameters per group of `group_size` units (embedding, each layer, final norm + head)."""
    units = unit_params(m, counts)
    return [sum(units[j : j + group_size]) for j in range(0, len(units), group_size)]

"""The method interface: how a fine-tuning method plugs into the one training loop.

A method is one small file: a `Method` subclass that owns everything about itself (its option
schema, the model it trains, the trainable set of each step, its export) and one line in the
registry (`revffn.methods.METHODS`). The loop, the bench, the study and the estimator only call the
methods below; nothing elsewhere branches on a method's name.

Three groups of hooks: training (an instance, built from the run's config), the memory estimate
(`ESTIMATE_KEYS`, `ESTIMATE_OPTIONS`, `estimate_options`, `memory_terms`: class-level, a config is never needed) and
the quality study (`STUDY_LR_GRID`, `STUDY_OPTIONS`, `STUDY_GAP_VARIANTS`, `study_options`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from revffn.errors import UserError
from revffn.memory.estimate import MemoryContext, MemoryTerms
from revffn.schema import Key, Record, record_type


@dataclass
class TokenSum:
    """A method's extra loss summed over its micro-batch's input tokens (attention_mask): train_step divides it by
    the input tokens of the step's whole batch, over micro-batches and data-parallel ranks, as it divides the task
    loss by the predicted tokens, so every token weighs alike however the batch is split (RevFFN's distillation)."""

    value: torch.Tensor


class Method:
    """Base of defaults (as PEFT's `BaseTuner`). Subclasses must set `name` and define `prepare`,
    `optimizer_parameters` and `export`; every other method has a default that
    most methods keep."""

    name: ClassVar[str]
    SCHEMA: ClassVar[dict[str, Key]] = {}  # option name -> Key, under the YAML section `name:`
    Options: ClassVar[type[Record]] = Record  # each subclass's own, made from its SCHEMA (`__init_subclass__`)
    # memory estimate: option name -> Key (beyond `revffn.memory.estimate.COMMON_OPTIONS`)
    # the estimator's view of the method: the SCHEMA keys it reads, under their own names (declared once, in
    # SCHEMA), and options only the estimator has (`ESTIMATE_OPTIONS`, e.g. revffn's `stage`)
    ESTIMATE_KEYS: ClassVar[tuple[str, ...]] = ()
    ESTIMATE_OPTIONS: ClassVar[dict[str, Key]] = {}
    # quality study: the declared LR grid (None: not in the study), the YAML section of its runs, and
    # label -> options replacing STUDY_OPTIONS for the conversion-gap runs (non-empty: the method changes
    # the model before training, so the study measures the retention gap at init, after the stage
    # boundary and after the schedule)
    STUDY_LR_GRID: ClassVar[tuple[float, ...] | None] = None
    STUDY_OPTIONS: ClassVar[dict] = {}
    STUDY_GAP_VARIANTS: ClassVar[dict[str, dict]] = {}
    # a model directory that already holds a converted RevFFN model (`revffn convert`): only methods
    # whose `prepare` accepts the converted model as it is may train it
    ACCEPTS_CONVERTED: ClassVar[bool] = False
    # `optimizer_in_backward`: the loop may step each parameter from its gradient hook (False: the method
    # moves or reads optimizer state itself between steps, e.g. HiFT)
    OPTIMIZER_IN_BACKWARD: ClassVar[bool] = True
    # the data-parallel strategies (`distributed`) that train the method exactly: it trains the same
    # parameters on every rank, with optimizer state where the parameters are. HiFT (none) moves
    # optimizer state between devices and changes the trained group every step; DISTRIBUTED_NOTE says why
    DISTRIBUTED: ClassVar[tuple[str, ...]] = ("ddp", "fsdp")
    DISTRIBUTED_NOTE: ClassVar[str] = ""
    # `prepare` works on a model whose parameters are on the meta device, so that under FSDP each rank loads only
    # its shards (`models.sharded`); `prepares_on_meta` may refuse it for some of the method's options
    META_PREPARE: ClassVar[bool] = False
    # libraries `prepare` imports (PEFT's methods: peft): a bench measurement imports them before its memory baseline,
    # so that a method's peak counts its tensors, not a library's code; and the other methods' processes not at all
    LIBRARIES: ClassVar[tuple[str, ...]] = ()

    # set by `build_run` before `prepare`: a checkpoint will overwrite every weight `prepare` sets, so work that
    # only initializes weights (RevFFN's calibration) may be skipped
    resuming: bool = False

    def __init__(self, cfg):
        self.cfg, self.opts = cfg, cfg.options(self.name)  # typed and frozen: opts.replace(key=value) for a copy

    def __init_subclass__(cls, **kwargs):
        """Each method class gets `Options`: the frozen dataclass of its options, one typed field per `SCHEMA` key."""
        super().__init_subclass__(**kwargs)
        cls.Options = record_type(f"{cls.__name__.removesuffix('Method')}Options", cls.SCHEMA,
                                  module=cls.__module__, qualname=f"{cls.__qualname__}.Options")

    @classmethod
    def trains_converted(cls, options: dict) -> bool:
        """Whether runs with this YAML section start from a `revffn convert` output when a study has one (a
        method that converts differently, or not at all, with some options trains the base itself)."""
        return cls.ACCEPTS_CONVERTED

    @classmethod
    def model_defaults(cls, model: str) -> dict:
        """Defaults of this method's options that `model` decides (the structure a converted directory was written
        with); a config's own values win. Default: none."""
        return {}

    @classmethod
    def unused_options(cls, opts: dict, defaults: dict | None = None) -> dict[str, tuple[str, str]]:
        """The options of `opts` (a whole section, or some keys over the defaults; `defaults`: `model_defaults`) set
        to other than their default that the run they describe would not read: key -> (the setting that reads it,
        the run's own). `validate` refuses them; the study drops those its own presets set. Default: none."""
        return {}

    @classmethod
    def validate(cls, cfg) -> None:
        """Cross-key checks beyond types and ranges; raise UserError."""

    # -- required ---------------------------------------------------------------------------
    def prepare(self, hf_model: nn.Module) -> nn.Module:
        """The model to train: forward(input_ids, attention_mask, labels, return_logits) -> output."""
        raise NotImplementedError

    def optimizer_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """Every parameter that may train at some step (the optimizer holds these)."""
        raise NotImplementedError

    def export(self, model: nn.Module, out_dir: Path) -> None:
        """Write the final model to out_dir (model files + revffn.json); the loop adds the tokenizer."""
        raise NotImplementedError

    # -- optional, with defaults --------------------------------------------------------------
    def fsdp_units(self, model: nn.Module) -> list[nn.Module]:
        """`distributed: fsdp`: the modules FSDP2 shards one by one (each all-gathered only while it
        runs), innermost first; the rest of the model goes to the root. They must be called through
        `__call__` (FSDP2's hooks). Default: the HF decoder layers (`_no_split_modules`, the classes
        HF names as its sharding units), wherever the method's wrappers put them."""
        names = set(getattr(model.hf if hasattr(model, "hf") else model, "_no_split_modules", None) or ())
        return [m for m in model.modules() if type(m).__name__ in names]

    def set_trainable(self, model: nn.Module, step: int, optimizer=None) -> str:
        """Set requires_grad for `step` (0-based) and return the stage name to log. May also move
        optimizer state between devices (HiFT keeps only the active group's on the device).
        Default: every optimizer parameter trains at every step, in one stage named after the method."""
        set_requires_grad(model, {id(p) for p in self.optimizer_parameters(model)})
        return self.name

    def restructure(self, model: nn.Module, step: int) -> list[nn.Parameter]:
        """Change the model's structure before `step` (0-based), and return the parameters removed from it (the
        loop takes them out of the optimizer; `training.step.restructure`). Called before every step and, on a
        resume, before the checkpoint is loaded, so the model has the structure the checkpoint was saved with.
        Default: the structure never changes. (RevFFN folds its P_down adapters into the layers at stage 2.)"""
        return []

    def prepares_on_meta(self) -> bool:
        """Whether `prepare` works, with this run's options, on a model whose parameters are on the meta device
        (FSDP2's sharded loading: `models.sharded`), every weight it makes set again by `after_load`."""
        return self.META_PREPARE

    def after_load(self, model: nn.Module) -> None:
        """Once the weights are in place (after `prepare` and, under FSDP, sharding; the root gathered), before a
        checkpoint is loaded: the weights `prepare` made, if it made them on the meta device, and work on the
        loaded weights. Default: nothing. (RevFFN: its adapters' init and calibration on a sharded load.)"""

    def after_load_runs_model(self) -> bool:
        """Whether `after_load` may call the model's modules (RevFFN's calibration and stream choice): under FSDP
        the root (embeddings, final norm, head) is all-gathered for it and resharded after; otherwise the first
        step's forward gathers it. Default: whether the method has an `after_load` of its own."""
        return type(self).after_load is not Method.after_load

    @classmethod
    def check_data(cls, cfg, items: list) -> None:
        """Before the run writes anything: what the method needs of the tokenized training set (`items`;
        streamed data is not read ahead). RevFFN: a cached teacher computed for this data and model."""

    def frozen_copies(self) -> list[nn.Module]:
        """Frozen models the method keeps beside the trained one (RevFFN's distillation teacher copy): under FSDP
        they are sharded like it (`fsdp_units`), so none is whole on every rank."""
        return []

    def before_training(self, model: nn.Module, items: list | None) -> None:
        """Once per run, after the model is built (and a checkpoint loaded), before the first step: work over the
        tokenized training set (`items`, (input_ids, labels) pairs; None when the data streams), as RevFFN's
        cached distillation teacher. Under FSDP every rank calls it, the root gathered."""

    def step_batches(self, model: nn.Module, step: int, micro_batches: list[dict]) -> list[dict]:
        """The micro-batches step `step` trains on. Default: the task's (RevFFN's heal stage swaps in
        heal text). Must depend only on `step` and the config, so that a resumed run sees the same."""
        return micro_batches

    def forward(self, model: nn.Module, batch: dict, step: int) -> tuple:
        """(output, extra) of one micro-batch: `output.loss_sum` is summed over the positions its labels
        select (train_step divides by their count over the step's micro-batches); `extra` is None, a
        scalar loss already averaged over this micro-batch (train_step divides it by the number of
        micro-batches), or a `TokenSum`. Default: the model's causal-LM loss, nothing extra.

        Under `distributed: ddp`, `model` is the `DistributedDataParallel` wrapper
        (`training.parallel.DDPModel`): calling it is what all-reduces the gradients; its attributes
        are the wrapped model's. Under `fsdp`, the sharded model itself (its root is all-gathered)."""
        return model(**batch, return_logits=False), None

    def schedule_position(self, step: int) -> int:
        """Position of `step` in the LR schedule (HiFT advances once per cycle)."""
        return step

    def schedule_length(self, max_steps: int) -> int:
        """Length of the LR schedule for a run of max_steps optimizer steps."""
        return max_steps

    def after_step(self, step: int, model: nn.Module, optimizer) -> None:
        """Hook after the optimizer step (e.g. move idle optimizer state off the device)."""

    def log_metrics(self, model: nn.Module, optimizer) -> dict:
        """Extra method-specific fields for metrics.jsonl (e.g. optimizer bytes resident on device)."""
        return {}

    def state_dict(self) -> dict:
        """Method state saved in checkpoints (trainer_state.json) for an exact resume."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` on resume."""

    def steady_state_step(self) -> int:
        """The first step of the method's steady state: the bench measures from there, the study
        evaluates retention at that boundary (RevFFN: stage 2)."""
        return 0

    # -- memory estimate (class-level: needs no config) ---------------------------------------------
    @classmethod
    def estimate_keys(cls) -> dict[str, Key]:
        """Every option `memory_terms` takes: the SCHEMA keys named in `ESTIMATE_KEYS`, then `ESTIMATE_OPTIONS`."""
        return {**{k: cls.SCHEMA[k] for k in cls.ESTIMATE_KEYS}, **cls.ESTIMATE_OPTIONS}

    @classmethod
    def estimate_options(cls, section: dict) -> dict:
        """The estimator options of a training config's method section: its `ESTIMATE_KEYS` values."""
        return {k: section[k] for k in cls.ESTIMATE_KEYS}

    @classmethod
    def memory_terms(cls, ctx: MemoryContext, **options) -> MemoryTerms:
        """This method's part of `revffn.memory.estimate.estimate` (`options`: its `estimate_keys()`,
        defaults filled in). Default: full fine-tuning, every parameter trains and every layer keeps
        what its backward needs."""
        return MemoryTerms(trainable=ctx.counts["total"], activations_forward=ctx.full_activations)

    # -- quality study -----------------------------------------------------------------------------
    @classmethod
    def study_options(cls, steps: int, **variant) -> dict:
        """The YAML section of a study run of `steps` optimizer steps: STUDY_OPTIONS, `variant` on top."""
        return {**cls.STUDY_OPTIONS, **variant}


def set_requires_grad(model: nn.Module, trainable: set[int]) -> None:
    """requires_grad=True exactly for parameters whose id() is in `trainable`."""
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)


def non_router_parameters(model: nn.Module, freeze_router: bool) -> list[nn.Parameter]:
    """Every parameter of `model`, less the MoE routers' when `freeze_router` is set."""
    routers = {id(p) for r in model.routers() for p in r.parameters()} if freeze_router else set()
    return [p for p in model.parameters() if id(p) not in routers]


def export_hf(model: nn.Module, out_dir: Path, **manifest) -> None:
    """A plain HF `save_pretrained` directory (safetensors) of `model.hf`, plus revffn.json."""
    model.hf.save_pretrained(out_dir)
    write_manifest(out_dir, format="hf", **manifest)


def write_manifest(out_dir: Path, **fields) -> None:
    (out_dir / "revffn.json").write_text(json.dumps(fields, indent=2))


def check_not_head(method: str, target: str, names: list[str], head: str) -> None:
    """An adapter target must not be the LM head: the loss reads the head's weight itself (`causal_lm_loss`'s
    chunked cross-entropy), so an adapter wrapped around it would never see a gradient."""
    if head in names:
        raise UserError(f"{method}.target_modules: {target!r} matches the LM head ({head}), whose weight the loss "
                        "reads directly (a chunked cross-entropy): an adapter there would never train. Fix: target "
                        "the decoder layers' projections (e.g. q_proj, v_proj), or method=full to train the head.")

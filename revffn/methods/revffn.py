"""`revffn`: full fine-tuning through reversible blocks, in two stages.

Stage 1 (`adapter_warmup_steps`), the heal: only the projection adapters P_up/P_down (and the skips
P_skip, `adapter_skip`: see `conversion.convert.HFRevBlock`) train, the
pretrained backbone is frozen, and the loss is KL(unconverted model ‖ converted model) on general
text (`heal_data`, default `self`: text sampled from the base; no data needed). The teacher is the
same frozen weights in their original wiring (`conversion.teacher`), so nothing is copied; `heal_norms`
trains the blocks' norms too, `heal_hidden_coef` adds the per-layer hidden-state loss (`conversion.heal`).
A run whose stage 1 is all of it (adapter_warmup_steps = max_steps) is a heal: what `revffn convert
--heal-steps` runs, through the same loop.
`heal_data: task` is the old warm-up instead: cross-entropy on the task's batches (a measured
failure for retention, docs/conversion.md). Stage 2: everything trains except the routers
(`freeze_router: true`, for routing stability); `distill_coef` > 0 adds KL to the original model on
each training batch, its teacher a frozen copy of the weights taken before training (+1x weights).
One AdamW holds every parameter that will ever train; frozen ones have no gradient, so AdamW skips
them and keeps the adapters' state across the boundary. At full width with `fold_adapters` (the default),
stage 2 starts by multiplying each P_down into its branch's last linear maps (`conversion.fold`, the
`restructure` hook): the same function, and P_down, its gradient and its AdamW moments are gone; the
skips keep theirs.

Trades: activation memory flat in depth (two streams, d wide each by default, + one layer) for one extra forward per
layer in backward; grads and optimizer states stay those of full fine-tuning. `recompute_chunk_tokens`
shrinks the one layer further: its MoE branch is recomputed in backward a chunk of tokens at a time.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch
from torch import nn

from revffn.archs.spec import get_path
from revffn.conversion.convert import (
    ADAPTER_INITS,
    AUTO,
    COUPLINGS,
    STREAM_DTYPES,
    STREAM_WIDTHS,
    RevFFNForCausalLM,
    convert,
    describe_streams,
    pick_stream_dtype,
)
from revffn.conversion.heal import block_outputs, hidden_mse, norm_parameters, original_norms, teacher_states
from revffn.conversion.loss import distill_kl
from revffn.conversion.teacher import student_hidden, teacher_hidden
from revffn.data import DEFAULT_CALIBRATION
from revffn.data.calibration import SELF
from revffn.data.collate import data_shard, shard_rows
from revffn.errors import UserError, unread
from revffn.memory.estimate import MemoryContext, MemoryTerms, dtype_bytes
from revffn.methods.base import Method, TokenSum, non_router_parameters, set_requires_grad, write_manifest
from revffn.models.hf_remote import dtype_name, save_converted
from revffn.reversible.buffered import (
    BUFFER_BITS,
    DEFAULT_BUFFER_BITS,
    DEFAULT_MOMENTUM,
    MOMENTUM_SIGNS,
    deterministic_kernels,
)
from revffn.reversible.replay import compact_index_dtype
from revffn.schema import Key

DISTILL_TEACHERS = ("copy", "cached")  # distill_teacher: `methods.teacher_cache` for the second
TASK = "task"  # heal_data: the old stage 1, cross-entropy on the training data
# The backward recompute by chunks of this many tokens (`RevBlock`'s chunked G; F by whole sequences): its working
# set is then one chunk's. On the CPU bench's 16-layer profile (4 x 512 and 4 x 2048 tokens, adapters frozen),
# against 4096 it takes RevFFN's peak from 402 to 385 MiB and from 515 to 451 MiB at 0.97-0.98x the tokens/s
# (docs/benchmarks.md, bench_chunks); 512 saves no more at 4 x 2048. Not measured on a GPU, where a smaller chunk
# gives each expert fewer rows a matmul: raise it there if memory allows.
RECOMPUTE_CHUNK_TOKENS = 1024


# the additive coupling's options (adapters, their calibration, stage 1, the streams): the buffered coupling reads none
ADDITIVE_OPTIONS = ("adapter_warmup_steps", "adapter_warmup_ratio", "train_adapters", "stream_dtype", "adapter_init",
                    "adapter_skip", "stream_width", "calibration_data", "calibration_tokens", "heal_data", "heal_norms",
                    "heal_hidden_coef", "fold_adapters")
BUFFERED_OPTIONS = ("buffer_bits", "buffer_momentum")  # the buffered coupling's: the additive one reads neither


def _sequences(n: int) -> str:
    """'1 sequence', '4 sequences' (at least one)."""
    n = max(1, n)
    return f"{n} sequence{'s' if n > 1 else ''}"


class RevFFNMethod(Method):
    name = "revffn"
    SCHEMA = {
        "coupling": Key(str, "buffered", "buffered: every decoder layer whole on int64 fixed-point streams, h' = h + "
                        "layer update + 2^-buffer_bits x the last velocity (buffer_momentum), exactly invertible "
                        "with buffer_bits bits a coordinate a layer kept for the backward: no adapters, no "
                        "calibration, no stage 1, the pretrained model within 0.003 nats (SmolLM2); additive: Y_1 = "
                        "X_1 + F(X_2), Y_2 = X_2 + G(Y_1), the pretrained attention and MoE between calibrated "
                        "adapters, a heal (stage 1) then stage 2, activation memory flat in depth (SmolLM2: +1.8 "
                        "nats calibrated; docs/conversion.md); the adapter, calibration, heal and stream options "
                        "below are the additive coupling's, refused under the buffered one (and the buffer's under "
                        "the additive one)",
                        choices=COUPLINGS),
        "buffer_bits": Key(int, DEFAULT_BUFFER_BITS, "coupling buffered: k, the coupling's 2^-k and the bits a "
                           "coordinate a layer the backward keeps (k/8 bytes; 6: 3/8 of bf16 checkpoints of every "
                           "layer input; SmolLM2 keeps 72 of 76 probe answers at 6, 69 at 4; the base 74)",
                           min=min(BUFFER_BITS), max=max(BUFFER_BITS)),
        "buffer_momentum": Key(str, DEFAULT_MOMENTUM, "coupling buffered: the sign of the coupling's 2^-k. positive: "
                               "v' = 2^-k v + D(h), h' = h + v' (heavy-ball momentum; SmolLM2 -0.002 nats at 6 bits, "
                               "+0.003 at 4); negative: v' = D(h) - 2^-k v, the form before stop 50 (+0.004 at 6, "
                               "+0.028 at 4; runs and directories without the key)", choices=tuple(MOMENTUM_SIGNS)),
        "adapter_warmup_steps": Key(int, 10, "stage 1: steps that train only the projection adapters", min=0),
        "adapter_warmup_ratio": Key((float, type(None)), None, "stage 1 as a fraction of max_steps (at least 1 step, "
                                    "at most max_steps - 1), instead of adapter_warmup_steps; null: the steps",
                                    min=0.0, max=1.0),
        "freeze_router": Key(bool, True, "stage 2: keep the MoE routers frozen"),
        "train_adapters": Key(bool, False, "stage 2: also train the adapters (the skips, and P_down where not "
                              "folded); false: they stay as calibrated and healed, with no gradients or optimizer "
                              "states (the quickstart, 3 seeds at 4096-token chunks: 95 % exact match against "
                              "69 %, retention 6.14 against 8.42, docs/results.md; SmolLM2 forgets less at the same "
                              "task score: docs/conversion.md)"),
        "stream_dtype": Key(str, AUTO, "dtype of the residual streams: auto measures, once the adapters are set, "
                            "how far float32 streams rebuild each layer's input from the top (2 x 64 random tokens) "
                            "and takes float64 (twice the stream bytes) where that is over 3e-2 of the stream scale: "
                            "on a deep pretrained model with massive activations float32's rounding compounds "
                            "(SmolLM2: layer 0's gradient 76 % off); float32 elsewhere (docs/engine.md)",
                            choices=(AUTO, *STREAM_DTYPES)),
        "adapter_init": Key(str, "calibrated", "projection adapter init", choices=ADAPTER_INITS),
        "adapter_skip": Key(bool, True, "add a linear skip to each branch (F(X_2) += P_skip X_2, G alike), as wide "
                            "as a stream: the residual path the coupling cuts; false: P_up / P_down only"),
        "stream_width": Key(str, "full", "width of each of the two reversible streams: full (d; P_down and the skip "
                            "d x d, no P_up) or half (d/2, the paper's; P_up and P_down per branch)",
                            choices=STREAM_WIDTHS),
        "calibration_data": Key(str, DEFAULT_CALIBRATION, "calibrated init: general text, never the task data "
                                "alone: a data file, builtin:NAME (the default: Python's docstrings) or `self` (text "
                                "sampled from the base)", path=True),
        "calibration_tokens": Key(int, 32768, "calibrated init: calibration tokens (rows of 128)", min=1),
        "heal_data": Key(str, DEFAULT_CALIBRATION, "stage 1: text the adapters heal on by KL to the unconverted "
                         "model: a data file or builtin:NAME (the default: Python's docstrings, the calibration's "
                         "text; the quickstart 96.7 % exact match against 89.0 % on `self`, SmolLM2 4.05 nats "
                         "against a rise on `self`: docs/conversion.md), `self` (sampled from the model) or `task` "
                         "(cross-entropy on the training data)", path=True),
        "heal_norms": Key(bool, False, "stage 1: train the blocks' RMSNorm weights too (the teacher keeps the "
                          "original ones)"),
        "heal_hidden_coef": Key(float, 0.0, "stage 1: weight of the per-layer hidden-state loss (relative MSE to "
                                "the unconverted model's states) added to the KL; > 0 runs stage 1 as the plain "
                                "twin (every layer's graph kept)", min=0.0),
        "distill_coef": Key(float, 0.0, "stage 2: weight of KL to the original model on each training batch "
                            "(its teacher: distill_teacher)", min=0.0),
        "distill_teacher": Key(str, "copy", "distill_coef > 0: copy (a frozen copy of the weights, +1x weights "
                               "memory, a teacher forward per batch) or cached (the original model's final hidden "
                               "states for every training example, computed once before training into "
                               "teacher_cache, and a copy of the head only)", choices=DISTILL_TEACHERS),
        "teacher_cache": Key(str, "", "distill_teacher cached: its directory (empty: OUTPUT_DIR/teacher_cache), "
                             "reused while the data and the model are the same", path=True),
        "fold_adapters": Key(bool, True, "stage 2, full width: multiply each P_down into its branch's last linear maps "
                             "(attention's output projection, the experts' down projections) and drop it: the same "
                             "function, 2 d^2 fewer trainable parameters a layer and two fewer d x d matmuls per token "
                             "(conversion.fold; not with optimizer_offload)"),
        "recompute_chunk_tokens": Key(int, RECOMPUTE_CHUNK_TOKENS, "backward: recompute and back-propagate each "
                                      "layer's MoE branch by chunks of N tokens, and its attention by chunks of "
                                      "whole sequences of at most N tokens (at least one), so its working set is "
                                      "one chunk's (0: the whole batch; a branch that draws random numbers is "
                                      "recomputed whole)", min=0),
    }
    ESTIMATE_KEYS = ("freeze_router", "train_adapters", "stream_dtype", "adapter_skip", "stream_width", "distill_coef",
                     "distill_teacher", "recompute_chunk_tokens", "fold_adapters", "coupling", "buffer_bits")
    ESTIMATE_OPTIONS = {
        "stage": Key(int, 2, "1: only the adapters train; 2: everything but (if frozen) the routers", min=1, max=2)}
    ACCEPTS_CONVERTED = True  # `revffn convert` output: trained as it is, not converted again
    META_PREPARE = True  # converts on meta; `after_load` inits and calibrates the adapters (`prepares_on_meta`)
    converted_from: str | None = None  # set by `prepare` when the model came converted
    calibration: dict | None = None  # set by `prepare`: the calibration report (adapter_init: calibrated)
    teacher: nn.Module | None = None  # distill_coef > 0, distill_teacher copy: frozen copy of the model before training
    teacher_cache = None  # distill_teacher cached: a `methods.teacher_cache.TeacherCache` (`before_training`)
    heal_rows = None  # stage 1 on heal text: a `data.calibration.StepRows`
    on_meta = False  # `prepare` converted a model without weights (sharded loading): `after_load` sets them
    norm_originals: list | None = None  # heal_norms: the norm weights before training (the teacher's)
    reversible = True  # whether the prepared model runs reversibly outside a heal with heal_hidden_coef
    fold_plan: list | None = None  # fold_adapters: the [layer, adapter] pairs folded at stage 2 (None: not yet)
    folded_here = False  # whether this process's model has had fold_plan applied
    streams: dict | None = None  # stream_dtype auto: the choice and its measured rebuild error (`_pick_streams`)
    STUDY_LR_GRID = (3e-4, 1e-3)  # a full-parameter method: full's grid
    # the defaults (calibrated, heal on self) at the paper's half width: the study of docs/study.md ran on the 4-layer
    # builtin:base at it, which learns the toy tasks faster than full width (the quickstart: 90 % against 62 %)
    # and `self` calibration text, the default when it ran
    STUDY_OPTIONS = {"coupling": "additive", "adapter_warmup_steps": 50, "freeze_router": True, "stream_width": "half",
                     "calibration_data": SELF, "heal_data": SELF, "train_adapters": True}  # as when it ran
    STUDY_GAP_VARIANTS = {  # the paper's four adapters, the old default (coordinate init, task warm-up, no
        # skips) and the stage-2 guard by each teacher route (a frozen copy; the cached final states and the head)
        "no-skip": {"adapter_skip": False},
        "old-default": {"adapter_init": "coordinate", "heal_data": TASK, "adapter_skip": False},
        "distill-1": {"distill_coef": 1.0},
        "distill-1-cached": {"distill_coef": 1.0, "distill_teacher": "cached"},
    }

    def __init__(self, cfg):
        super().__init__(cfg)
        self.opts = self.opts.replace(adapter_warmup_steps=self.warmup_steps(self.opts, cfg.max_steps))

    @staticmethod
    def warmup_steps(opts: dict, max_steps: int) -> int:
        """Stage 1's length: `adapter_warmup_steps`, or `adapter_warmup_ratio` of max_steps when set; none with the
        buffered coupling (no adapters to heal)."""
        if opts.get("coupling") == "buffered":
            return 0
        if opts.get("adapter_warmup_ratio") is None:
            return opts["adapter_warmup_steps"]
        return min(max(1, round(opts["adapter_warmup_ratio"] * max_steps)), max_steps - 1)

    @classmethod
    def model_defaults(cls, model: str) -> dict:
        """A converted directory is trained as it is: the structure it was written with is the default (`validate`
        refuses a config that asks for another)."""
        from revffn.models.loading import converted_option, is_converted

        if not isinstance(model, str) or not is_converted(model):
            return {}
        coupling = converted_option(model, "coupling")
        structure = ("buffer_bits", "buffer_momentum") if coupling == "buffered" else ("adapter_skip", "stream_width")
        return {"coupling": coupling, **{name: converted_option(model, name) for name in structure}}

    @classmethod
    def unused_options(cls, opts: dict, defaults: dict | None = None) -> dict[str, tuple[str, str]]:
        """Each coupling reads its own options: the additive coupling ADDITIVE_OPTIONS, the buffered one buffer_bits
        and buffer_momentum (the default changed from additive to buffered in stop 47: an additive config or command
        of before would otherwise train the other coupling, its options unread). An option that a switch of the
        same coupling turns off (the heal's with adapter_warmup_steps 0, the teacher's with distill_coef 0) is
        kept, as HF's TrainingArguments keep warmup_ratio beside warmup_steps: turning a feature off is not an
        error."""
        d = {k: key.default for k, key in cls.SCHEMA.items()} | (defaults or {})
        coupling = opts.get("coupling", d["coupling"])
        keys, other = (ADDITIVE_OPTIONS, "additive") if coupling == "buffered" else (BUFFERED_OPTIONS, "buffered")
        has = f"revffn.coupling={coupling}" + (" (the default)" if coupling == d["coupling"] else "")
        return {k: (f"revffn.coupling={other}", has) for k in keys if k in opts and opts[k] != d[k]}

    @classmethod
    def validate(cls, cfg) -> None:
        opts = cfg.section(cls.name)
        unused = cls.unused_options(opts, cls.model_defaults(cfg.model))
        if unused:
            shown = {k: str(opts[k]).lower() if isinstance(opts[k], bool) else opts[k] for k in unused}
            lines = [unread(f"revffn.{k}={shown[k]}", reads, f"this run has {has}", f"drop revffn.{k}, or set {reads}")
                     for k, (reads, has) in unused.items()]
            raise UserError(lines[0] if len(lines) == 1 else f"{len(lines)} problems in the config:\n  - "
                            + "\n  - ".join(lines))
        opts["adapter_warmup_steps"] = cls.warmup_steps(opts, cfg.max_steps)
        from revffn.models.loading import converted_option, is_converted

        if is_converted(cfg.model):  # trained as it is: its structure is what it was converted with
            structure = ("buffer_bits", "buffer_momentum") if opts["coupling"] == "buffered" else \
                ("adapter_skip", "stream_width")
            for name in ("coupling", *structure):
                held, asked = converted_option(cfg.model, name), opts[name]
                if held != asked:
                    show = (lambda v: str(v).lower()) if name == "adapter_skip" else str
                    raise UserError(f"revffn.{name}={show(asked)}: {cfg.model!r} was converted with "
                                    f"{name}={show(held)}, and a converted model is trained as it is. Fix: "
                                    f"revffn.{name}={show(held)}, or convert the base model again.")
        if opts["adapter_warmup_steps"] > cfg.max_steps:
            raise UserError(f"revffn.adapter_warmup_steps={opts['adapter_warmup_steps']} is more than max_steps="
                            f"{cfg.max_steps}. Fix: at most max_steps (equal: a heal only, no stage 2).")
        if opts["distill_coef"] > 0 and opts["distill_teacher"] == "cached" and cfg.streaming:
            raise UserError("revffn.distill_teacher=cached: the cache holds every training example's teacher states, "
                            "computed before training, and a streamed data set (streaming: true) is not read ahead. "
                            "Fix: revffn.distill_teacher=copy, or streaming: false.")
        if opts["coupling"] == "buffered" and opts["distill_coef"] > 0 and opts["distill_teacher"] == "cached":
            raise UserError("revffn.distill_teacher=cached is not built for revffn.coupling=buffered. Fix: "
                            "revffn.distill_teacher=copy.")
        if opts["adapter_init"] == "calibrated" and opts["calibration_data"] != "self" and \
                opts["coupling"] == "additive":
            from revffn.data.calibration import file_rows
            from revffn.data.tokenizer import model_tokenizer
            from revffn.models.loading import model_kind

            model_kind(cfg.model)  # a bad model reference is the error to report, not its tokenizer's (a config-only
            # geometry, random init for bench / check / estimate, is a good one here: `train` refuses it itself)

            file_rows(opts["calibration_data"], model_tokenizer(cfg.model, cfg.tokenizer), opts["calibration_tokens"],
                      "revffn.calibration_data", budget_key="revffn.calibration_tokens")
        if opts["adapter_warmup_steps"] and opts["heal_data"] not in (SELF, TASK):
            from revffn.data.calibration import file_rows
            from revffn.data.tokenizer import model_tokenizer

            file_rows(opts["heal_data"], model_tokenizer(cfg.model, cfg.tokenizer), None, "revffn.heal_data")

    @classmethod
    def trains_converted(cls, options: dict) -> bool:
        """The buffered coupling converts nothing worth sharing (no calibration): its runs load the base."""
        return options.get("coupling", cls.SCHEMA["coupling"].default) == "additive"

    @classmethod
    def study_options(cls, steps: int, **variant) -> dict:
        """STUDY_OPTIONS and `variant`, the warm-up cut to leave a stage-2 step in a short run."""
        opts = {**cls.STUDY_OPTIONS, **variant}
        opts["adapter_warmup_steps"] = min(opts["adapter_warmup_steps"], steps - 1)
        if steps < opts["adapter_warmup_steps"] + 10:  # a smoke run (`--quick`): calibrate on little text
            opts["calibration_tokens"] = 1024
        return opts

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        """Convert (and calibrate) `hf_model`; a model `revffn convert` wrote is already converted: kept as is."""
        dtype = STREAM_DTYPES.get(self.opts["stream_dtype"], torch.float32)  # auto: set by `_pick_streams`
        if isinstance(hf_model, RevFFNForCausalLM):
            self.converted_from = self.cfg.model
            hf_model.stream_dtype = dtype
            if self.cfg.router_aux_loss_coef is not None:
                hf_model.aux_loss_coef = self.cfg.router_aux_loss_coef
            hf_model.recompute_chunk_tokens = self.opts["recompute_chunk_tokens"]
            return self._prepare_stages(hf_model)
        model = convert(hf_model, adapter_init=self.opts["adapter_init"], stream_dtype=dtype,
                        aux_loss_coef=self.cfg.router_aux_loss_coef, adapter_skip=self.opts["adapter_skip"],
                        stream_width=self.opts["stream_width"], coupling=self.opts["coupling"],
                        buffer_bits=self.opts["buffer_bits"], buffer_momentum=self.opts["buffer_momentum"])
        model.recompute_chunk_tokens = self.opts["recompute_chunk_tokens"]
        self.on_meta = next(model.parameters()).is_meta  # sharded loading: the weights come after sharding
        if not self.on_meta:
            self._calibrate(model)
        return self._prepare_stages(model)

    def _pick_streams(self, model) -> None:
        """stream_dtype auto: float32 or float64 streams, from the rebuild error of the model as it will start
        training (adapters calibrated or loaded, on its device, sharded or not; `after_load`). A resumed run keeps
        the first run's choice (`state_dict`; applied by `restructure`), measured on the weights it started from."""
        from revffn.methods.calibration import log_line

        if self.opts["coupling"] == "buffered":  # the streams are fixed point, rebuilt bitwise
            if data_shard()[0] == 0:  # (the same on every rank: rank 0 says it)
                log_line(f"coupling buffered: every decoder layer whole on int64 fixed-point streams, "
                         f"{self.opts['buffer_bits']} bits a coordinate a layer kept for the backward, "
                         f"{self.opts['buffer_momentum']} momentum")
            return
        if self.opts["stream_dtype"] != AUTO or self.resuming:
            return

        reduce = (lambda t: torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)) \
            if data_shard()[1] > 1 else None
        self.streams = pick_stream_dtype(model, reduce=reduce)
        if self.teacher is not None:  # distill_coef's frozen copy runs the same streams
            self.teacher.stream_dtype = model.stream_dtype
        if data_shard()[0] == 0:  # (all-reduced: the same on every rank)
            log_line(describe_streams(self.streams))

    def _calibrate(self, model) -> None:
        if self.opts["coupling"] == "buffered":
            return  # no adapters
        if self.opts["adapter_init"] == "calibrated" and self.resuming:
            from revffn.methods.calibration import log_line

            log_line("resuming: the checkpoint holds the calibrated adapters; calibration skipped")
        elif self.opts["adapter_init"] == "calibrated":
            from revffn.methods.calibration import calibrate_for_run

            self.calibration = calibrate_for_run(model, self.cfg, self.opts)

    def prepares_on_meta(self) -> bool:
        """On meta, but for a random adapter init (its draws would differ from the whole model's), a teacher copy
        (copied from the calibrated model) and heal_norms (keeps the norms' loaded values)."""
        opts = self.opts
        return (self.META_PREPARE and opts["adapter_init"] != "random" and not opts["heal_norms"]
                and not (opts["distill_coef"] > 0 and opts["distill_teacher"] == "copy"))

    def after_load_runs_model(self) -> bool:
        """The additive coupling's `after_load` runs the model (calibration, the streams' choice); the buffered one
        only sets its kernels."""
        return self.opts["coupling"] != "buffered"

    def after_load(self, model) -> None:
        """A model converted on the meta device: its adapters' init, then the calibration (collective under FSDP:
        every rank passes over its share of the rows, each unit all-gathered as it runs). Then, on every model,
        stream_dtype auto's choice (`_pick_streams`)."""
        if self.on_meta and self.opts["coupling"] == "additive":
            from revffn.conversion.convert import init_adapters

            for block in model.blocks:
                init_adapters(block, self.opts["adapter_init"])
            self._calibrate(model)
        self._pick_streams(model)
        if self.opts["coupling"] == "buffered":  # the backward recomputes every layer bitwise or raises
            deterministic_kernels(next(model.parameters()).device)

    def state_dict(self) -> dict:
        """The calibration report (a resumed run does not calibrate: its final/ keeps the first run's report) and
        which adapters stage 2 folded (a resume folds the same ones before loading the checkpoint)."""
        return {**({"calibration": self.calibration} if self.calibration else {}),
                **({"folded": self.fold_plan} if self.fold_plan is not None else {}),
                **({"streams": self.streams} if self.streams else {})}

    def load_state_dict(self, state: dict) -> None:
        self.calibration = state.get("calibration", self.calibration)
        self.fold_plan = state.get("folded", self.fold_plan)
        self.streams = state.get("streams", self.streams)

    def restructure(self, model, step: int) -> list[nn.Parameter]:
        """fold_adapters: at the first stage-2 step, fold each branch's P_down into its layer (`conversion.fold`),
        or on a resume the ones the checkpoint's run folded. Not with optimizer_offload (torchao's offload wrapper
        holds a parameter list it cannot drop from) nor at half width (P_down narrows the branch).
        stream_dtype auto on a resume: the streams the first run picked (`load_state_dict`)."""
        if self.streams and self.opts["stream_dtype"] == AUTO:
            model.stream_dtype = STREAM_DTYPES[self.streams["stream_dtype"]]
        if (self.folded_here or not self.opts["fold_adapters"] or self.cfg.optimizer_offload != "none"
                or self.opts["stream_width"] != "full" or self.opts["coupling"] == "buffered"
                or (self.fold_plan is None and self.stage(step) != "joint")):
            return []
        from revffn.conversion.fold import fold_adapters

        removed, self.fold_plan = fold_adapters(model, only=self.fold_plan)
        self.folded_here = True
        return removed

    def _prepare_stages(self, model: nn.Module) -> nn.Module:
        """The heal's text source (stage 1) and the frozen teacher copy (stage 2, distill_coef > 0)."""
        cfg, opts = self.cfg, self.opts
        self.reversible = model.reversible
        if opts["heal_norms"]:
            self.norm_originals = [p.detach().clone() for p in norm_parameters(model)]
        if opts["adapter_warmup_steps"] and opts["heal_data"] != TASK:
            from revffn.data.calibration import StepRows
            from revffn.data.tokenizer import model_tokenizer
            from revffn.methods.calibration import check_source

            check_source(opts["heal_data"], "revffn.heal_data", (cfg.data, cfg.eval_data))
            self.heal_rows = StepRows(opts["heal_data"], model_tokenizer(cfg.model, cfg.tokenizer),
                                      cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
                                      * data_shard()[1], "revffn.heal_data", cfg.seed)
        elif opts["adapter_warmup_steps"]:
            from revffn.methods.calibration import log_line

            log_line("warning: revffn.heal_data=task: stage 1 trains the adapters on the task's batches, which "
                     "loses more of the base than healing on general text (docs/conversion.md). Fix: "
                     "revffn.heal_data=self.")
        if opts["distill_coef"] > 0 and opts["distill_teacher"] == "copy":
            self.teacher = copy.deepcopy(model).eval().requires_grad_(False)
        return model

    def frozen_copies(self) -> list[nn.Module]:
        return [self.teacher] if self.teacher is not None else []

    @staticmethod
    def _cache_at(cfg) -> tuple[Path, str] | None:
        """distill_teacher cached: (the cache's directory, the model it is for); None on the copy route."""
        opts = cfg.section("revffn")
        if not (opts["distill_coef"] > 0 and opts["distill_teacher"] == "cached"):
            return None
        path = Path(opts["teacher_cache"]) if opts["teacher_cache"] else Path(cfg.output_dir) / "teacher_cache"
        return path, f"{cfg.model} {cfg.model_config or ''}".strip()

    @classmethod
    def check_data(cls, cfg, items: list) -> None:
        cache = cls._cache_at(cfg)
        cleared = cfg.overwrite and not cfg.resume and not cfg.section("revffn")["teacher_cache"]  # the run's own
        if cache is not None and not cleared:
            from revffn.methods.teacher_cache import check

            check(cache[0], items, cache[1])

    def before_training(self, model, items: list | None) -> None:
        """distill_teacher cached: open the cache of the training set's teacher hidden states, or build it."""
        if (cache := self._cache_at(self.cfg)) is not None:
            from revffn.methods.teacher_cache import TeacherCache

            self.teacher_cache = TeacherCache.open(cache[0], model, items, cache[1])

    def fsdp_units(self, model) -> list[nn.Module]:
        """What F and G call, one by one: the adapters and the decoder layer's own modules (attention,
        MoE, norms). Not the decoder layer itself: the reversible blocks never call it whole (only the
        heal's teacher does, and its children's hooks gather them there too)."""
        return [m for block in model.blocks for m in (*block.adapters(), *block.base_layer.children())]

    def optimizer_parameters(self, model) -> list[nn.Parameter]:
        return non_router_parameters(model, self.opts["freeze_router"])

    def steady_state_step(self) -> int:
        return self.opts["adapter_warmup_steps"]

    def stage(self, step: int) -> str:
        if step >= self.opts["adapter_warmup_steps"]:
            return "joint"
        return "warmup" if self.opts["heal_data"] == TASK else "heal"

    def set_trainable(self, model, step: int, optimizer=None) -> str:
        stage = self.stage(step)
        if stage == "joint":
            params = self.optimizer_parameters(model)
            if not self.opts["train_adapters"]:  # they keep their stage-1 optimizer states, unused from here
                adapters = {id(p) for p in model.adapter_parameters()}
                params = [p for p in params if id(p) not in adapters]
        else:
            params = [*model.adapter_parameters(), *(norm_parameters(model) if self.opts["heal_norms"] else ())]
        set_requires_grad(model, {id(p) for p in params})
        model.reversible = self.reversible and not (stage == "heal" and self.opts["heal_hidden_coef"] > 0)
        return stage

    def step_batches(self, model, step: int, micro_batches: list[dict]) -> list[dict]:
        """The heal stage trains on heal text (rows of 128 tokens, as many rows per micro-batch as the
        task's), every position predicted; otherwise the task's batches. Data-parallel: the step's rows
        are the global batch's, each rank heals on its share of every micro-batch (`shard_rows`)."""
        if self.stage(step) != "heal":
            return micro_batches
        bsz = self.cfg.per_device_train_batch_size
        rows = self.heal_rows(model, step).cpu()
        return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r}
                for r in (shard_rows(g, bsz) for g in rows.split(bsz * data_shard()[1]))]

    def forward(self, model, batch: dict, step: int) -> tuple:
        """Heal stage: `loss_sum` is KL(teacher ‖ student) summed over the positions the labels select,
        the teacher the model's own frozen backbone in its original wiring. Joint stage with
        distill_coef > 0: the task's loss plus distill_coef x KL to the original model (the frozen copy or the
        cache) summed over the micro-batch's input tokens, a `TokenSum` (train_step averages it over the step's
        whole batch). Otherwise the causal-LM loss."""
        stage = self.stage(step)
        heal = stage == "heal"
        if not heal and not (self.opts["distill_coef"] > 0 and stage == "joint"):
            return model(**batch, return_logits=False), None
        ids, mask = batch["input_ids"], batch.get("attention_mask")
        if heal:
            return self._heal_forward(model, batch)
        target, teacher_head = self._teacher(model, ids, mask)
        with student_hidden(model) as box:
            out = model(**batch, return_logits=False)
        head = get_path(model.hf, model.spec.head)
        kl_sum, _ = distill_kl(box[0], target, head, mask, model.chunk_tokens, teacher_head=teacher_head)
        return out, TokenSum(self.opts["distill_coef"] * kl_sum)

    def _heal_forward(self, model, batch: dict) -> tuple:
        """Stage 1: KL(teacher ‖ student) summed over the positions the labels select, the teacher the
        model's own frozen backbone in its original wiring (its original norms under heal_norms); plus
        heal_hidden_coef x the per-layer hidden-state loss (`conversion.heal`), as the step's extra term."""
        ids, mask, coef = batch["input_ids"], batch.get("attention_mask"), self.opts["heal_hidden_coef"]
        norms = norm_parameters(model) if self.norm_originals else []
        with original_norms(norms, self.norm_originals or []):
            target, states = teacher_states(model, ids, mask) if coef else (teacher_hidden(model, ids, mask), None)
        with student_hidden(model) as box, block_outputs(model) if coef else contextlib.nullcontext() as outs:
            out = model(input_ids=ids, attention_mask=mask, return_logits=False)
        kl_mask = torch.zeros_like(ids, dtype=torch.bool)  # the CE positions: t predicts labels[t + 1]
        kl_mask[:, :-1] = batch["labels"][:, 1:] != -100
        out.loss_sum, _ = distill_kl(box[0], target, get_path(model.hf, model.spec.head), kl_mask, model.chunk_tokens)
        return out, (coef * hidden_mse(outs, states) if coef else None)

    def _teacher(self, model, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, nn.Module]:
        """Stage 2's teacher: its final hidden states on the batch and its head, from the cache or the frozen
        copy (either moved to the model's device on first use: both are built on the host)."""
        device = next(model.parameters()).device
        held = self.teacher_cache.head if self.teacher_cache is not None else self.teacher
        if held is None:
            raise RuntimeError("revffn.distill_teacher=cached: the cache is opened by the loop's "
                               "`Method.before_training`; call it before training")
        if next(held.parameters()).device != device:
            held.to(device)
        if self.teacher_cache is not None:
            return self.teacher_cache.hidden(ids, mask).to(device), held
        from torch.distributed.fsdp import FSDPModule

        if isinstance(held, FSDPModule):  # sharded like the student: its root (embeddings, final norm, head) is
            held.unshard()  # called directly here, and stays gathered (no backward reshards it)
        return teacher_hidden(held, ids, mask), get_path(held.hf, held.spec.head)

    def export(self, model, out_dir: Path) -> None:
        """The converted model as transformers loads it with remote code (`models.hf_remote`), and revffn.json. A
        folded P_down is written as the identity (`conversion.fold.unfold`): the layout every converted model has."""
        from revffn.conversion.fold import unfold

        if model.coupling == "additive":  # (buffered: no adapters)
            unfold(model)
        save_converted(model, out_dir)
        start = {"converted_from": self.converted_from} if self.converted_from else \
            {"adapter_init": self.opts["adapter_init"]} if model.coupling == "additive" else {}
        write_manifest(out_dir, format="revffn", method=self.name, stream_dtype=dtype_name(model.stream_dtype),
                       **start, **({"calibration": self.calibration} if self.calibration else {}),
                       **({"streams": self.streams} if self.streams else {}))

    # -- memory estimate ---------------------------------------------------------------------------
    @classmethod
    def memory_terms(cls, ctx: MemoryContext, freeze_router: bool, stage: int, stream_dtype: str,
                     train_adapters: bool = False, adapter_skip: bool = True, distill_coef: float = 0.0,
                     distill_teacher: str = "copy",
                     recompute_chunk_tokens: int = RECOMPUTE_CHUNK_TOKENS, stream_width: str = "full",
                     fold_adapters: bool = True, coupling: str = "additive",
                     buffer_bits: int = DEFAULT_BUFFER_BITS) -> MemoryTerms:
        """Forward: two streams (d/2 wide each, or d with `stream_width` full) and the routing records
        (`compact_index_dtype` per token and choice), plus the mask and what outside the layers saves.
        Backward: one layer's full-width working set, plus the adapters' inputs (and the load-balancing
        surrogate on a trainable router).

        The working set is attention's part (F: `ctx.layers` less `ctx.ffn`, P_up_attn's and
        P_down_attn's inputs) plus the MoE branch's (G: `ctx.ffn`, P_up_moe's and P_down_moe's
        inputs, the surrogate), the latter scaled by min(recompute_chunk_tokens, N) / N: recomputed by
        chunks, G holds one chunk's tensors at a time; F's part likewise by its chunk of whole sequences
        (max(1, recompute_chunk_tokens // T) of the B). F and G are summed, as without chunking: the
        layer's saved bytes, which the estimate is calibrated on (`tests/memory`).

        The buffered coupling (`_buffered_terms`) instead: no adapters and no stage 1 (`stage=1` refused: it was
        ignored, and the estimate read as a heal step's)."""
        if coupling == "buffered":
            if stage == 1:
                raise UserError("--option stage=1: the buffered coupling (the default) has no stage 1: no adapters, "
                                "nothing to heal. Fix: drop stage=1, or add --option coupling=additive.")
            return cls._buffered_terms(ctx, freeze_router, buffer_bits, recompute_chunk_tokens, distill_coef)
        m, s, N, counts = ctx.m, ctx.s, ctx.N, ctx.counts
        # auto picks float32 or float64 from the weights, which an estimate does not read: counted as float32 (what
        # it picks at random init, the bench's models), the difference stated
        stream = dtype_bytes("float32" if stream_dtype == AUTO else stream_dtype, "stream_dtype")
        idx = compact_index_dtype(max(m.experts, 2)).itemsize
        records = sum(m.moe) * N * m.top_k * idx
        w = m.d // 2 if stream_width == "half" else m.d  # a stream's width
        # half: 4 d/2 x d projections (2 d^2) and 2 d/2 x d/2 skips (d^2/2); full: 2 d x d P_down (2 d^2), 2 d x d skips
        skips = counts["adapters_revffn_skip"] * (1 if stream_width == "half" else 4)
        # stage 2 at full width with fold_adapters: P_down is folded into the layers (assumed of every layer)
        folded = stage == 2 and fold_adapters and stream_width == "full"
        adapters = (0 if folded else counts["adapters_revffn"]) + (skips if adapter_skip else 0)
        trainable = adapters if stage == 1 else counts["total"] + (adapters if train_adapters else 0) - (
            counts["router"] if freeze_router else 0)
        aux = 0 if freeze_router else N * m.experts * 4  # load-balancing surrogate on the trainable router
        # per branch: P_up's input (a d/2 half; full width has no P_up) and P_down's (d-wide)
        extra = (N * (m.d // 2) * s if stream_width == "half" else 0) + (0 if folded else N * m.d * s)
        chunk = min(recompute_chunk_tokens, N) / N if recompute_chunk_tokens else 1.0
        f_chunk = min(max(1, recompute_chunk_tokens // ctx.T), ctx.B) / ctx.B if recompute_chunk_tokens else 1.0
        working = max(int((ctx.layers[i] - ctx.ffn[i] + extra) * f_chunk)
                      + int((ctx.ffn[i] + extra + aux * m.moe[i]) * chunk) for i in range(m.layers))
        state = "stage 1: adapters only trainable" if stage == 1 else (
            "router frozen" if freeze_router else "router trainable") + ("" if train_adapters else ", adapters frozen")
        fit_in = m.d + (w if adapter_skip else 0)  # P_down's input (with its skip's: one joint fit)
        accumulators = 8 * (fit_in * fit_in + fit_in * w + 1)  # fp64 XᵀX, XᵀY, ‖Y‖², the largest fit
        width = "d/2" if stream_width == "half" else "d"
        auto = (f" (stream_dtype auto, counted as float32: +{2 * N * w * 4 / 2**20:.0f} MiB where it picks float64, "
                "--option stream_dtype=float64)") if stream_dtype == AUTO else ""
        notes = (f"revffn: two {stream}-byte {width} streams{auto} + routing records ({idx} byte/token/choice, "
                 f"{records} bytes) kept; one layer's working set (full width, + adapters) in backward"
                 + (f", its MoE branch's by chunks of {recompute_chunk_tokens} tokens"
                    if 0 < recompute_chunk_tokens < N else "")
                 + (f", its attention's by chunks of {_sequences(recompute_chunk_tokens // ctx.T)}"
                    if f_chunk < 1 else ""),
                 f"revffn: {adapters} adapter params{' (P_down folded into the layers)' if folded else ''}; {state}",
                 f"revffn calibration (adapter_init calibrated, before training): {accumulators / 2**20:.1f} MiB of "
                 f"fp64 accumulators on the device, {2 * m.d * 4} bytes per calibration token of layer inputs on "
                 "the host; a heal step is stage 1 (--option stage=1) plus one no-grad teacher forward")
        teacher = 0
        if distill_coef > 0 and stage == 2:  # both routes' teacher memory, the chosen one counted under weights
            copy_params, head = counts["total"] + adapters, m.vocab * m.d
            teacher = head if distill_teacher == "cached" else copy_params
            notes += (f"revffn distill_coef={distill_coef:g}, distill_teacher={distill_teacher} (counted under "
                      f"weights), with its (B, T, d) final hidden states: a frozen teacher copy of the weights is "
                      f"{copy_params} params ({copy_params * s / 2**30:.2f} GiB; under fsdp sharded like the "
                      f"model) plus a forward per micro-batch; a cached teacher is a copy of the head, {head} params "
                      f"({head * s / 2**20:.0f} MiB), and {m.d * s} bytes per training token on disk, computed "
                      "once before training",)
        # full width: the final norm reads Y_2 itself (`merge`), in `outside` as its input unless a cast copies it
        shared = N * m.d * s if stream_width == "full" and stream == s else 0
        act_fwd = ctx.outside + ctx.mask_bytes + 2 * N * w * stream - shared + records + (N * m.d * s if teacher else 0)
        return MemoryTerms(trainable=trainable, activations_forward=act_fwd, extra_params=adapters + teacher,
                           recompute_working_set=working, routing_records=records, notes=notes,
                           loads_whole=bool(teacher) and distill_teacher == "copy")

    @classmethod
    def _buffered_terms(cls, ctx: MemoryContext, freeze_router: bool, buffer_bits: int,
                        recompute_chunk_tokens: int, distill_coef: float = 0.0) -> MemoryTerms:
        """The buffered coupling: forward keeps the top two int64 streams (8 bytes a coordinate each) and every
        layer's dropped bits (buffer_bits / 8 bytes a coordinate a layer), no routing records (the rebuild is
        bitwise, so the recompute makes the forward's choices itself); backward one layer's working set, by chunks of
        whole sequences (`reversible.buffered._spans`: max(1, recompute_chunk_tokens // T) of the B) with its float32
        tensors (a float64 model's float64), and two gradient streams of that dtype, whole.
        Every parameter trains but the frozen routers. Static and forward bytes: within 0.2 % of the bench
        (tests/memory). distill_coef > 0: a frozen copy of the weights (the copy route; the cached one is not built
        for this coupling) and its final states."""
        m, N, counts = ctx.m, ctx.N, ctx.counts
        buffer = m.layers * -(-N * m.d * buffer_bits // 8)
        trainable = counts["total"] - (counts["router"] if freeze_router else 0)
        aux = 0 if freeze_router else N * m.experts * 4
        chunk = min(max(1, recompute_chunk_tokens // ctx.T), ctx.B) / ctx.B if recompute_chunk_tokens else 1.0
        # beside the saved streams (rebuilt in place): two gradient streams and a byte a coordinate of unpacked bits,
        # whole; a span's input as the layer reads it, branch outputs, update and input gradient, by chunks
        layer = max(ctx.layers[i] + aux * m.moe[i] for i in range(m.layers))
        c = 8 if ctx.s == 8 else 4  # bytes a coordinate of the compute dtype (`reversible.buffered.compute_dtype`)
        working = int((layer + 4 * N * m.d * c) * chunk) + 2 * N * m.d * c + N * m.d
        chunks = f", by chunks of {_sequences(recompute_chunk_tokens // ctx.T)}" if chunk < 1 else ""
        notes = (f"revffn coupling buffered: two int64 d streams + {buffer_bits} bits a coordinate a layer "
                 f"({buffer / 2**20:.1f} MiB: grows with depth) kept; one layer's working set in backward{chunks}",
                 f"revffn: no adapters; {'router frozen' if freeze_router else 'router trainable'}; no calibration")
        teacher = counts["total"] if distill_coef > 0 else 0
        if teacher:
            notes += (f"revffn distill_coef={distill_coef:g}: a frozen teacher copy of the weights, {teacher} params "
                      f"({teacher * ctx.s / 2**30:.2f} GiB, counted under weights), and its (B, T, d) final states",)
        act_fwd = ctx.outside + ctx.mask_bytes + 2 * N * m.d * 8 + buffer + (N * m.d * ctx.s if teacher else 0)
        return MemoryTerms(trainable=trainable, activations_forward=act_fwd, extra_params=teacher,
                           recompute_working_set=working, notes=notes,
                           loads_whole=bool(teacher))

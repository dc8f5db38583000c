"""`revffn`: full fine-tuning through reversible blocks, in two stages.

Stage 1 (`adapter_warmup_steps`): only the projection adapters P_up/P_down train; the pretrained
backbone is frozen so the new parts first learn to speak its language. Stage 2: everything trains
except the routers (`freeze_router: true`, for routing stability). One AdamW holds every parameter
that will ever train; frozen ones have no gradient, so AdamW skips them and keeps the adapters'
state across the boundary.

Trades: activation memory flat in depth (two d/2 streams + one layer) for one extra forward per
layer in backward; grads and optimizer states stay those of full fine-tuning.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_model
from torch import nn

from revffn.errors import UserError
from revffn.memory.estimate import MemoryContext, MemoryTerms, dtype_bytes
from revffn.methods.base import Method, non_router_parameters, set_requires_grad, write_manifest
from revffn.models.convert import ADAPTER_INITS, RevFFNForCausalLM, convert
from revffn.reversible.replay import compact_index_dtype
from revffn.schema import Key


class RevFFNMethod(Method):
    name = "revffn"
    SCHEMA = {
        "adapter_warmup_steps": Key(int, 10, "stage 1: steps that train only the projection adapters", min=0),
        "freeze_router": Key(bool, True, "stage 2: keep the MoE routers frozen"),
        "stream_dtype": Key(str, "float32", "dtype of the residual streams (float32 keeps backward exact)",
                            choices=("float32", "bfloat16")),
        "adapter_init": Key(str, "calibrated", "projection adapter init", choices=ADAPTER_INITS),
        "calibration_data": Key(str, "self", "calibrated init: `self` (text sampled from the base), a data file or "
                                "builtin:NAME; general text, never the task data alone"),
        "calibration_tokens": Key(int, 32768, "calibrated init: calibration tokens (rows of 128)", min=1),
    }
    ESTIMATE_OPTIONS = {
        "freeze_router": Key(bool, True, "stage 2: the MoE routers frozen"),
        "stage": Key(int, 2, "1: only the adapters train; 2: everything but (if frozen) the routers", min=1, max=2),
        "stream_dtype": Key(str, "float32", "dtype of the two d/2 residual streams"),
    }
    ACCEPTS_CONVERTED = True  # `revffn convert` output: trained as it is, not converted again
    converted_from: str | None = None  # set by `prepare` when the model came converted
    calibration: dict | None = None  # set by `prepare`: the calibration report (adapter_init: calibrated)
    STUDY_LR_GRID = (3e-4, 1e-3)  # a full-parameter method: full's grid
    STUDY_OPTIONS = {"adapter_warmup_steps": 20, "adapter_init": "coordinate", "freeze_router": True}
    STUDY_GAP_VARIANTS = {f"{init}-w{warm}": {"adapter_init": init, "adapter_warmup_steps": warm}
                          for init in ("coordinate", "zero") for warm in (20, 50)}

    @classmethod
    def validate(cls, cfg) -> None:
        opts = cfg.section(cls.name)
        if opts["adapter_warmup_steps"] >= cfg.max_steps:
            raise UserError(f"revffn.adapter_warmup_steps={opts['adapter_warmup_steps']} leaves no stage-2 step "
                            f"(max_steps={cfg.max_steps}). Fix: make it smaller than max_steps.")
        if opts["adapter_init"] == "calibrated" and opts["calibration_data"] != "self":
            from revffn.data.calibration import file_rows
            from revffn.methods.conversion import model_tokenizer

            file_rows(opts["calibration_data"], model_tokenizer(cfg.model, cfg.tokenizer), opts["calibration_tokens"],
                      "revffn.calibration_data", budget_key="revffn.calibration_tokens")

    @classmethod
    def study_options(cls, steps: int, **variant) -> dict:
        """STUDY_OPTIONS and `variant`, the warm-up cut to leave a stage-2 step in a short run."""
        opts = {**cls.STUDY_OPTIONS, **variant}
        opts["adapter_warmup_steps"] = min(opts["adapter_warmup_steps"], steps - 1)
        return opts

    def prepare(self, hf_model: nn.Module) -> nn.Module:
        """Convert (and calibrate) `hf_model`; a model `revffn convert` wrote is already converted: kept as is."""
        dtype = torch.float32 if self.opts["stream_dtype"] == "float32" else torch.bfloat16
        if isinstance(hf_model, RevFFNForCausalLM):
            self.converted_from = self.cfg.model
            hf_model.stream_dtype = dtype
            if self.cfg.router_aux_loss_coef is not None:
                hf_model.aux_loss_coef = self.cfg.router_aux_loss_coef
            return hf_model
        model = convert(hf_model, adapter_init=self.opts["adapter_init"], stream_dtype=dtype,
                        aux_loss_coef=self.cfg.router_aux_loss_coef)
        if self.opts["adapter_init"] == "calibrated":
            from revffn.methods.conversion import calibrate_for_run

            self.calibration = calibrate_for_run(model, self.cfg, self.opts)
        return model

    def optimizer_parameters(self, model) -> list[nn.Parameter]:
        return non_router_parameters(model, self.opts["freeze_router"])

    def steady_state_step(self) -> int:
        return self.opts["adapter_warmup_steps"]

    def stage(self, step: int) -> str:
        return "warmup" if step < self.opts["adapter_warmup_steps"] else "joint"

    def set_trainable(self, model, step: int, optimizer=None) -> str:
        stage = self.stage(step)
        params = model.adapter_parameters() if stage == "warmup" else self.optimizer_parameters(model)
        set_requires_grad(model, {id(p) for p in params})
        return stage

    def export(self, model, out_dir: Path) -> None:
        """The converted model's weights (safetensors), the base HF config, and revffn.json."""
        model.config.save_pretrained(out_dir)
        save_model(model, str(out_dir / "model.safetensors"))
        start = {"converted_from": self.converted_from} if self.converted_from else \
            {"adapter_init": self.opts["adapter_init"]}
        write_manifest(out_dir, format="revffn", method=self.name, stream_dtype=self.opts["stream_dtype"], **start,
                       **({"calibration": self.calibration} if self.calibration else {}))

    # -- memory estimate ---------------------------------------------------------------------------
    @classmethod
    def estimate_options(cls, section: dict) -> dict:
        return {"freeze_router": section["freeze_router"], "stream_dtype": section["stream_dtype"]}

    @classmethod
    def memory_terms(cls, ctx: MemoryContext, freeze_router: bool, stage: int, stream_dtype: str) -> MemoryTerms:
        """Forward: two d/2 streams and the routing records (`compact_index_dtype` per token and
        choice), plus the mask and what outside the layers saves. Backward: one layer's full-width
        working set, plus the adapters' inputs (and the load-balancing surrogate on a trainable router)."""
        m, s, N, counts = ctx.m, ctx.s, ctx.N, ctx.counts
        stream = dtype_bytes(stream_dtype, "stream_dtype")
        idx = compact_index_dtype(max(m.experts, 2)).itemsize
        records = sum(m.moe) * N * m.top_k * idx
        adapters = counts["adapters_revffn"]
        trainable = adapters if stage == 1 else counts["total"] + adapters - (counts["router"] if freeze_router else 0)
        aux = 0 if freeze_router else N * m.experts * 4  # load-balancing surrogate on the trainable router
        extra = N * m.d * s + 2 * N * m.d * s  # P_up inputs (two d/2 halves), P_down inputs (two d-wide)
        working = max(ctx.layers[i] + extra + aux * m.moe[i] for i in range(m.layers))
        state = "stage 1: adapters only trainable" if stage == 1 else (
            "router frozen" if freeze_router else "router trainable")
        accumulators = 8 * (m.d * m.d + m.d * (m.d // 2) + 1)  # fp64 XᵀX, XᵀY, ‖Y‖² of P_down, the largest fit
        notes = (f"revffn: two {stream}-byte d/2 streams + routing records ({idx} byte/token/choice, "
                 f"{records} bytes) kept; one layer's working set (full width, + adapters) in backward",
                 f"revffn: {adapters} adapter params; {state}",
                 f"revffn calibration (adapter_init calibrated, before training): {accumulators / 2**20:.1f} MiB of "
                 f"fp64 accumulators on the device, {2 * m.d * 4} bytes per calibration token of layer inputs on "
                 "the host; a heal step is stage 1 (--option stage=1) plus one no-grad teacher forward")
        act_fwd = ctx.outside + ctx.mask_bytes + 2 * N * (m.d // 2) * stream + records
        return MemoryTerms(trainable=trainable, activations_forward=act_fwd, extra_params=adapters,
                           recompute_working_set=working, routing_records=records, notes=notes)

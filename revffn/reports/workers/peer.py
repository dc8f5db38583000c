"""One peer measurement: the bench's model and batch trained by a tool users would run instead of revffn.

    python -m revffn.reports.workers.peer '{"peer": "hf-trainer", "checkpointing": true, "model": ...}'

prints exactly one JSON line (the result row) on stdout, as `revffn.reports.workers.bench` does.

Peers (`PEERS`): `hf-trainer` is `transformers.Trainer`; `trl-sft` is TRL's `SFTTrainer` (optional: only
where `trl` is installed). Either runs with or without gradient checkpointing (transformers' own,
non-reentrant), on what the revffn worker trains: the same HF model (`build_hf`, the same seed), the same
(B, T) random batch every step (labels = ids), the same weights dtype (and bf16 autocast on CUDA), and
AdamW at the run's LR, weight decay and clipping. The MoE load-balancing loss is HF's own at revffn's
coefficient (`output_router_logits`), as a user fine-tuning an MoE would set it. The LR is constant: the
bench times steps, it does not train.

Measured as the revffn worker measures: the peak RSS over the steps (reset once the Trainer is built) minus the
RSS right after the imports on CPU (the same modules imported), CUDA `max_memory_allocated` / `_reserved` after
a reset once the model is built; tokens/s the median over the steps after the first (a `TrainerCallback`
times `on_step_begin` to `on_step_end`: forward, backward, clipping, AdamW, zero_grad); the bytes saved for
backward during the first step's forward (`compute_loss`, parameters excluded), gradient bytes before the
optimizer step, and AdamW's states. The row keeps the Trainer's own `log_history` and `global_step`: proof that it ran.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import peft  # noqa: F401  (the peers import it themselves (Trainer where installed, TRL): before the RSS baseline)
import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments

from revffn.data.tokenizer import model_tokenizer
from revffn.memory.measure import current_rss_bytes, reset_rss_peak
from revffn.models.loading import build_hf
from revffn.reports.bench import train_config
from revffn.reports.workers import bench as bench_worker
from revffn.reports.workers.bench import LiveSavedTensorLog, _state_bytes, _tensor_bytes, peak_memory
from revffn.training.setup import pick_device

PEERS = {"hf-trainer": "transformers.Trainer", "trl-sft": "trl.SFTTrainer"}
# TrainingArguments' checkpointing switch: `activation_checkpointing` since transformers 5.2x, `gradient_...` in 5.17
CKPT_ARGS = next(k for k in ("activation_checkpointing", "gradient_checkpointing")
                 if k in TrainingArguments.__dataclass_fields__)
LIKE = {False: "full", True: "ckpt"}  # the revffn method each peer run is the same training as (its estimate)


class _Rows(torch.utils.data.Dataset):
    """`n` rows, row i the batch's row i mod B: every step of B rows is the revffn worker's one batch."""

    def __init__(self, ids: torch.Tensor, n: int):
        self.ids, self.n = ids, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        row = self.ids[i % self.ids.shape[0]]
        return {"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row}


class _Timer(TrainerCallback):
    """Each optimizer step's wall time, and the gradient bytes just before AdamW steps."""

    def __init__(self, cuda: bool):
        self.cuda, self.t0, self.times, self.grad_bytes = cuda, 0.0, [], 0

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kw):
        self._sync()
        self.t0 = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        grads = sum(_tensor_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        self.grad_bytes = max(self.grad_bytes, grads)

    def on_step_end(self, args, state, control, **kw):
        self._sync()
        self.times.append(time.perf_counter() - self.t0)


def _measured(trainer_cls):
    """`trainer_cls` whose first `compute_loss` logs what its forward saves for backward (`saved_bytes`)."""

    class Measured(trainer_cls):
        saved_bytes = None

        def compute_loss(self, model, inputs, *args, **kwargs):
            if self.saved_bytes is not None:
                return super().compute_loss(model, inputs, *args, **kwargs)
            log = LiveSavedTensorLog(model.parameters())
            with log.hooks():
                loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.saved_bytes = log.bytes()  # while the graph holds them
            return loss

    return Measured


def _trainer(peer: str, model, args: TrainingArguments, rows: _Rows, timer: _Timer, tokenizer=None):
    if peer == "hf-trainer":
        return _measured(Trainer)(model=model, args=args, train_dataset=rows, callbacks=[timer])
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer  # optional: `revffn bench --peers trl-sft` checks it is installed

    sft = SFTConfig(**{k: v for k, v in args.to_dict().items() if k in SFTConfig.__dataclass_fields__
                       and not k.startswith("_")}, dataset_kwargs={"skip_prepare_dataset": True}, packing=False)
    table = Dataset.from_list([{k: v.tolist() for k, v in rows[i].items()} for i in range(len(rows))])
    return _measured(SFTTrainer)(model=model, args=sft, train_dataset=table, callbacks=[timer],
                                 processing_class=tokenizer)  # (else it loads one from the model's name: none)


def measure(args: dict, baseline_rss: int | None = None) -> dict:
    """Build the model, train `steps` + 1 steps with the peer, return the row (without status handling)."""
    t_build = time.perf_counter()
    peer, checkpointing = args["peer"], bool(args["checkpointing"])
    cfg = train_config({**args, "method": LIKE[checkpointing]})
    device, weights_dtype, autocast_dtype = pick_device(cfg)
    hf = build_hf(cfg.model, weights_dtype, cfg.seed, device, **cfg.model_config)
    if getattr(hf.config, "num_local_experts", None) or getattr(hf.config, "num_experts", None):
        coef = cfg.router_aux_loss_coef  # None: the model's own, as `CausalLM` reads it
        coef = getattr(hf.config, "router_aux_loss_coef", 0.0) or 0.0 if coef is None else coef
        hf.config.output_router_logits, hf.config.router_aux_loss_coef = coef > 0, coef
    B, T, steps = int(args["batch"]), int(args["seq"]), int(args.get("steps", 1))
    g = torch.Generator().manual_seed(cfg.seed)  # the revffn worker's batch (rank 0)
    ids = torch.randint(3, hf.config.vocab_size, (B, T), generator=g)
    timer = _Timer(device.type == "cuda")
    with tempfile.TemporaryDirectory(prefix="revffn-peer-") as out:
        targs = TrainingArguments(
            output_dir=out, per_device_train_batch_size=B, max_steps=steps + 1, learning_rate=cfg.learning_rate,
            weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, optim="adamw_torch",
            lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
            **{CKPT_ARGS: checkpointing, f"{CKPT_ARGS}_kwargs": {"use_reentrant": False} if checkpointing else None},
            use_cpu=device.type == "cpu", bf16=autocast_dtype is torch.bfloat16, dataloader_num_workers=0,
            seed=cfg.seed, remove_unused_columns=False)
        tokenizer = model_tokenizer(cfg.model, cfg.tokenizer) if peer == "trl-sft" else None
        trainer = _trainer(peer, hf, targs, _Rows(ids, B * (steps + 1)), timer, tokenizer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        build_s = time.perf_counter() - t_build
        peak_since = "built" if reset_rss_peak() else "start"  # the steps' peak, as the revffn worker's
        trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    unique = {id(p): p for p in hf.parameters()}.values()
    times = timer.times[1:]
    row = {"peer": peer, "trainer": PEERS[peer], "checkpointing": checkpointing, "like": LIKE[checkpointing],
           "global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
           "activation_bytes": trainer.saved_bytes or 0, "routing_record_bytes": 0, "grad_bytes": timer.grad_bytes,
           "optimizer_state_bytes": _state_bytes(optimizer), "param_bytes": sum(_tensor_bytes(p) for p in unique),
           "trainable_params": sum(p.numel() for p in unique if p.requires_grad),
           "total_params": sum(p.numel() for p in unique),
           "tokens_per_s": statistics.median(B * T / t for t in times) if times else None,
           "step_times_s": times, "build_s": build_s, "device": str(device), "threads": torch.get_num_threads(),
           "loss": losses[-1] if losses else None, "versions": {"transformers": transformers.__version__},
           "geometry": {k: getattr(hf.config, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size")}}
    row["optimizer_state_bytes_total"] = row["optimizer_state_bytes"]
    row["peak_since"] = peak_since
    return {**row, **peak_memory(device, baseline_rss)}


def run(args: dict, baseline_rss: int | None = None) -> dict:
    """The peer's `measure` with the bench's failure kinds (`workers.bench.run`), its row named by its label."""
    return {**bench_worker.run(args, baseline_rss, measure), "method": args["label"]}


def main(argv: list[str] | None = None) -> int:
    baseline = current_rss_bytes()  # after the imports, before anything is built
    argv = sys.argv[1:] if argv is None else argv
    row = run(json.loads(argv[0]), baseline)
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (json.dumps(row) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The one training loop. Every method goes through it; methods differ only via `Method`.

    revffn train                       # the built-in quickstart
    revffn train configs/x.yaml max_steps=100 revffn.adapter_warmup_steps=20

Read top to bottom: prepare (validate, no allocation) -> build -> resume -> step loop (trainable
set, LR, micro-batches, clip, AdamW, log, eval, checkpoint) -> final/ -> report. The report is also
written when the run stops on an error.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from revffn.errors import UserError
from revffn.memory.measure import peak_memory_bytes
from revffn.methods import METHODS
from revffn.models.loading import load_hf
from revffn.training.checkpoint import clean_partial, load_checkpoint, save_checkpoint
from revffn.training.evaluate import eval_loss
from revffn.training.schedule import lr_at
from revffn.training.setup import clear_run, model_overrides, prepare_run, saved_config_text


class TrainingDiverged(RuntimeError):
    """The loss became NaN/Inf. Exit code 1; the last good checkpoint stays intact."""


_fired: set[str] = set()


def fault(point: str, step: int) -> None:
    """Test hook: REVFFN_FAULT='kill@step:7' / 'kill@save:10' / 'raise@step:5' (raise fires once)."""
    spec = os.environ.get("REVFFN_FAULT", "")
    for item in filter(None, spec.split(",")):
        action, where = item.split("@")
        name, at = where.split(":")
        if name == point and int(at) == step and item not in _fired:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            _fired.add(item)
            raise RuntimeError(f"injected fault at {point} {step}")


def _decay_groups(params, weight_decay: float) -> list[dict]:
    """No weight decay on biases and norm weights (1-D), as HF Trainer does."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def train(cfg, restarts: int = 0) -> dict:
    """Run one training job described by a validated config; returns the final summary."""
    from revffn.data.collate import DataOrder, collate
    from revffn.training.report import write_run_report

    plan = prepare_run(cfg)  # raises UserError for bad input; writes nothing
    run_dir, device = plan.run_dir, plan.device
    if plan.resume_from is None:
        if cfg.overwrite:
            clear_run(run_dir, keep_events=restarts > 0)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(saved_config_text(cfg))
        (run_dir / "metrics.jsonl").write_text("")
    else:  # resuming, possibly from a checkpoint path into a fresh output_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "config.yaml").exists():
            (run_dir / "config.yaml").write_text(saved_config_text(cfg))
        (run_dir / "metrics.jsonl").touch()
    clean_partial(run_dir)
    summary: dict = {"status": "running", "restarts": restarts}
    try:
        torch.manual_seed(cfg.seed)
        tok = plan.tokenizer
        hf = load_hf(cfg.model, dtype=plan.weights_dtype, seed=cfg.seed, **model_overrides(cfg, tok))
        method = METHODS[cfg.method](cfg)
        model = method.prepare(hf).to(device)
        model.train()
        params = method.optimizer_parameters(model)
        optimizer = torch.optim.AdamW(_decay_groups(params, cfg.weight_decay), lr=cfg.learning_rate,
                                      betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
        order = DataOrder(len(plan.train_set.items), cfg.seed)
        step = 0
        if plan.resume_from is not None:
            state = load_checkpoint(plan.resume_from, model, optimizer)
            step = state["step"]
            order.load_state_dict(state["data_order"])
            method.load_state_dict(state["method_state"])
            _truncate_metrics(run_dir / "metrics.jsonl", step)
        autocast = (lambda: torch.autocast(device.type, dtype=plan.autocast_dtype)) if plan.autocast_dtype \
            else contextlib.nullcontext
        pad_id = tok.pad_token_id
        accum, bsz = cfg.gradient_accumulation_steps, cfg.per_device_train_batch_size
        sched_len = method.schedule_length(cfg.max_steps)
        nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        summary.update(train_stats=plan.train_set.stats, method=cfg.method, model=cfg.model, device=str(device))
        bar = tqdm(total=cfg.max_steps, initial=step, desc=f"{cfg.method}", dynamic_ncols=True,
                   disable=None, file=sys.stderr)
        t_last, tokens_since = time.perf_counter(), 0
        loss_log = torch.zeros((), device=device)
        ntok_log = 0
        metrics_file = open(run_dir / "metrics.jsonl", "a")
        stage = None
        while step < cfg.max_steps:
            prev_stage, stage = stage, method.set_trainable(model, step, optimizer)
            lr = lr_at(method.schedule_position(step), sched_len, cfg.learning_rate, cfg.warmup_steps,
                       cfg.lr_scheduler_type, cfg.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            micro = [collate([plan.train_set.items[i] for i in order.next_indices(bsz)], pad_id)
                     for _ in range(accum)]
            n_total = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)  # CPU tensors: no device sync
            tokens_since += sum(int(m["attention_mask"].sum()) for m in micro)
            for mb in micro:
                mb = {k: v.to(device, non_blocking=True) for k, v in mb.items()}
                with autocast():
                    out = model(**mb, return_logits=False)
                loss = out.loss_sum / max(n_total, 1)
                if out.aux_loss is not None and out.aux_loss.requires_grad:
                    loss = loss + model.aux_loss_coef * out.aux_loss / accum
                loss.backward()
                loss_log += out.loss_sum.detach().float()
            ntok_log += n_total
            trainable = [p for p in params if p.grad is not None]
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm if cfg.max_grad_norm > 0
                                                       else float("inf"))
            nonfinite |= ~torch.isfinite(loss_log)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            method.after_step(step, model, optimizer)
            step += 1
            fault("step", step)
            bar.update(1)
            if step % cfg.logging_steps == 0 or step == cfg.max_steps or stage != prev_stage:
                dt = time.perf_counter() - t_last
                train_loss = (loss_log / max(ntok_log, 1)).item()  # the one host sync per log
                if bool(nonfinite) or not torch.isfinite(torch.tensor(train_loss)):
                    raise TrainingDiverged(f"loss became {train_loss} at step {step} (stage {stage}, lr {lr:.3g}). "
                                           "The last checkpoint is intact. Fix: lower learning_rate, raise "
                                           "warmup_steps, or set max_grad_norm.")
                rec = {"step": step, "stage": stage, "loss": train_loss, "lr": lr, "grad_norm": float(grad_norm),
                       "tokens_per_s": tokens_since / dt, "peak_mem_bytes": peak_memory_bytes(device)}
                if out.aux_loss is not None:
                    rec["aux_loss"] = float(out.aux_loss.detach())
                rec.update(method.log_metrics(model, optimizer))
                if plan.eval_set is not None and cfg.eval_steps and step % cfg.eval_steps == 0:
                    rec["eval_loss"] = eval_loss(model, plan.eval_set, bsz, pad_id, device, autocast)
                metrics_file.write(json.dumps(rec) + "\n")
                metrics_file.flush()
                bar.set_postfix(loss=f"{train_loss:.3f}", stage=stage, tok_s=f"{rec['tokens_per_s']:.0f}",
                                mem=f"{rec['peak_mem_bytes'] / 2**30:.2f}G")
                loss_log.zero_()
                ntok_log, tokens_since, t_last = 0, 0, time.perf_counter()
            if cfg.save_steps and step % cfg.save_steps == 0 and step < cfg.max_steps:
                if bool(nonfinite):
                    raise TrainingDiverged(f"loss became non-finite before the checkpoint at step {step}.")
                state = {"step": step, "data_order": order.state_dict(), "method_state": method.state_dict(),
                         "model": cfg.model, "method": cfg.method, "stage": stage}
                save_checkpoint(run_dir, step, model, optimizer, state, saved_config_text(cfg),
                                cfg.save_total_limit, fault)
        bar.close()
        metrics_file.close()
        final = run_dir / "final"
        tmp = run_dir / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        method.export(model, tmp)
        tok.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if plan.eval_set is not None:
            summary["eval_loss"] = eval_loss(model, plan.eval_set, bsz, pad_id, device, autocast)
        summary.update(status="ok", steps=step, final_dir=str(final), stage=stage)
        return summary
    except TrainingDiverged as e:
        summary.update(status="diverged", error=str(e))
        raise
    except BaseException as e:
        summary.update(status="error", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        with contextlib.suppress(Exception):
            write_run_report(run_dir, summary)


def _truncate_metrics(path, step: int) -> None:
    """On resume, drop metrics logged after the checkpoint (they will be produced again)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))


def run(cfg) -> dict:
    """`train` with up to `max_restarts` automatic restarts from the last checkpoint after a crash."""
    from revffn.training.checkpoint import latest_checkpoint
    from revffn.training.config import TrainConfig

    restarts = 0
    while True:
        try:
            return train(cfg, restarts)
        except (UserError, TrainingDiverged, KeyboardInterrupt):
            raise
        except Exception as e:
            if restarts >= cfg.max_restarts:
                raise
            restarts += 1
            run_dir = Path(cfg.output_dir)
            ckpt = latest_checkpoint(run_dir)
            event = {"event": "restart", "restart": restarts, "max_restarts": cfg.max_restarts,
                     "error": f"{type(e).__name__}: {e}", "from_step": int(ckpt.name.split("-")[1]) if ckpt else 0}
            with open(run_dir / "events.jsonl", "a") as f:
                f.write(json.dumps(event) + "\n")
            print(f"revffn train: restart {restarts}/{cfg.max_restarts} after {event['error']} "
                  f"(from step {event['from_step']})", file=sys.stderr)
            values = dict(cfg.values, resume=bool(ckpt), overwrite=not ckpt)
            cfg = TrainConfig(values, cfg.sections, cfg.source)

"""The one training loop. Every method goes through it; methods differ only via `Method`.

    revffn train                       # the built-in quickstart
    revffn train configs/x.yaml max_steps=100 revffn.adapter_warmup_steps=20

`train` reads top to bottom: prepare (validate, no allocation) -> `Recipe.setup` (build, resume,
open metrics.jsonl, the progress bar and the `report_to` trackers) -> `Recipe.train` (the step loop:
`train_step`, then a metrics line, an eval and a checkpoint on their cadence) -> `Recipe.export`
(final/) -> report. The metrics file, the bar and the trackers are closed, and the report written, on
every path, errors included.

Under torchrun (`distributed: ddp | fsdp`, `training.parallel`) every rank runs this loop on its
share of each global batch (`data.collate.shard_rows`); rank 0 alone writes the run's files
(config.yaml, metrics.jsonl, final/, the report), feeds the trackers and shows the bar. Under DDP
each rank holds the whole model and optimizer, so rank 0's ordinary checkpoint is the run's; under
FSDP every rank writes its shards of a DCP checkpoint, evaluates with the others, and takes part in
gathering the model that rank 0 exports. Peak memory is the max over ranks. A job torchrun restarts
(`--max-restarts`) resumes from the last checkpoint (`setup.resolve_launch`).

While the steps run, `watch.RunWatch` rewrites heartbeat.json, ends a stalled process with exit code 3
(`stall_timeout_s`) and warns of steadily growing memory. With `max_restarts` > 0 each attempt runs in
a child process (`watch.run_in_child`), so a stall, a kill or a crash ends only the attempt, and the
next one resumes from the last checkpoint.

Every resume, restarts included, starts from the newest checkpoint that verifies against its
manifest (`setup.resolve_resume`); the newer ones that fail are moved aside to
`checkpoints/rejected-step-N`, and each restart and rollback is a line in events.jsonl. Everything
the run creates is private to the user (`setup.private_files`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from revffn.data.collate import DataOrder, collate, data_shard, shard_rows
from revffn.errors import DiskFull, UserError, one_line
from revffn.memory.measure import peak_memory_bytes
from revffn.models.cache import staged_dir, sweep_staged
from revffn.models.generation import save_generation_config
from revffn.progress import progress
from revffn.training.checkpoint import (
    checkpoint_dirs,
    clean_partial,
    disk_guard,
    load_checkpoint,
    read_trainer_state,
    save_checkpoint,
    state_bytes,
)
from revffn.training.config import math_config
from revffn.training.evaluate import eval_loss
from revffn.training.parallel import (
    CollectiveTimeout,
    barrier,
    gather_full,
    init_distributed,
    is_main_process,
    is_timeout,
    max_over_ranks,
    unshard_root,
)
from revffn.training.report import write_run_report
from revffn.training.setup import (
    LOCK_FILE,
    RunLock,
    check_output_dir,
    clear_run,
    finished_step,
    is_revffn_run,
    mark_finished,
    mark_run,
    model_overrides,
    prepare_run,
    private_files,
    resolve_launch,
    restart_values,
    saved_config_text,
    verify_resume,
)
from revffn.training.step import StepResult, build_run, restructure, train_step
from revffn.training.trackers import Trackers
from revffn.training.watch import RunWatch, append_event, read_jsonl_line, run_in_child

Fault = Callable[[str, int, int], None]
"""Test hook `fault(point, step, restart)`: called after each optimizer step ("step"), in the middle of each
checkpoint write ("save") and of the final/ swap ("final"), with the number of this `max_restarts` attempt (0:
the first); it may raise or kill the process (tests/training/fault_run.py)."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN/Inf. Exit code 1; the last good checkpoint stays intact."""


@dataclass
class _Window:
    """What one metrics line reports on: the steps since the previous line."""

    loss_sum: torch.Tensor  # () on the device: summed token losses (read once per line: the host sync)
    n_tokens: int = 0  # predicted tokens (the loss denominator)
    seen_tokens: int = 0  # input tokens (tokens_per_s)
    t_start: float = field(default_factory=time.perf_counter)


class Recipe:
    """One run: `build` -> `open` -> `train` -> `export`; `cleanup` closes the metrics file, the bar and the
    trackers, and stops the watchdog. `build` writes nothing: bad input it finds (a method option the model does not
    fit, a checkpoint that does not load) leaves the run directory as it was."""

    def __init__(self, cfg, plan, fault: Fault | None = None, restarts: int = 0):
        self.cfg, self.plan, self.restarts = cfg, plan, restarts
        # the hook at (point, step), told which attempt this is
        self.fault = None if fault is None else (lambda point, step: fault(point, step, restarts))
        self.step, self.stage = 0, None
        self.logged: tuple[int, float] | None = None  # the last metrics line's (step, loss): the heartbeat's
        self.main = is_main_process()  # rank 0 (or the only process): writes the run's files
        self._open = contextlib.ExitStack()  # the metrics file, the bar, the trackers and the watchdog
        self.failed = False  # how `cleanup` finishes the trackers' runs
        self.note = ""  # the progress's note: the last metrics line's loss, stage, speed and memory

    def build(self) -> None:
        """The model, the method, the optimizer and a resumed checkpoint's state, in memory only."""
        cfg, plan = self.cfg, self.plan
        self.run = build_run(cfg, plan.device, plan.weights_dtype, plan.autocast_dtype,
                             model_config=model_overrides(cfg, plan.tokenizer), strategy=plan.distributed,
                             resuming=plan.resume_from is not None, method_cls=plan.method)
        self.sharded = plan.distributed == "fsdp"  # every rank takes part in checkpoints, evals, export
        self.evaluates = self.main or self.sharded  # runs the evals (under FSDP, with the other ranks)
        # where the next items come from, resumably: an order over the tokenized set, or the stream itself
        self.order = plan.train_set if cfg.streaming else DataOrder(len(plan.train_set.items), cfg.seed)
        if plan.resume_from is not None:
            self._resume(plan.resume_from)
        if self.sharded:  # the method may call the root's modules (embeddings, final norm, head) directly
            unshard_root(self.run.model)

    def open(self) -> None:
        """Once the run directory is open (`_open_run_dir`): the method's own files (a teacher cache), the
        trackers, the progress and metrics.jsonl."""
        cfg, plan = self.cfg, self.plan
        if self.main and plan.resume_from is not None:
            _truncate_metrics(plan.run_dir / "metrics.jsonl", self.step)  # (to be logged again)
        if self.sharded and self.main:  # which loading route FSDP took (`build_run`): its host memory differs
            world = data_shard()[1]
            how = ("built on the meta device, each rank read only its shards" if self.run.loading == "sharded" else
                   f"loaded whole on each rank, then sharded (method {cfg.method} with these options, or this model, "
                   "has no sharded route: docs/multi_gpu.md)")
            _event(plan.run_dir, {"event": "load", "loading": self.run.loading, "world_size": world},
                   f"{cfg.model} on {world} FSDP ranks: {how}")
        s = plan.train_set.stats
        if self.main and plan.resume_from is None and s.get("n_cut"):  # (a stream's are not known ahead)
            left_out = f", {s['n_dropped']} of them all of it (left out)" if s["n_dropped"] else ""
            _event(plan.run_dir, {"event": "data_truncated", "max_seq_length": cfg.max_seq_length,
                                  **{k: s[k] for k in ("n_examples", "n_truncated", "n_cut", "n_dropped",
                                                       "n_train_tokens")}},
                   f"data: {s['n_cut']} of {s['n_examples']} examples lost tokens they train on (a response's end, "
                   f"a text's) to truncation at max_seq_length={cfg.max_seq_length}{left_out}; "
                   f"{s['n_train_tokens']} trained tokens left. A larger max_seq_length keeps them")
        self.run.method.before_training(self.run.model, None if cfg.streaming else plan.train_set.items)
        if self.main:  # before the bar: wandb and mlflow print as they start
            self.trackers = Trackers(cfg, plan.run_dir, self.step)
            self._open.callback(lambda: self.trackers.close(self.failed))
        # rank 0's progress: a bar on a terminal, else a line at most every 10 s (the last logged loss in both)
        self.bar = self._open.enter_context(progress(f"train {cfg.method}", "step", cfg.max_steps, initial=self.step,
                                                     disable=not self.main))
        self.metrics = self._open.enter_context(open(plan.run_dir / "metrics.jsonl", "a")) if self.main else None

    def _resume(self, path: Path) -> None:
        try:
            self._load_checkpoint(path)
        except (UserError, MemoryError, torch.cuda.OutOfMemoryError):  # (the machine's: restartable)
            raise
        except Exception as e:  # its files hash as its manifest says: written so (another version), or rehashed
            if data_shard()[1] > 1:  # under torchrun the error may be another rank's (a collective gave up)
                raise
            raise UserError(f"resume: checkpoint {str(path)!r} verifies but does not load ({type(e).__name__}: "
                            f"{one_line(e)[:300]}). Nothing was touched. Fix: resume=PATH an earlier "
                            "checkpoints/step-N, or start the run over with overwrite=true.") from e

    def _load_checkpoint(self, path: Path) -> None:
        saved = read_trainer_state(path)
        self.run.method.load_state_dict(saved.get("method_state", {}))  # e.g. which adapters RevFFN folded
        restructure(self.run, saved["step"] - 1)  # the structure the checkpoint's last step ran with
        state = load_checkpoint(path, self.run.model, self.run.optimizer)
        self.step = state["step"]
        order, (rank, world) = state["data_order"], data_shard()
        saved = len(order["ranks"]) if "ranks" in order else 1
        if self.cfg.streaming and saved != world:  # each rank reads its own shard of the stream, from its own place
            raise UserError(f"resume: {path} is a streamed run saved by {saved} process(es), each at its own place in "
                            f"its shard of the stream; this run has {world}. Fix: resume with {saved} process(es) "
                            "(torchrun --nproc-per-node), or start afresh.")
        self.order.load_state_dict(order["ranks"][rank] if "ranks" in order else order)
        self.run.method.load_state_dict(state["method_state"])

    def train(self) -> None:
        """The step loop: one optimizer step, then a metrics line, an eval and a checkpoint on their cadence."""
        cfg = self.cfg
        self.window = _Window(torch.zeros((), device=self.plan.device))
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.plan.device)  # sticky, checked per line
        watch = self._open.enter_context(RunWatch(cfg, self.plan.run_dir, self.run.device, self.main,
                                                  data_shard()[0]))  # stopped by cleanup, with the bar
        while self.step < cfg.max_steps:
            micro = self._micro_batches()
            prev_stage = self.stage
            result = train_step(self.run, self.step, micro)
            self.stage = result.stage
            self.window.loss_sum += result.loss_sum
            self.window.n_tokens += result.n_tokens
            self.window.seen_tokens += result.n_inputs
            self.nonfinite |= ~torch.isfinite(self.window.loss_sum)
            self.step += 1
            if self.fault is not None:
                self.fault("step", self.step)
            if self.step % cfg.logging_steps == 0 or self.step == cfg.max_steps or self.stage != prev_stage:
                self._log(result)
            self.bar(self.step, note=self.note)
            if cfg.save_steps and self.step % cfg.save_steps == 0 and self.step < cfg.max_steps:
                self._save()
            watch.step(self.step, self.logged)

    def _micro_batches(self) -> list[dict]:
        """The step's `gradient_accumulation_steps` micro-batches, in the (resumable) data order: this
        rank's share of each global micro-batch of `per_device_train_batch_size x world` items."""
        bsz, pad = self.cfg.per_device_train_batch_size, self.plan.tokenizer.pad_token_id
        if self.cfg.streaming:  # each rank reads its own shard of the stream
            return [collate(self.order.next_items(bsz), pad) for _ in range(self.cfg.gradient_accumulation_steps)]
        items, world = self.plan.train_set.items, data_shard()[1]
        return [collate([items[i] for i in shard_rows(self.order.next_indices(bsz * world), bsz)], pad)
                for _ in range(self.cfg.gradient_accumulation_steps)]

    def _log(self, result: StepResult) -> None:
        """One metrics.jsonl line (and the bar's postfix); raises TrainingDiverged on a NaN/Inf loss."""
        run, w, step = self.run, self.window, self.step
        dt = time.perf_counter() - w.t_start
        train_loss = (w.loss_sum / max(w.n_tokens, 1)).item()  # the one host sync per log
        if bool(self.nonfinite) or not math.isfinite(train_loss):
            raise TrainingDiverged(f"loss became {train_loss} at step {step} (stage {self.stage}, lr "
                                   f"{result.lr:.3g}). The last checkpoint is intact. Fix: lower learning_rate, "
                                   "raise warmup_steps, or set max_grad_norm.")
        rec = {"step": step, "stage": self.stage, "loss": train_loss, "lr": result.lr,
               "grad_norm": float(result.grad_norm), "tokens_per_s": w.seen_tokens / dt,
               "peak_mem_bytes": max_over_ranks(peak_memory_bytes(run.device), run.device)}
        if self.plan.eval_set is not None and self.cfg.eval_steps and step % self.cfg.eval_steps == 0 \
                and self.evaluates:
            rec["eval_loss"] = self.eval_loss()
        if result.aux_loss is not None:
            rec["aux_loss"] = float(result.aux_loss)
        rec.update(run.method.log_metrics(run.model, run.optimizer))
        if self.main:
            self._write(rec, train_loss)
        self.logged = (step, train_loss)
        self.window = _Window(w.loss_sum.zero_())  # the next line's window starts now

    def _write(self, rec: dict, train_loss: float) -> None:
        """Rank 0: the line to metrics.jsonl and the trackers, and the bar's postfix."""
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        self.trackers.log(rec)
        self.note = (f"loss={train_loss:.3f}, stage={self.stage}, tok_s={rec['tokens_per_s']:.0f}, "
                     f"mem={rec['peak_mem_bytes'] / 2**30:.2f}G")

    def _save(self) -> None:
        if bool(self.nonfinite):
            raise TrainingDiverged(f"loss became non-finite before the checkpoint at step {self.step}.")
        cfg, run = self.cfg, self.run
        state = {"step": self.step, "data_order": self._order_state(), "method_state": run.method.state_dict(),
                 "model": cfg.model, "method": cfg.method, "stage": self.stage}
        barrier()
        if self.main or self.sharded:
            save_checkpoint(self.plan.run_dir, self.step, run.model, run.optimizer, state, saved_config_text(cfg),
                            math_config(cfg, self.plan.weights_dtype), cfg.save_total_limit, self.fault,
                            sharded=self.sharded)
        barrier()

    def _order_state(self) -> dict:
        """The data order's state. A stream is read by each rank from its own shard, so under data parallelism
        every rank's position is saved (`{"ranks": [...]}`, gathered), and each resumes from its own."""
        rank, world = data_shard()
        if not (self.cfg.streaming and world > 1):
            return self.order.state_dict()
        states = [None] * world
        torch.distributed.all_gather_object(states, self.order.state_dict())
        return {"ranks": states}

    def eval_loss(self) -> float:
        plan, run = self.plan, self.run
        return eval_loss(run.model, plan.eval_set, self.cfg.per_device_train_batch_size,
                         plan.tokenizer.pad_token_id, run.device, run.autocast)

    def exact_match(self) -> dict | None:
        """Greedy generation on the first `eval_generate_limit` eval examples that have an answer, each scored by
        exact match (`evaluate.evaluate`, as `revffn eval` scores them), with the model as trained; None where the
        eval data has no answers. Under DDP rank 0 alone scores its replica (`run.model`, not the DDP wrapper: no
        collective), which is every rank's; under FSDP a rank holds a shard, and `revffn eval final/` scores it."""
        from revffn.data.formats import load_examples
        from revffn.training.evaluate import evaluate

        cfg = self.cfg
        scored = [e for e in load_examples(cfg.eval_data, "eval_data") if e.get("answer") is not None]
        if not scored:
            return None
        with self.run.autocast():
            return evaluate(self.run.model, self.plan.tokenizer, scored[: cfg.eval_generate_limit], cfg.max_seq_length,
                            cfg.per_device_train_batch_size, cfg.eval_max_new_tokens)

    def export(self) -> Path:
        """final/: the method's export and the tokenizer, written aside and swapped into place (`staged_dir`:
        a kill at any point leaves a complete final/, old or new), by rank 0; under FSDP the ranks first gather
        the model onto rank 0's host."""
        run_dir = self.plan.run_dir
        if self.sharded:
            gather_full(self.run.model, keep=self.main)
        if not self.main:
            barrier()
            return run_dir / "final"
        final = run_dir / "final"
        step = None if self.fault is None else (lambda k: self.fault("final", k))
        with disk_guard("final/", run_dir, lambda: state_bytes(self.run.model)):  # (staged_dir removes the partial
            with staged_dir(final, step) as tmp:  # write itself)
                self.run.method.export(self.run.model, tmp)
                self.plan.tokenizer.save_pretrained(tmp)
                save_generation_config(tmp, self.plan.tokenizer)
        barrier()
        return final

    def cleanup(self, failed: bool = False) -> None:
        """Close the bar, the metrics file and the trackers, stop the watchdog (idempotent); `failed` marks
        the trackers' runs failed."""
        self.failed = failed
        self._open.close()


def train(cfg, restarts: int = 0, fault: Fault | None = None, restart_error: str | None = None,
          held: RunLock | None = None) -> dict:
    """Run one training job described by a validated config; returns the final summary.
    `restart_error`: why this is restart number `restarts` (events.jsonl). `held`: the run directory's lock, taken
    by the `max_restarts` supervisor (this attempt, its forked child, shares it and leaves it held).

    Raises:
        UserError: bad input (nothing written). TrainingDiverged: the loss became NaN/Inf.
    """
    cfg = resolve_launch(cfg)
    plan = prepare_run(cfg)  # raises UserError for bad input; writes nothing
    init_distributed(plan.distributed, plan.device, cfg.distributed_timeout)
    plan = verify_resume(cfg, plan)  # under torchrun: the checkpoint's files hashed once a job, by the ranks
    main = is_main_process()
    before = _what_exists(plan.run_dir) if main else None
    lock = lock_run_dir(cfg, plan, restarts, held) if main else None
    agree_on_lock(True)  # rank 0 got here holding it (or told the others why not, in lock_run_dir)
    try:
        recipe = Recipe(cfg, plan, fault, restarts)
        try:
            recipe.build()
        except BaseException:  # before the directory is touched: leave it as it was (the lock's file included)
            recipe.cleanup(failed=True)
            if lock is not None and lock is not held:
                _remove_created(lock, *before)
            raise
        if main:
            finished = finished_step(plan.run_dir) if plan.resume_from is not None else None  # (before the marker's
            _open_run_dir(cfg, plan, restarts)                                                 # rewrite)
            if lock.taken_over and not restarts:  # a restart follows its own killed attempt: logged as the restart
                _event(plan.run_dir, {"event": "lock_taken_over", "holder": lock.taken_over[:200]}, "took over the "
                       f"run lock from a process that ended without releasing it ({lock.taken_over[:200]})")
            _log_resume(cfg, plan, restarts, restart_error, finished)
        return _train(recipe, main)
    finally:
        if lock is not None and lock is not held:
            lock.release()


def _what_exists(run_dir: Path) -> tuple[Path | None, bool]:
    """Before the lock: the outermost directory of `run_dir` that does not exist yet (None if it does), and
    whether the lock file is a run's own (outside a run it is what a start killed before it opened the run left).
    """
    missing = next((p for p in reversed([run_dir, *run_dir.parents]) if not p.exists()), None)
    return missing, (run_dir / LOCK_FILE).exists() and is_revffn_run(run_dir)


def _remove_created(lock: RunLock, missing: Path | None, run_lock: bool) -> None:
    """Releases `lock`, removing what taking it created in a run that never opened its directory: the lock's file
    (unless a run's own), and the directories from the run's up to `missing` where they are empty."""
    run_dir = lock.run_dir
    if run_lock:
        lock.release()
    else:
        lock.remove()
    if missing is None:
        return
    for d in [run_dir, *run_dir.parents]:
        with contextlib.suppress(OSError):
            d.rmdir()  # only an empty one
        if d == missing:
            break


def lock_run_dir(cfg, plan, restarts: int = 0, held: RunLock | None = None) -> RunLock:
    """The run directory's `RunLock`, and what needs it held: a final/ swap a killed run left half done is
    finished or rolled back (`sweep_staged`), and a run that another process started since `prepare_run` looked
    is seen now. A lock its holder never released (killed) is taken over (`train` logs that in events.jsonl once
    the run opens its directory).
    A UserError (held elsewhere, or a run there now) is raised on every rank under torchrun (`agree_on_lock`)."""
    lock = held
    try:
        lock = lock or RunLock(plan.run_dir).acquire()
        for line in sweep_staged(plan.run_dir / "final"):  # a final/ swap a killed run left half done
            _event(plan.run_dir, {"event": "final_swap_repaired", "what": line}, line)
        check_output_dir(cfg, plan.run_dir, plan.resume_from)
    except UserError as e:
        if lock is not None and lock is not held:
            lock.release()
        agree_on_lock(False, str(e))
        raise
    return lock


def agree_on_lock(held: bool, error: str = "") -> None:
    """Under torchrun, every rank learns whether rank 0 holds the run directory; the others raise its error."""
    if data_shard()[1] <= 1:
        return
    verdict = [error if not held else ""]
    torch.distributed.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise UserError(verdict[0])


def _train(recipe: Recipe, main: bool) -> dict:
    cfg, plan = recipe.cfg, recipe.plan
    summary: dict = {"status": "running", "restarts": recipe.restarts, "main": main}  # main: the one that reports
    try:
        recipe.open()
        summary.update(train_stats=plan.train_set.stats, method=cfg.method, model=cfg.model, device=str(plan.device))
        recipe.train()
        recipe.cleanup()
        if plan.eval_set is not None and recipe.evaluates:
            summary["eval_loss"] = recipe.eval_loss()
        final = recipe.export()
        if plan.eval_set is not None and cfg.eval_generate_limit and main and plan.distributed != "fsdp":
            try:  # (final/ is written: a failure here is reported, not the run's)
                scored = recipe.exact_match()
            except Exception as e:
                scored = None
                print(f"revffn train: the final exact-match eval failed ({type(e).__name__}: {str(e)[:300]}); final/ "
                      "is complete: score it with `revffn eval OUTPUT_DIR/final --data EVAL_DATA`", file=sys.stderr)
            if scored is not None:
                summary.update(eval_exact_match=scored["exact_match"], eval_scored=scored["n_scored"])
        if main:
            mark_finished(plan.run_dir, recipe.step)
        summary.update(status="ok", steps=recipe.step, final_dir=str(final), stage=recipe.stage)
        return summary
    except TrainingDiverged as e:
        summary.update(status="diverged", error=str(e))
        raise
    except UserError as e:  # bad input found part way (a streamed row): the run so far is kept, and resumable
        kept = checkpoint_dirs(plan.run_dir) if recipe.step else []
        if kept:
            e = type(e)(f"{e} The run stopped at step {recipe.step}; {plan.run_dir}/checkpoints keeps "
                        f"{kept[-1].name}: once that is fixed, resume=true continues from it.")
        summary.update(status="error", error=f"{type(e).__name__}: {e}")
        raise e from None
    except BaseException as e:
        summary.update(status="error", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        recipe.cleanup(failed=summary["status"] != "ok")
        if "train_stats" in summary:  # a stream's position, where the run ended
            summary["train_stats"] = plan.train_set.stats
        if main:
            with contextlib.suppress(Exception):
                write_run_report(plan.run_dir, summary)


def _open_run_dir(cfg, plan, restarts: int) -> None:
    """A new run gets config.yaml and an empty metrics.jsonl; a resumed one keeps its metrics."""
    run_dir = plan.run_dir
    if plan.resume_from is None:
        if cfg.overwrite:
            clear_run(run_dir, keep_events=restarts > 0)
        run_dir.mkdir(parents=True, exist_ok=True)
        mark_run(run_dir)
        (run_dir / "config.yaml").write_text(saved_config_text(cfg))
        (run_dir / "metrics.jsonl").write_text("")
    else:  # resuming, possibly from a checkpoint path into a fresh output_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / "config.yaml").exists():
            (run_dir / "config.yaml").write_text(saved_config_text(cfg))
        mark_run(run_dir)
        (run_dir / "metrics.jsonl").touch()
    clean_partial(run_dir)


def _log_resume(cfg, plan, restarts: int, restart_error: str | None, finished: int | None = None) -> None:
    """events.jsonl and stderr: the restart this run is (if it is one), and each checkpoint it rolled
    back over, which is moved aside to checkpoints/rejected-step-N (so it is neither resumed nor
    counted by save_total_limit again); stderr: which checkpoint a resume starts from, and that a resume of a run
    that had finished (at step `finished`) trains the steps after its newest checkpoint again (the last step has no
    checkpoint: final/ is the model)."""
    to = plan.resume_from.name if plan.resume_from is not None else None
    if finished is not None and to is not None:
        from_step = read_trainer_state(plan.resume_from)["step"]
        end = min(finished, cfg.max_steps)  # (a resume may also shorten the run)
        again = f"steps {from_step + 1}-{end}" if from_step + 1 < end else f"step {end}" if end > from_step else "none"
        more = f", then on to {cfg.max_steps}," if cfg.max_steps > finished else ""
        print(f"revffn train: the run had finished at step {finished}; resuming from {to} trains {again} again{more} "
              "and rewrites final/ (overwrite=true starts afresh)", file=sys.stderr)
    elif to is not None and restart_error is None:  # (a restart says it in its own line below)
        from_step = read_trainer_state(plan.resume_from)["step"]
        print(f"revffn train: resuming from {plan.resume_from} (step {from_step} of {cfg.max_steps})", file=sys.stderr)
    if restart_error is not None:
        limit = f"/{cfg.max_restarts}" if cfg.max_restarts else ""
        from_step = read_trainer_state(plan.resume_from)["step"] if to else 0  # (resume may name any dir)
        _event(plan.run_dir, {"event": "restart", "restart": restarts, "max_restarts": cfg.max_restarts or None,
                              "error": restart_error, "from_step": from_step},
               f"restart {restarts}{limit} after {restart_error} (from step {from_step})")
    for path, reason in plan.rejected:
        aside = path.with_name(f"rejected-{path.name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        _event(plan.run_dir, {"event": "rollback", "from": path.name, "to": to, "reason": reason,
                              "moved_to": str(aside.relative_to(plan.run_dir))},
               f"checkpoint {path.name} fails verification ({reason}); rolled back to {to}, {path.name} moved to "
               f"{aside.relative_to(plan.run_dir)}")


def _event(run_dir: Path, event: dict, message: str) -> None:
    append_event(run_dir, **event)
    print(f"revffn train: {message}", file=sys.stderr)


def _truncate_metrics(path, step: int) -> None:
    """On resume, drop metrics logged after the checkpoint (they will be produced again)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text(errors="replace").splitlines()
            if (record := read_jsonl_line(line)) is not None and record.get("step", 0) <= step]  # (a killed write's
    path.write_text("".join(line + "\n" for line in keep))                                   # line: dropped)


def run(cfg, fault: Fault | None = None) -> dict:
    """`train` with up to `max_restarts` automatic restarts from the last checkpoint after a crash, a kill
    or a stall (each attempt then runs in a child process, `watch.run_in_child`), its files private to the
    user (`setup.private_files`);
    under torchrun, the process group is left at the end (`parallel.init_distributed` joined it), and
    a collective that gave up waiting for the other ranks ends the run with `CollectiveTimeout`."""
    try:
        with private_files():
            return _run(cfg, fault)
    except RuntimeError as e:
        if data_shard()[1] > 1 and is_timeout(e):
            raise CollectiveTimeout(
                f"rank {data_shard()[0]}: a collective waited more than distributed_timeout={cfg.distributed_timeout}s "
                f"for the other ranks: one of them died or hangs. Fix: see the other ranks' errors above; raise "
                f"distributed_timeout if a step (or a checkpoint write) legitimately takes longer. ({e})") from e
        raise
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _run(cfg, fault: Fault | None) -> dict:
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun --max-restarts
    error = "torchrun restarted the job" if restarts else None
    held = None  # under max_restarts, from the first restart on: the run lock, held here between the attempts
    before = _what_exists(Path(cfg.output_dir))
    try:
        while True:
            try:
                if cfg.max_restarts:  # a stalled attempt ends its process (watch.Watchdog): supervise it from here
                    return run_in_child(train, cfg, restarts, fault, error, held,
                                        errors=(UserError, DiskFull, TrainingDiverged, CollectiveTimeout))
                return train(cfg, restarts, fault, error)
            except (UserError, TrainingDiverged, KeyboardInterrupt):
                raise
            except Exception as e:
                if restarts >= cfg.max_restarts:
                    raise
                restarts, error = restarts + 1, f"{type(e).__name__}: {e}"
                cfg = cfg.replace(**restart_values(cfg))
                if held is None:  # the attempt that held the directory is gone: hold it from here on, so no other
                    held = RunLock(Path(cfg.output_dir)).acquire()  # process starts there between the attempts
    except BaseException:
        if held is not None and not is_revffn_run(Path(cfg.output_dir)):  # no attempt opened the run (each failed
            _remove_created(held, *before)                                # building it): leave the directory as
            held = None                                                   # it was
        raise
    finally:
        if held is not None:
            held.release()

"""Everything checked before a model is built: output dir, resume target, tokenizer, data.

`prepare_run(cfg)` raises `UserError` for bad input and writes nothing; the loop only starts
allocating once it returns. A resume starts from a checkpoint whose files match its manifest and
whose math-relevant config matches the run's (`config.math_config`); newer checkpoints that fail
the check are rolled back over (`RunPlan.rejected`; the loop records it in events.jsonl).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import yaml

from revffn.data.collate import data_shard
from revffn.errors import UserError
from revffn.methods import method_class
from revffn.models.cache import file_in_the_way
from revffn.models.loading import check_model_ref, is_converted, resolve_model_ref
from revffn.models.model_config import check_model_config, check_vocabulary, context_length
from revffn.models.presets import TINY_PRESETS
from revffn.training.checkpoint import checkpoint_dirs, is_sharded_checkpoint, newest_verified, read_trainer_state
from revffn.training.config import MATH_KEYS_ADDED, NOT_READ, math_config
from revffn.training.manifest import MANIFEST, read_manifest, verify_checkpoint
from revffn.training.optim import check_optimizer
from revffn.training.parallel import launched_world, pick_distributed
from revffn.training.trackers import check_trackers

RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "final", "report.md", "loss.png", "memory.png",
             "events.jsonl", "tensorboard", "heartbeat.json", "teacher_cache")


@dataclass
class RunPlan:
    run_dir: Path
    resume_from: Path | None
    device: torch.device
    weights_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    tokenizer: object
    train_set: object
    eval_set: object | None
    distributed: str = "none"  # "none" | "ddp" | "fsdp" (`parallel.pick_distributed`)
    rejected: list[tuple[Path, str]] = field(default_factory=list)  # newer checkpoints that failed verification
    method: type | None = None  # the method's class (`method_class(cfg.method)`), looked up once
    model_dir: str | None = None  # where `cfg.model` resolved (configs and tokenizer; None: a tiny preset)


RUN_MARKER = ".revffn-run"  # written when a run starts: what `overwrite=true` may clear is a revffn run's


def run_files(run_dir: Path) -> list[str]:
    """The names in `run_dir` that a run writes (and `overwrite=true` would delete), as `ls` shows them."""
    if not run_dir.is_dir():
        return []
    return [f + "/" * (run_dir / f).is_dir() for f in RUN_FILES if (run_dir / f).exists()]


def is_revffn_run(run_dir: Path) -> bool:
    """`run_dir` holds a run revffn wrote: its marker, or (a run from before the marker) a config.yaml that
    names the run's method and output_dir beside a metrics.jsonl."""
    if (run_dir / RUN_MARKER).is_file():
        return True
    config, metrics = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    if not (config.is_file() and metrics.is_file()):
        return False
    try:
        head = config.read_text(errors="replace")[:100_000]
    except OSError:
        return False
    return all(re.search(rf"^{key}:", head, re.M) for key in ("method", "output_dir"))


def mark_run(run_dir: Path) -> None:
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    (run_dir / RUN_MARKER).write_text(json.dumps({"format": "revffn-run", "started": started}))


def mark_finished(run_dir: Path, step: int) -> None:
    """The run's marker records that it finished at `step` (final/ exported); a resume that starts it again
    rewrites the marker (`mark_run`), and its own finish records it again."""
    marker = run_dir / RUN_MARKER
    held = json.loads(marker.read_text()) if marker.is_file() else {"format": "revffn-run"}
    held.update(finished_step=step, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    marker.write_text(json.dumps(held))


def finished_step(run_dir: Path) -> int | None:
    """The step a run in `run_dir` finished at, or None (running, stopped, or from before stop 58)."""
    try:
        return json.loads((run_dir / RUN_MARKER).read_text()).get("finished_step")
    except (OSError, ValueError, AttributeError):
        return None


def resolve_resume(cfg, run_dir: Path, weights_dtype: torch.dtype,
                   hash_files: bool = True) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the checkpoint to resume from or None, [(newer checkpoint, why it failed verification)]).
    `resume=true` takes the newest checkpoint that verifies, `resume=PATH` that one if it verifies;
    either is refused when the config changes a key that changes the math, or when it is past max_steps. Under a
    process group the ranks share the hashing (`data_shard`); `hash_files=False` checks manifests and presence only
    (torchrun's ranks before their process group exists: `verify_resume` hashes once it does)."""
    if cfg.resume is False:
        return None, []
    shard = data_shard()
    if cfg.resume is True:
        ckpt, rejected = newest_verified(run_dir, shard, hash_files)
        if ckpt is None and not rejected:
            raise UserError(f"resume=true but {run_dir}/checkpoints holds no complete checkpoint. Fix: set "
                            "resume=false (with overwrite=true to replace the run), or save_steps > 0 next time.")
        if ckpt is None:
            failed = "; ".join(f"{p.name}: {why}" for p, why in rejected)
            raise UserError(f"resume=true but no checkpoint in {run_dir}/checkpoints verifies ({failed}). Nothing "
                            "was touched. Fix: restore the checkpoint from a backup, or set resume=false with "
                            "overwrite=true to start the run over.")
    else:
        if not cfg.resume.strip():
            raise UserError("resume: is empty. Fix: resume=true (the latest checkpoint in output_dir), false, or a "
                            "checkpoints/step-N directory.")
        ckpt, rejected = Path(cfg.resume), []
        if not ckpt.is_dir():
            raise UserError(f"resume: checkpoint {cfg.resume!r} not found. Fix: give a checkpoints/step-N "
                            "directory, or resume=true for the latest one in output_dir.")
        if not (ckpt / MANIFEST).is_file():
            read_trainer_state(ckpt)  # a directory that is no checkpoint at all: say so
        problem = verify_checkpoint(ckpt, shard, hash_files)
        if problem:
            raise UserError(f"resume: checkpoint {cfg.resume!r} fails verification: {problem}. Nothing was touched. "
                            "Fix: resume=true for the newest checkpoint of the run that verifies, or restore this "
                            "one from a backup.")
    check_resume_config(cfg, ckpt, weights_dtype)
    step = read_trainer_state(ckpt)["step"]
    if hash_files and step > cfg.max_steps:  # (unhashed, under torchrun: the checkpoint the ranks verify may be older)
        raise UserError(f"max_steps: {cfg.max_steps} is below the step of the checkpoint to resume, {str(ckpt)!r} "
                        f"(step {step}). Nothing was touched. Fix: max_steps above {step} to train on from it, or "
                        f"resume=PATH a checkpoints/step-N with N <= {cfg.max_steps}.")
    return ckpt, rejected


def check_resume_config(cfg, ckpt: Path, weights_dtype: torch.dtype) -> None:
    """Refuses a resume whose config differs from the checkpoint's in a key that changes the math
    (`config.RESUME_MAY_CHANGE` lists those that may change)."""
    saved = read_manifest(ckpt)["config"]
    # a checkpoint written before a key existed was trained with its old value (a function of its config: after
    # the plain values, which it may read)
    added = {k: v for k, v in MATH_KEYS_ADDED.items() if k.split(".")[0] == saved.get("method") and k not in saved}
    saved = {**saved, **{k: v for k, v in added.items() if not callable(v)}}
    for key, old in added.items():
        if callable(old) and (value := old(saved)) is not NOT_READ:
            saved[key] = value
    now = json.loads(json.dumps(math_config(cfg, weights_dtype)))  # as the manifest holds it
    changed = [k for k in saved if k in now and saved[k] != now[k]]
    if changed:
        says = ", ".join(f"{k}={now[k]!r}" for k in changed)
        was = ", ".join(f"{k}={saved[k]!r}" for k in changed)
        fix = " ".join(f"{k}={v if isinstance(v := saved[k], str) else json.dumps(v)}" for k in changed)
        raise UserError(f"resume: the config says {says}, but checkpoint {str(ckpt)!r} was trained with {was}, which "
                        f"changes the math of the run. Fix: resume with the checkpoint's value {fix}, or start a new "
                        "run in another output_dir.")


def check_output_dir(cfg, run_dir: Path, resume_from: Path | None) -> None:
    """The run directory can be created (no file in its place or on its path) and holds no other run."""
    if (blocker := file_in_the_way(run_dir)) is not None:
        raise UserError(f"output_dir: {str(run_dir)!r} cannot be a directory: {str(blocker)!r} is a file. Fix: "
                        "choose another output_dir.")
    dangling = next((p for p in (run_dir, *run_dir.parents) if p.is_symlink() and not p.exists()), None)
    if dangling is not None:
        raise UserError(f"output_dir: {str(run_dir)!r} cannot be a directory: {str(dangling)!r} is a symbolic link to "
                        f"{os.readlink(dangling)!r}, which does not exist. Fix: create its target, or choose another "
                        "output_dir.")
    nearest = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not os.access(nearest, os.W_OK | os.X_OK):
        what = "is" if nearest == run_dir else f"would be made in {str(nearest)!r}, which is"
        raise UserError(f"output_dir: {str(run_dir)!r} {what} not writable by this user. Nothing was touched. "
                        "Fix: choose an output_dir you can write to.")
    present = run_files(run_dir)
    if present and not is_revffn_run(run_dir):
        verb = "overwrite=true would delete" if cfg.overwrite else "the run would overwrite"
        raise UserError(f"output_dir: {str(run_dir)!r} holds files that are not a revffn run ({', '.join(present)}): "
                        f"{verb} them. Nothing was touched. Fix: choose another output_dir, or move those files "
                        "away.")
    if resume_from is None and present and not cfg.overwrite:
        raise UserError(f"output_dir: {str(run_dir)!r} already holds a run. Nothing was touched. Fix: set "
                        "resume=true to continue it, overwrite=true to replace it, or choose another output_dir.")


LOCK_FILE = ".revffn.lock"  # in output_dir: who holds the run (pid, host, start), flock'ed for the run


class RunLock:
    """An exclusive lock on a run directory for as long as a run writes there (`fcntl.flock` on
    `output_dir/.revffn.lock`, which names its holder). Taken by the process that writes the run's files (rank 0
    under torchrun) before anything in the directory is touched, so a second start, an `overwrite=true` or a
    resume of a live run exits 2 instead of interleaving with it or deleting its files. The kernel drops the lock
    when its process ends, however it ends: a killed run leaves no stale lock behind."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.fd = Path(run_dir), None
        self.taken_over: str | None = None  # after acquire: the holder a killed process left named in the file

    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 512, 0).decode(errors="replace")
                os.close(fd)
                try:
                    h = json.loads(holder)
                    who = f"pid {h['pid']} on {h['host']} since {h['started']}"
                except (ValueError, KeyError, TypeError):
                    who = "another process"
                raise UserError(f"output_dir: {str(self.run_dir)!r} is in use: held by {who}. Nothing was touched. "
                                "Fix: wait for it to finish, or choose another output_dir.") from None
            try:  # the file its holder removed before releasing it (`remove`) is no lock: open the one there now
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        left = os.pread(fd, 512, 0).decode(errors="replace")  # a holder that ended without release(): killed
        self.taken_over = left or None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode(), 0)
        self.fd = fd
        return self

    def remove(self) -> None:
        """Delete the lock file, still holding it (a start waiting on it then sees it gone: `acquire`), then
        release it."""
        if self.fd is not None:
            with contextlib.suppress(FileNotFoundError):
                (self.run_dir / LOCK_FILE).unlink()
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)  # an empty lock file: released cleanly (a killed holder leaves its name)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def clear_run(run_dir: Path, keep_events: bool = False) -> None:
    """overwrite=true: remove a previous run's files (only the ones a run writes, and only from a revffn run:
    `check_output_dir` refused anything else); a restart keeps its event log."""
    for name in RUN_FILES:
        if keep_events and name == "events.jsonl":
            continue
        p = run_dir / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def resolve_launch(cfg):
    """The config as this launch runs it. `global_batch_size` sets gradient_accumulation_steps for the
    number of processes; a job torchrun restarted (`--max-restarts`, TORCHELASTIC_RESTART_COUNT > 0)
    resumes from the last complete checkpoint, or starts over where there is none, as an in-process
    restart does (`max_restarts`)."""
    values, world = dict(cfg.values), launched_world()
    if cfg.global_batch_size is not None:
        per_step = cfg.per_device_train_batch_size * world
        if cfg.gradient_accumulation_steps != 1:
            raise UserError(f"global_batch_size: {cfg.global_batch_size} and gradient_accumulation_steps: "
                            f"{cfg.gradient_accumulation_steps} both set the batch. Fix: keep one of them.")
        if cfg.global_batch_size % per_step:
            raise UserError(f"global_batch_size: {cfg.global_batch_size} is not a multiple of "
                            f"per_device_train_batch_size {cfg.per_device_train_batch_size} x {world} processes = "
                            f"{per_step}. Fix: a global_batch_size that is a multiple of {per_step}, another "
                            "per_device_train_batch_size, or a number of processes that divides it.")
        values["gradient_accumulation_steps"] = cfg.global_batch_size // per_step
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) and cfg.resume is False:
        values.update(restart_values(cfg))
    return cfg if values == cfg.values else cfg.replace(**values)


def restart_values(cfg) -> dict:
    """The keys a restarted job runs with: `resume=true` where the run has checkpoints (the newest
    that verifies: `resolve_resume`), else starting over."""
    ckpts = bool(checkpoint_dirs(Path(cfg.output_dir)))
    return {"resume": ckpts, "overwrite": cfg.overwrite or not ckpts}


@contextlib.contextmanager
def private_files():
    """Files and directories the run creates are the user's alone (0600, 0700) whatever the umask:
    umask 077 while the run lasts (it is process-wide: the previous one is restored)."""
    before = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(before)


def pick_device(cfg) -> tuple[torch.device, torch.dtype, torch.dtype | None]:
    """(device, weights dtype, autocast dtype): bf16 on CUDA, fp32 on CPU unless dtype says otherwise.
    Under torchrun, CUDA is the rank's own device, `LOCAL_RANK`."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("device: cuda requested but no CUDA device is available. Fix: device=auto or device=cpu.")
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    local = os.environ.get("LOCAL_RANK")
    device = torch.device("cpu") if not cuda else torch.device("cuda", int(local)) if local else torch.device("cuda")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda else "float32")
    weights = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    autocast = torch.bfloat16 if (cuda and dtype == "bfloat16") else None
    return device, weights, autocast


def check_converted(cfg, method) -> None:
    """A converted model directory (`revffn convert`) trains only with a method that accepts it as it is."""
    from revffn.methods import METHODS

    if is_converted(cfg.model) and not method.ACCEPTS_CONVERTED:
        ok = ", ".join(n for n, m in METHODS.items() if m.ACCEPTS_CONVERTED)
        raise UserError(f"model: {cfg.model!r} holds a model already converted to RevFFN; method {cfg.method!r} "
                        f"trains unconverted HF models. Fix: method={ok}, or point model at the unconverted base.")
    if is_converted(cfg.model) and cfg.model_config:
        raise UserError(f"model_config: {cfg.model!r} holds a converted RevFFN model; its geometry is fixed. Fix: "
                        "remove model_config, or convert the base model again with the overrides.")


def prepare_run(cfg) -> RunPlan:
    """Validate everything that can be validated without a model. Writes nothing."""
    from revffn.data.collate import tokenize_dataset
    from revffn.data.formats import load_examples
    from revffn.data.tokenizer import model_tokenizer
    from revffn.models.generation import check_new_tokens

    check_model_ref(cfg.model)
    method = method_class(cfg.method)
    check_converted(cfg, method)
    run_dir = Path(cfg.output_dir)
    device, weights, autocast = pick_device(cfg)
    resume_from, rejected = resolve_resume(cfg, run_dir, weights, hash_files=launched_world() <= 1)
    distributed = pick_distributed(cfg, method)
    check_resume_target(cfg, run_dir, resume_from, distributed)
    check_trackers(cfg)
    check_optimizer(cfg, device, weights, method)
    model_dir = None if cfg.model in TINY_PRESETS else resolve_model_ref(cfg.model, weights=False)
    tokenizer = model_tokenizer(model_dir or cfg.model, cfg.tokenizer)
    vocab = cfg.model_config.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab < len(tokenizer):
        raise UserError(f"model_config.vocab_size: {vocab} is below the tokenizer's {len(tokenizer)} tokens: the ids "
                        f"above it have no embedding. Fix: model_config.vocab_size={len(tokenizer)} or more, or drop "
                        "it (a tiny preset takes the tokenizer's).")
    if "vocab_size" not in cfg.model_config:
        check_vocabulary(cfg.model, tokenizer, "model")
    if not is_converted(cfg.model):  # (a converted model refuses any: `check_converted`); as the model is built
        check_model_config(cfg.model, model_overrides(cfg, tokenizer),  # (a tiny preset: the tokenizer's vocabulary)
                           compute=weights, device=device.type)  # (grouped_mm runs in the weights' dtype)
    if cfg.streaming:
        train_set = open_stream(cfg, tokenizer)
    else:
        train_set = tokenize_dataset(load_examples(cfg.data, "data"), tokenizer, cfg.max_seq_length, cfg.packing,
                                     "data")
    step_rows = cfg.per_device_train_batch_size * launched_world() * cfg.gradient_accumulation_steps
    if not cfg.streaming and step_rows > len(train_set.items):
        s = train_set.stats
        why = (f" ({s['n_dropped']} of its {s['n_examples']} examples lost all they train on to truncation at "
               f"max_seq_length={cfg.max_seq_length})" if s["n_dropped"] else
               f" (its {s['n_examples']} examples packed into rows of {cfg.max_seq_length})" if cfg.packing else "")
        more = ", a larger max_seq_length" if s["n_dropped"] else ""
        raise UserError(f"per_device_train_batch_size {cfg.per_device_train_batch_size} x {launched_world()} "
                        f"processes x gradient_accumulation_steps {cfg.gradient_accumulation_steps} = {step_rows} rows "
                        f"a step, but data holds {len(train_set.items)}{why}: every step would repeat examples. Fix: a "
                        f"smaller batch (or global_batch_size){more}, or more data.")
    if not cfg.streaming:
        method.check_data(cfg, train_set.items)
    eval_set = None
    if cfg.eval_data:
        eval_examples = load_examples(cfg.eval_data, "eval_data")
        eval_set = tokenize_dataset(eval_examples, tokenizer, cfg.max_seq_length, False, "eval_data")
        if cfg.eval_generate_limit and any(e.get("answer") is not None for e in eval_examples):  # the final eval
            check_new_tokens(context_length(cfg.model, model_overrides(cfg, tokenizer)), cfg.eval_max_new_tokens,
                             "eval_max_new_tokens")
    return RunPlan(run_dir, resume_from, device, weights, autocast, tokenizer, train_set, eval_set, distributed,
                   rejected, method, model_dir)


def check_on_skeleton(cfg, plan: RunPlan) -> str | None:
    """`revffn validate`: the method prepared on the model built on the meta device (no weights, no memory), so the
    checks that need the model's modules (a target that matches nothing, an option its experts refuse) run before
    any weight is read. Raises their UserError; returns why the check could not run, if it could not."""
    from revffn.models.sharded import meta_hf

    try:
        hf = meta_hf(cfg.model, plan.weights_dtype, **model_overrides(cfg, plan.tokenizer))
        plan.method(cfg).prepare(hf)
    except UserError:
        raise
    except Exception as e:  # a method or a model that does not prepare without weights: train will tell
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


def open_stream(cfg, tokenizer):
    """`streaming: true`: the run's `TokenStream`, its first item read here (on one process's view of the whole
    source) so that a source that cannot load, or whose first rows fit no format, fails before any model is built."""
    from revffn.data.stream import TokenStream

    TokenStream(cfg.data, tokenizer, cfg.max_seq_length, cfg.packing, cfg.seed, shard=(0, 1)).next_items(1)
    return TokenStream(cfg.data, tokenizer, cfg.max_seq_length, cfg.packing, cfg.seed)


def check_resume_target(cfg, run_dir: Path, resume_from: Path | None, distributed: str) -> None:
    check_output_dir(cfg, run_dir, resume_from)
    if resume_from is not None:
        read_trainer_state(resume_from)  # a damaged one raises here, before the run's directory is locked
    if distributed == "fsdp" and resume_from is not None and not is_sharded_checkpoint(resume_from):
        raise UserError(f"resume: {str(resume_from)!r} holds the whole model of a run without FSDP; distributed: fsdp "
                        "resumes the sharded checkpoints FSDP writes. Fix: resume it with distributed=ddp or none.")


def verify_resume(cfg, plan: RunPlan) -> RunPlan:
    """Under torchrun, once the process group is up: the resume's checkpoint hashed by the ranks together, each
    file once a job (`prepare_run` checked manifests only), every rank with the same verdict."""
    if data_shard()[1] <= 1 or cfg.resume is False:
        return plan
    resume_from, rejected = resolve_resume(cfg, plan.run_dir, plan.weights_dtype)
    check_resume_target(cfg, plan.run_dir, resume_from, plan.distributed)
    return replace(plan, resume_from=resume_from, rejected=rejected)


def model_overrides(cfg, tokenizer) -> dict:
    """`model_config` overrides; presets are built with the tokenizer's vocabulary."""
    extra = {"vocab_size": len(tokenizer)} if cfg.model in TINY_PRESETS else {}
    return {**extra, **cfg.model_config}


def saved_config_text(cfg) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)

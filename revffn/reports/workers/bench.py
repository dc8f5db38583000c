"""One bench measurement, run in a fresh process per method so its peak memory is its own.

    python -m revffn.reports.workers.bench '{"model": "tiny-qwen2-moe", "method": "revffn", ...}'

prints exactly one JSON line (the result row) on stdout. The model is built as `revffn train`
builds it: `load_hf` (or random init for config-only presets), `METHODS[m](cfg).prepare`, `.train()`,
AdamW over `optimizer_parameters` with the loop's decay groups, and each step runs the loop's
sequence: `set_trainable`, forward (autocast on CUDA bf16), `loss_sum / n_tokens` (+ aux), backward,
clip, AdamW step, `zero_grad`, `after_step`. revffn runs in stage 2 (step >= adapter_warmup_steps);
hift cycles its groups (step i). One warm-up step (which also logs the bytes saved for backward),
then `steps` timed steps on one random (B, T) batch with labels = ids.

Memory: on CPU `peak_mem_bytes` is the process peak RSS minus the RSS right after the imports; on
CUDA `torch.cuda.max_memory_allocated` (and `_reserved`) after a reset once the model is built.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import peft  # noqa: F401  (imported before the RSS baseline for every method alike)
import torch
import transformers  # noqa: F401
from torch.multiprocessing.reductions import StorageWeakRef

from revffn.memory.measure import SavedTensorLog, current_rss_bytes, peak_rss_bytes
from revffn.methods import METHODS
from revffn.models.loading import build_hf
from revffn.reports.bench import train_config
from revffn.training.loop import _decay_groups


def _device_dtypes(cfg) -> tuple[torch.device, torch.dtype, torch.dtype | None]:
    from revffn.training.setup import pick_device

    return pick_device(cfg)


def _fault(method: str) -> None:
    """Test hook: REVFFN_BENCH_FAULT='lora=raise,dora=kill,full=oom' makes that method's worker fail."""
    for item in filter(None, os.environ.get("REVFFN_BENCH_FAULT", "").split(",")):
        name, _, action = item.partition("=")
        if name != method:
            continue
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action == "oom":
            raise MemoryError(f"injected out-of-memory in the {method} worker")
        raise RuntimeError(f"injected fault in the {method} worker")


class LiveSavedTensorLog(SavedTensorLog):
    """`SavedTensorLog` that counts only what is still held when asked: a tensor saved by a graph
    branch that was dropped during the forward (DoRA's weight-norm path) is freed, and its address
    may be reused, so it is neither held memory nor a reliable storage id."""

    def __init__(self, params=()):
        super().__init__(params)
        self.refs: dict[int, list] = {}

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.param_storages and ptr != 0:
            self.refs.setdefault(ptr, []).append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        return t

    def bytes(self, exclude: set[int] = frozenset()) -> int:
        total = 0
        for ptr, refs in self.refs.items():
            alive = [n for ref, n in refs if not ref.expired()]
            if alive and ptr not in exclude:
                total += max(alive)
        return total


def _state_bytes(optimizer, only: set[int] | None = None) -> int:
    total = 0
    for p, state in optimizer.state.items():
        if only is not None and id(p) not in only:
            continue
        total += sum(t.numel() * t.element_size() for k, t in state.items() if k != "step" and torch.is_tensor(t))
    return total


def measure(args: dict, baseline_rss: int | None = None) -> dict:
    """Build, warm up, time `steps` optimizer steps; the result row (without status handling)."""
    t_build = time.perf_counter()
    cfg = train_config(args)
    method_name = cfg.method
    device, weights_dtype, autocast_dtype = _device_dtypes(cfg)
    torch.manual_seed(cfg.seed)
    hf = build_hf(cfg.model, weights_dtype, cfg.seed, device, **cfg.model_config)
    method = METHODS[method_name](cfg)
    model = method.prepare(hf).to(device)
    model.train()
    params = method.optimizer_parameters(model)
    optimizer = torch.optim.AdamW(_decay_groups(params, cfg.weight_decay), lr=cfg.learning_rate,
                                  betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
    _fault(method_name)
    B, T, steps = int(args["batch"]), int(args["seq"]), int(args.get("steps", 1))
    g = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(3, hf.config.vocab_size, (B, T), generator=g).to(device)
    mask, labels = torch.ones_like(ids), ids
    n_total = B * (T - 1)
    autocast = (lambda: torch.autocast(device.type, dtype=autocast_dtype)) if autocast_dtype \
        else contextlib.nullcontext
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats(device)
    build_s = time.perf_counter() - t_build
    first = cfg.section("revffn")["adapter_warmup_steps"] if method_name == "revffn" else 0
    row: dict = {"activation_bytes": 0, "routing_record_bytes": 0, "grad_bytes": 0, "optimizer_state_bytes": 0,
                 "trainable_params": 0}
    times, stages = [], []
    for i in range(steps + 1):
        stage = method.set_trainable(model, first + i, optimizer)
        stages.append(stage)
        trainable = [p for p in params if p.requires_grad]
        row["trainable_params"] = max(row["trainable_params"], sum(p.numel() for p in trainable))
        # the warm-up step logs what is saved for backward; hift every step (its trainable set moves)
        log = LiveSavedTensorLog(model.parameters()) if i == 0 or method_name == "hift" else None
        sync()
        t0 = time.perf_counter()
        with autocast(), (log.hooks() if log is not None else contextlib.nullcontext()):
            out = model(input_ids=ids, attention_mask=mask, labels=labels, return_logits=False)
        t_log = time.perf_counter()
        if log is not None:  # counted while the graph holds them, outside the timed part
            stats = getattr(model, "last_stack_stats", {}) or {}
            act = log.bytes(stats.get("record_storages", set()))
            row["activation_bytes"] = max(row["activation_bytes"], act)
            row["routing_record_bytes"] = int(stats.get("record_bytes", 0))
        t_log = time.perf_counter() - t_log
        loss = out.loss_sum / max(n_total, 1)
        if out.aux_loss is not None and out.aux_loss.requires_grad:
            loss = loss + model.aux_loss_coef * out.aux_loss
        loss.backward()
        t_fb = time.perf_counter() - t0 - t_log
        with_grad = [p for p in params if p.grad is not None]
        row["grad_bytes"] = max(row["grad_bytes"], sum(p.grad.numel() * p.grad.element_size() for p in with_grad))
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(with_grad, cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        method.after_step(first + i, model, optimizer)
        sync()
        t_opt = time.perf_counter() - t1
        active = {id(p) for p in trainable}
        row["optimizer_state_bytes"] = max(row["optimizer_state_bytes"], _state_bytes(optimizer, active))
        if i > 0:
            times.append(t_fb + t_opt)
        if not torch.isfinite(loss.detach()):
            raise RuntimeError(f"loss became {loss.item()} at bench step {i}")
    unique = {id(p): p for p in model.parameters()}.values()
    row.update(
        param_bytes=sum(p.numel() * p.element_size() for p in unique),
        total_params=sum(p.numel() for p in unique),
        optimizer_state_bytes_total=_state_bytes(optimizer),
        tokens_per_s=statistics.median(B * T / t for t in times) if times else None,
        step_times_s=times, build_s=build_s, stage=stages[-1], device=str(device),
        threads=torch.get_num_threads(), loss=float(loss.detach()),
        geometry={k: getattr(hf.config, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size")},
    )
    if cuda:
        row["gpu"] = torch.cuda.get_device_name(device)
        row["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
        row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    else:
        row["peak_mem_bytes"] = peak_rss_bytes() - baseline_rss if baseline_rss is not None else None
        row["baseline_rss_bytes"] = baseline_rss
    return row


def run(args: dict, baseline_rss: int | None = None) -> dict:
    """`measure` with the failure kinds of the bench: status ok, oom or error (with its message)."""
    t0 = time.perf_counter()
    if args.get("threads"):
        torch.set_num_threads(int(args["threads"]))
    try:
        row = {"method": args["method"], "status": "ok", **measure(args, baseline_rss)}
    except (torch.OutOfMemoryError, MemoryError) as e:
        row = {"method": args["method"], "status": "oom", "error": f"{type(e).__name__}: {str(e)[:500]}"}
    except Exception as e:  # a failed method is a row, not a crash of the bench
        row = {"method": args["method"], "status": "error", "error": f"{type(e).__name__}: {str(e)[:500]}"}
    row["wall_s"] = time.perf_counter() - t0
    return row


def main(argv: list[str] | None = None) -> int:
    baseline = current_rss_bytes()  # after the imports, before anything is built
    argv = sys.argv[1:] if argv is None else argv
    row = run(json.loads(argv[0]), baseline)
    sys.stdout.write(json.dumps(row) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

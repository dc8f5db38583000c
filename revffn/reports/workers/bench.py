"""One bench measurement, run in a fresh process per method so its peak memory is its own.

    python -m revffn.reports.workers.bench '{"model": "tiny-qwen2-moe", "method": "revffn", ...}'

prints exactly one JSON line (the result row) on stdout. The run is built and stepped as `revffn
train` builds and steps it: `build_run` (the method's prepared model, AdamW in the loop's decay
groups) and `train_step` (set_trainable, the LR schedule, forward, loss, backward, clip, AdamW,
zero_grad, after_step), from the method's `steady_state_step()` on (RevFFN: stage 2; HiFT cycles
its groups). One warm-up step, then `steps` timed steps on one random (B, T) batch, labels = ids.
The bytes saved for backward are logged on each step whose trainable set differs from the step
before (the warm-up step; every HiFT step), and counted outside the timed part.

Under torchrun (`revffn bench --nproc N`: `args["distributed"]` ddp or fsdp) every rank joins the
process group as training does (`parallel.init_distributed`: gloo on CPU, NCCL on CUDA), steps a
batch of its own (B rows, drawn with seed + rank) and prints its own row, tagged with `rank`; the
parent gathers them.

Imports come before the start-up's clock and memory baseline: transformers loads its modules lazily, so the model
classes' (1.2-2.6 s on 2 cores where torchao and scipy are installed, which transformers then imports) are loaded
here, not inside the timed build, on every rank and in the one process alike; so are the model's own module and
transformers' table of checkpoint conversions (`load_library`, its time the row's `library_s`). So is the process
group's rendezvous (`rendezvous`, the row's `rendezvous_s`): the clock starts with every rank present.

Memory: on CPU `peak_mem_bytes` is the peak RSS over the steps (the high-water mark reset once the model is
built, `peak_since: built`; `load_peak_rss_bytes` is the start-up's) minus the RSS right after the imports; on
CUDA `torch.cuda.max_memory_allocated` (and `_reserved`) after a reset once the model is built.
Parameter, gradient and optimizer-state bytes are what this process holds: of a sharded (FSDP2
DTensor) tensor, its local shard.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import statistics
import sys
import time
import weakref

import accelerate  # noqa: F401  (the meta build's `init_empty_weights`)
import torch
import transformers.modeling_utils  # noqa: F401
from torch.distributed.tensor import DTensor

from revffn.memory.measure import SavedTensorLog, current_rss_bytes, peak_rss_bytes, reset_rss_peak
from revffn.methods import method_class
from revffn.models.loading import build_hf, hf_config
from revffn.models.sharded import sharded_loadable
from revffn.reports.bench import train_config
from revffn.training.parallel import init_distributed, max_over_ranks, pick_distributed
from revffn.training.setup import pick_device
from revffn.training.step import Run, build_run, train_step


class LiveSavedTensorLog(SavedTensorLog):
    """`SavedTensorLog` that counts only what is still held when asked, at its size then: a tensor
    saved by a graph branch that was dropped during the forward (DoRA's weight-norm path) is freed,
    and its address may be reused, so it is neither held memory nor a reliable storage id; and under
    FSDP2 a unit's gathered parameters, saved by its forward, have their storage freed (resized to 0)
    after it, to be gathered again in the backward."""

    def __init__(self, params=()):
        super().__init__(params)
        self.refs: dict[int, list] = {}

    def pack(self, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.param_storages and ptr != 0:
            self.refs.setdefault(ptr, []).append(weakref.ref(t))  # the graph holds `t` itself
        return t

    def bytes(self, exclude: set[int] = frozenset()) -> int:
        total = 0
        for ptr, refs in self.refs.items():
            alive = [t.untyped_storage().nbytes() for t in (ref() for ref in refs) if t is not None]
            if alive and ptr not in exclude:
                total += max(alive)
        return total


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds; a tensor subclass counts its inner tensors: torchao's quantized
    optimizer states, and a DTensor (FSDP2) its local shard."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
        return sum(_tensor_bytes(x) for x in inner if torch.is_tensor(x))  # a DTensor also names its mesh
    return t.numel() * t.element_size()


def _state_bytes(optimizer, only: set[int] | None = None) -> int:
    total = 0
    for p, state in optimizer.state.items():
        if only is not None and id(p) not in only:
            continue
        total += sum(_tensor_bytes(t) for k, t in state.items() if k != "step" and torch.is_tensor(t))
    return total


class _Probe:
    """The measurements inside `train_step`, kept as the maximum over steps in `row`: trainable
    parameters, bytes saved for backward (on a step with a new trainable set), gradient bytes; and
    the step's timings without the logging: `t_fb` (forward + backward), `t1` (optimizer part start)."""

    def __init__(self, run: Run, row: dict):
        self.run, self.row, self.cuda = run, row, run.device.type == "cuda"
        self.trainable: frozenset[int] = frozenset()  # ids of the last step's trainable parameters
        self.t0 = self.t_log = self.t_fb = self.t1 = 0.0

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.run.device)

    @contextlib.contextmanager
    def forward(self):
        """Around the forward: start the clock; log what autograd saves when the trainable set is new."""
        trainable = [p for p in self.run.params if p.requires_grad]
        ids = frozenset(id(p) for p in trainable)
        # a sharded (FSDP2) parameter has no storage of its own: its local shard has
        params = (p.to_local() if isinstance(p, DTensor) else p for p in self.run.model.parameters())
        log = LiveSavedTensorLog(params) if ids != self.trainable else None
        self.trainable = ids
        self.row["trainable_params"] = max(self.row["trainable_params"], sum(p.numel() for p in trainable))
        self.sync()
        self.t0 = time.perf_counter()
        with log.hooks() if log is not None else contextlib.nullcontext():
            yield
        t_log = time.perf_counter()
        if log is not None:  # counted while the graph holds them, outside the timed part
            stats = getattr(self.run.model, "last_stack_stats", {}) or {}
            act = log.stack_bytes(stats)
            self.row["activation_bytes"] = max(self.row["activation_bytes"], act)
            self.row["routing_record_bytes"] = int(stats.get("record_bytes", 0))
        self.t_log = time.perf_counter() - t_log

    def after_backward(self) -> None:
        self.t_fb = time.perf_counter() - self.t0 - self.t_log
        grads = sum(_tensor_bytes(p.grad) for p in self.run.params if p.grad is not None)
        grads = max(grads, getattr(self.run.optimizer, "largest_grad_bytes", 0))  # in-backward: freed as stepped
        self.row["grad_bytes"] = max(self.row["grad_bytes"], grads)
        self.t1 = time.perf_counter()


def load_library(args: dict) -> float:
    """What transformers makes on first use, made before the start-up's clock as the imports are, in the one process
    and on every rank alike: the module of the model's classes (its lazy import) and its table of checkpoint
    conversions (every arch's key renamings, their regular expressions compiled: 0.07-0.36 s on 2 cores). Neither
    depends on the model's size, nor can sharding divide it. Returns its seconds (the row's `library_s`)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    t = time.perf_counter()
    with contextlib.suppress(Exception):  # a model that cannot be found or built fails in `run`, as a row
        cfg = train_config(args)
        MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config(cfg.model, **cfg.model_config))]
        get_checkpoint_conversion_mapping("")  # builds the whole table once
    return time.perf_counter() - t


def rendezvous(strategy: str, device: torch.device, timeout_s: int) -> float:
    """Join the process group as training does (`parallel.init_distributed`) and wait there for every rank: the
    ranks' imports end apart (4.8-7.0 s each on 2 shared CPU cores, up to 3.4 s apart), and the group forms only
    when the last rank joins. Returns its seconds (the row's `rendezvous_s`; 0 in one process). The start-up's clock
    starts after it, with every rank present, as torchtune's model-load time ("Instantiating model and loading
    checkpoint took") starts after `init_process_group`: what it measures is the load, which sharding divides, not
    the launch."""
    if strategy == "none":
        return 0.0
    t = time.perf_counter()
    init_distributed(strategy, device, timeout_s)
    max_over_ranks(0, device)  # returns once every rank has joined: a barrier, on gloo and NCCL alike
    return time.perf_counter() - t


def measure(args: dict, baseline_rss: int | None = None) -> dict:
    """Build, warm up, time `steps` optimizer steps; the result row (without status handling)."""
    method_class(args["method"], args.get("method_module"))  # a method registered outside the package
    cfg = train_config(args)
    device, weights_dtype, autocast_dtype = pick_device(cfg)
    strategy = pick_distributed(cfg)
    rendezvous_s = rendezvous(strategy, device, cfg.distributed_timeout)
    t_build = time.perf_counter()
    rank = torch.distributed.get_rank() if strategy != "none" else 0
    # under FSDP a checkpoint loads shard by shard as training loads it (`models.sharded`); otherwise as it builds
    hf = None if strategy == "fsdp" and sharded_loadable(cfg.model, cfg.model_config) else \
        build_hf(cfg.model, weights_dtype, cfg.seed, device, **cfg.model_config)
    run = build_run(cfg, device, weights_dtype, autocast_dtype, hf=hf, strategy=strategy)
    hf = run.hf
    B, T, steps = int(args["batch"]), int(args["seq"]), int(args.get("steps", 1))  # B: per rank
    g = torch.Generator().manual_seed(cfg.seed + rank)
    ids = torch.randint(3, hf.config.vocab_size, (B, T), generator=g).to(device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    row: dict = {"activation_bytes": 0, "routing_record_bytes": 0, "grad_bytes": 0, "optimizer_state_bytes": 0,
                 "trainable_params": 0}
    probe = _Probe(run, row)
    if probe.cuda:
        probe.sync()
        torch.cuda.reset_peak_memory_stats(device)
    build_s = time.perf_counter() - t_build
    # start-up: the process's peak RSS from its start until the model is built, prepared (calibrated) and sharded,
    # and the time from the process group's forming until then (the build, the preparation and the sharding)
    row.update(load_peak_rss_bytes=peak_rss_bytes(), load_s=build_s, rendezvous_s=rendezvous_s, loading=run.loading)
    row["peak_since"] = "built" if reset_rss_peak() else "start"  # the steps' peak, as CUDA's after its reset
    first = run.method.steady_state_step()
    times, stages = [], []
    for i in range(steps + 1):
        result = train_step(run, first + i, [batch], probe.forward, probe.after_backward)
        probe.sync()
        t_opt = time.perf_counter() - probe.t1
        stages.append(result.stage)
        row["optimizer_state_bytes"] = max(row["optimizer_state_bytes"], _state_bytes(run.optimizer, probe.trainable))
        if i > 0:
            times.append(probe.t_fb + t_opt)
        loss = result.loss_sum / max(result.n_tokens, 1)
        if not torch.isfinite(loss):
            raise RuntimeError(f"loss became {loss.item()} at bench step {i}")
    unique = {id(p): p for p in run.model.parameters()}.values()
    row.update(
        param_bytes=sum(_tensor_bytes(p) for p in unique),
        total_params=sum(p.numel() for p in unique),
        optimizer_state_bytes_total=_state_bytes(run.optimizer),
        tokens_per_s=statistics.median(B * T / t for t in times) if times else None,
        step_times_s=times, build_s=build_s, stage=stages[-1], device=str(device),
        threads=torch.get_num_threads(), loss=float(loss),
        geometry={k: getattr(hf.config, k, None) for k in ("num_hidden_layers", "hidden_size", "vocab_size")},
    )
    return {**row, **peak_memory(device, baseline_rss)}


def peak_memory(device: torch.device, baseline_rss: int | None) -> dict:
    """The row's peak: CUDA max allocated (and reserved) since the reset, or on CPU the peak RSS since the reset
    (`reset_rss_peak`) minus the RSS after the imports."""
    if device.type == "cuda":
        return {"gpu": torch.cuda.get_device_name(device), "peak_mem_bytes": torch.cuda.max_memory_allocated(device),
                "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    return {"peak_mem_bytes": peak_rss_bytes() - baseline_rss if baseline_rss is not None else None,
            "baseline_rss_bytes": baseline_rss}


def run(args: dict, baseline_rss: int | None = None, measure=measure) -> dict:
    """`measure` (this worker's, or a peer's) with the failure kinds of the bench: status ok, oom or error
    (with its message)."""
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
    argv = sys.argv[1:] if argv is None else argv
    args = json.loads(argv[0])
    with contextlib.suppress(Exception):  # (a method that cannot be found or imported fails in `run`, as a row)
        for library in method_class(args["method"], args.get("method_module")).LIBRARIES:  # (peft: LoRA, DoRA)
            importlib.import_module(library)  # as the method's prepare would, but before the baseline
    library_s = load_library(args)
    baseline = current_rss_bytes()  # after the imports, before anything is built
    row = {**run(args, baseline), "library_s": library_s}
    if args.get("nproc", 1) > 1:  # torchrun's ranks share the parent's stdout: each line names its rank
        row = {**row, "rank": int(os.environ.get("RANK", 0)), "world_size": int(os.environ.get("WORLD_SIZE", 1))}
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    # one write of the whole line: a pipe keeps a write of up to 4 KiB whole (a row is ~0.7 KiB), so
    # ranks writing at once do not interleave within their lines
    os.write(sys.stdout.fileno(), (json.dumps(row) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`revffn bench`: every method on one model geometry, each in a fresh process; a sweep over one variable.

    revffn bench --model tiny-qwen2-moe --methods full,ckpt,revffn --layers 16 --hidden 256 \\
        --batch 4 --seq 512 --steps 3 --out runs/bench
    revffn bench ... --sweep layers=4,8,16,32 --out runs/bench
    revffn bench ... --nproc 2 [--distributed fsdp|ddp] --out runs/bench_fsdp
    revffn bench ... --peers hf-trainer[,trl-sft] --out runs/bench     # and the tools users would run instead

Each method runs in `revffn.reports.workers.bench` (its own process, so its peak memory is its own)
and returns one row: peak memory, bytes saved for backward, grads, optimizer states, tokens/s and a
status (`ok`, `oom`, `error`: a failed method stays in the table). Every row also carries the
analytic estimate (`revffn.memory.estimate`) of the same configuration. Outputs: `bench.json`
(`run_info`, `meta_info`, `results`) rendered to `bench.md` / `bench.png`; a sweep writes
`sweep.json` / `sweep.md` / `sweep.png` (`revffn.reports.render.bench`).

`--nproc N` (N > 1) runs each method's worker under torchrun, N ranks (FSDP2 by default), each
stepping `--batch` rows of its own: the row holds every rank's measurement (`ranks`), memory as the
max over ranks, and the same method measured in one process (`one_process`), so that what sharding
saves per rank shows as a ratio (`static_vs_one_process`, `peak_vs_one_process`).

`--peers` adds, after the methods, each peer trainer (`revffn.reports.workers.peer.PEERS`: transformers'
`Trainer`, TRL's `SFTTrainer`) without and with gradient checkpointing: rows `hf-trainer` and
`hf-trainer+ckpt`, the same model, batch, dtype and optimizer, measured the same way, in the same kind of
fresh process. On CPU every worker runs with `ALLOC_ENV` (recorded in `run_info.worker_env`).

`--repeat N` measures each configuration N times, in fresh processes each time: every figure of the row is the
median of the N runs' (of each rank's, rank by rank), and `repeats` keeps each run's timings for the spread.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from revffn.errors import UserError, closest
from revffn.progress import progress

WORKER_MODULE = "revffn.reports.workers.bench"  # run as `python -m WORKER_MODULE ARGS_JSON`
PEER_MODULE = "revffn.reports.workers.peer"  # a peer trainer's measurement, the same way
PEERS = ("hf-trainer", "trl-sft")  # `revffn.reports.workers.peer.PEERS` (imported by the worker only)
CKPT_SUFFIX = "+ckpt"  # a peer's row with gradient checkpointing: `hf-trainer+ckpt`
SWEEP_VARS = {"layers": "layers", "seq": "seq", "batch": "batch", "hidden": "hidden"}
Runner = Callable[[dict, float | None], dict]  # (worker args, timeout) -> result row; default `run_worker`


@dataclass
class BenchSpec:
    """One bench configuration (the CLI's arguments, resolved)."""

    model: str
    methods: list[str]
    layers: int | None = None
    hidden: int | None = None
    batch: int = 4
    seq: int = 512
    steps: int = 3
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    threads: int | None = None
    set: list[str] = field(default_factory=list)
    timeout: float | None = None
    nproc: int = 1  # processes (torchrun ranks) per measurement; `batch` is per rank
    distributed: str | None = None  # none | ddp | fsdp; None: fsdp when nproc > 1
    peers: list[str] = field(default_factory=list)  # of PEERS: each also run with gradient checkpointing
    repeat: int = 1  # runs per measurement, each in fresh processes; the row holds their medians


def resolve(spec: BenchSpec) -> BenchSpec:
    """Check the spec (UserError on bad input) and resolve device/dtype `auto` as training does."""
    import torch

    from revffn.methods import method_class
    from revffn.models.loading import DTYPES, model_kind, resolve_model_ref
    from revffn.models.model_config import check_width
    from revffn.training.parallel import check_strategy

    if model_kind(spec.model, "--model") == "hub":  # fetched once, here: the workers read the cache offline
        resolve_model_ref(spec.model, "--model", weights=spec.hidden is None)
    for m in spec.methods:
        method_class(split_label(m)[0], key="--methods")
    if not spec.methods:
        raise UserError("--methods: give at least one method, e.g. full,ckpt,revffn.")
    check_peers(spec.peers, spec.nproc)
    if spec.dtype not in ("auto", "float32", "bfloat16"):
        raise UserError(f"--dtype: {spec.dtype!r} is not one of auto, float32, bfloat16.")
    if spec.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device: {spec.device!r} is not one of auto, cpu, cuda.")
    if spec.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available. Fix: --device auto or cpu.")
    device = spec.device if spec.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = spec.dtype if spec.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    check_width(spec.model, spec.layers, spec.hidden, compute=DTYPES[dtype], device=device)
    out = BenchSpec(**{**asdict(spec), "device": device, "dtype": dtype,
                       "distributed": _strategy(spec.nproc, spec.distributed, device)})
    for m in out.methods:  # every method's config validates before anything runs
        try:
            cfg = train_config(worker_args(out, m))
        except UserError as e:  # a key of --set or of the method's own NAME:KEY=VALUE options
            raise UserError(f"--methods {m} / --set: {str(e).replace('override: ', '')}") from None
        if out.distributed != "none":
            try:
                check_strategy(cfg, out.distributed)
            except UserError as e:
                raise UserError(f"--methods {m} with --nproc {out.nproc}: {e}") from None
    return out


def check_peers(peers: list[str], nproc: int) -> None:
    """`--peers`: known names, an installed trainer, one process (UserError otherwise)."""
    import importlib.util

    for p in (p.removesuffix(CKPT_SUFFIX) for p in peers):
        if p not in PEERS:
            raise UserError(f"--peers: unknown peer {p!r}.{closest(p, PEERS)} Fix: one or more of {', '.join(PEERS)} "
                            f"(NAME{CKPT_SUFFIX}: only its run with gradient checkpointing).")
        if p == "trl-sft" and importlib.util.find_spec("trl") is None:
            raise UserError("--peers trl-sft: TRL is not installed. Fix: pip install trl, or --peers hf-trainer.")
    if peers and nproc > 1:
        raise UserError(f"--peers with --nproc {nproc}: the peers run in one process. Fix: --nproc 1, or leave out "
                        "--peers.")


def peer_labels(peers: list[str]) -> list[str]:
    """Each peer's two rows, without and with gradient checkpointing (`NAME+ckpt`: the latter only)."""
    return [label for p in peers for label in ([p] if p.endswith(CKPT_SUFFIX) else [p, p + CKPT_SUFFIX])]


def _strategy(nproc: int, distributed: str | None, device: str) -> str:
    """The data-parallel strategy of `--nproc`/`--distributed` (UserError on a bad pair)."""
    import torch

    from revffn.training.parallel import STRATEGIES

    if nproc < 1:
        raise UserError(f"--nproc {nproc}: need at least one process. Fix: --nproc 1 (one process) or --nproc 2 "
                        "or more (torchrun ranks).")
    strategy = distributed or ("fsdp" if nproc > 1 else "none")
    if strategy not in ("none", *STRATEGIES):
        raise UserError(f"--distributed {strategy!r} is not a strategy.{closest(strategy, STRATEGIES)} Fix: "
                        "--distributed fsdp (the default with --nproc 2 or more) or ddp.")
    if nproc > 1 and strategy == "none":
        raise UserError(f"--nproc {nproc} with --distributed none: each process would train the whole model "
                        "alone. Fix: --distributed fsdp (the default) or ddp, or --nproc 1.")
    if nproc == 1 and strategy != "none":
        raise UserError(f"--distributed {strategy} with one process: nothing to shard or average over. Fix: "
                        "--nproc 2 or more, or leave out --distributed.")
    if device == "cuda" and nproc > torch.cuda.device_count():
        raise UserError(f"--nproc {nproc}: only {torch.cuda.device_count()} CUDA devices, one rank each. Fix: "
                        f"--nproc {torch.cuda.device_count()} or fewer.")
    return strategy


def split_label(label: str) -> tuple[str, list[str]]:
    """'revffn:optimizer=adafactor:optimizer_in_backward=true' -> ('revffn', ['optimizer=adafactor', ...]):
    a method with training-config overrides of its own, so variants run side by side in one bench."""
    name, *overrides = label.split(":")
    return name, overrides


def worker_args(spec: BenchSpec, method: str) -> dict:
    """The worker's JSON arguments for one method (a label: NAME[:KEY=VALUE...]). `method_module`: the
    module that registers it, which the worker imports first (a method registered outside the package).
    A peer's label (`peer_labels`) runs the peer worker, on the revffn method it trains like (`full`,
    `ckpt`: the training config, and the estimate its row carries)."""
    from revffn.methods import method_class
    from revffn.models.loading import config_overrides

    peer = method.removesuffix(CKPT_SUFFIX) if method.removesuffix(CKPT_SUFFIX) in PEERS else None
    if peer is not None:
        checkpointing = method.endswith(CKPT_SUFFIX)
        return {**worker_args(spec, "ckpt" if checkpointing else "full"), "label": method, "worker": PEER_MODULE,
                "peer": peer, "checkpointing": checkpointing, "set": list(spec.set)}
    name, overrides = split_label(method)
    return {"model": spec.model, "method": name, "label": method, "method_module": method_class(name).__module__,
            "model_config": config_overrides(spec.model, spec.layers, spec.hidden),
            "batch": spec.batch, "seq": spec.seq, "steps": spec.steps, "dtype": spec.dtype, "device": spec.device,
            "seed": spec.seed, "threads": spec.threads, "set": [*spec.set, *overrides], "nproc": spec.nproc,
            "distributed": spec.distributed or "none"}


def estimate_fields(args: dict) -> dict:
    """The analytic estimate of the measured configuration, as `est_*` fields of a result row."""
    from revffn.memory.estimate import estimate
    from revffn.methods import method_class
    from revffn.models.loading import hf_config

    try:
        cfg = train_config(args)
        method = method_class(cfg.method, args.get("method_module"))
        # the bench batch has no padding: HF drops the all-ones mask
        opts = {"padded": False, **method.estimate_options(cfg.section(cfg.method)), "optimizer": cfg.optimizer,
                "optimizer_in_backward": cfg.optimizer_in_backward, "offload": cfg.optimizer_offload,
                "loss": "hf" if args.get("peer") else "chunked"}  # a peer trains through HF's own loss
        est = estimate(hf_config(cfg.model, **cfg.model_config), method, args["batch"], args["seq"],
                       args["dtype"], world_size=args.get("nproc", 1), distributed=args.get("distributed", "none"),
                       **opts)
    except Exception as e:  # an estimate that cannot be made is reported, never fatal
        return {"est_error": f"{type(e).__name__}: {e}"}
    return {"est_static_bytes": est["weights"] + est["grads"] + est["optimizer_states"],
            "est_activation_bytes": est["activations_forward"] - est["routing_records"],
            "est_routing_record_bytes": est["routing_records"], "est_total_bytes": est["total"],
            "est_trainable_params": est["trainable_params"]}


# glibc's malloc raises its mmap threshold to the size of each large block freed, after which blocks
# of that size stay resident once freed: with FSDP's per-unit gather and reduce-scatter buffers a
# rank's RSS then grows step after step past what its tensors hold (docs/bench_fsdp's full: 381 MiB
# peak per rank, 60 MiB of tensors held between steps; 211 MiB with the fixed threshold), and in one
# process the retention roughly doubles every figure (issue 24: 1254 against 698 MiB for the peer).
# A fixed threshold returns every block over 128 KiB on free, so peak RSS follows the tensors: every
# CPU worker, revffn's and the peers', runs with it.
ALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
MAX_OVER_RANKS = ("peak_mem_bytes", "peak_reserved_bytes", "activation_bytes", "routing_record_bytes", "param_bytes",
                  "grad_bytes", "optimizer_state_bytes", "optimizer_state_bytes_total", "load_peak_rss_bytes", "load_s",
                  "rendezvous_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(args: dict) -> list[str]:
    """`python -m WORKER_MODULE ARGS_JSON`; with `nproc` > 1 under torchrun, one rank per process,
    meeting on a free local port."""
    n = args.get("nproc", 1)
    launch = ["-m", "torch.distributed.run", f"--nproc-per-node={n}", "--master-addr=127.0.0.1",
              f"--master-port={_free_port()}"] if n > 1 else []
    return [sys.executable, *launch, "-m", args.get("worker", WORKER_MODULE), json.dumps(args)]


def run_worker(args: dict, timeout: float | None = None) -> dict:
    """One method in fresh processes (one, or torchrun's `nproc` ranks); a crash, a timeout or garbage
    output is an `error` row."""
    env = {**os.environ, **args.get("env", {}), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(worker_command(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return {"method": args["method"], "status": "error", "error": f"timed out after {timeout:g} s",
                "process_s": time.perf_counter() - t0}
    rows = {}  # rank -> its row (the last JSON line it printed)
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[row.get("rank", 0)] = row
    n, elapsed = args.get("nproc", 1), time.perf_counter() - t0
    if n > 1:
        ranks = [rows.get(r) or {"rank": r, "status": "error", "error": _no_result(proc, stderr)} for r in range(n)]
        return {**combine_ranks(args["method"], ranks), "process_s": elapsed}
    if 0 in rows:
        return {**rows[0], "process_s": elapsed}
    return {"method": args["method"], "status": "error", "error": _no_result(proc, stderr), "process_s": elapsed}


REPEAT_FIELDS = ("load_s", "rendezvous_s", "load_peak_rss_bytes", "tokens_per_s", "peak_mem_bytes", "process_s")


def repeated(runs: list[dict], method: str) -> dict:
    """One row of `runs`, the rows of one measurement repeated (`--repeat`, fresh processes each): each numeric figure
    the median of the runs' (of each rank's, rank by rank, the row's then combined as `combine_ranks` does); a failed
    run is the row. `repeats`: each run's `REPEAT_FIELDS` (of each rank under `ranks`), for the spread."""
    bad = next((r for r in runs if r.get("status") != "ok"), None)
    if len(runs) == 1 or bad is not None:
        return bad or runs[0]
    if runs[0].get("ranks"):
        ranks = [_medians([r["ranks"][i] for r in runs]) for i in range(len(runs[0]["ranks"]))]
        row = {**combine_ranks(method, ranks), "process_s": statistics.median(r["process_s"] for r in runs)}
    else:
        row = _medians(runs)

    def kept(r: dict) -> dict:
        return {k: r[k] for k in REPEAT_FIELDS if k in r} | ({"ranks": [kept(x) for x in r["ranks"]]}
                                                             if r.get("ranks") else {})

    return {**row, "repeats": [kept(r) for r in runs]}


def _medians(rows: list[dict]) -> dict:
    """The first row, each number in it replaced by the median of the rows' (where every row has one)."""
    def number(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    return {k: statistics.median(r[k] for r in rows) if number(v) and all(number(r.get(k)) for r in rows) else v
            for k, v in rows[0].items()}


def _stop(proc: subprocess.Popen) -> None:
    """End a worker that ran past its time: SIGTERM first, which torchrun passes on to its ranks."""
    proc.terminate()
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def _no_result(proc: subprocess.Popen, stderr: str) -> str:
    why = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
    if proc.returncode == -9:
        why += " (SIGKILL: out of host memory?)"
    tail = " | ".join(stderr.strip().splitlines()[-3:])
    return f"worker {why}, no result" + (f": {tail[-400:]}" if tail else "")


def combine_ranks(method: str, ranks: list[dict]) -> dict:
    """The row of one torchrun measurement: each rank's row under `ranks`; ok when every rank is (else
    the first failure, naming its rank); memory the max over ranks (`MAX_OVER_RANKS`); tokens/s the
    sum (each rank steps a batch of its own); the rest rank 0's."""
    bad = next((r for r in ranks if r.get("status") != "ok"), None)
    if bad is not None:
        return {"method": method, "status": bad.get("status", "error"),
                "error": f"rank {bad['rank']}: {bad.get('error', '')}", "ranks": ranks}
    row = {k: v for k, v in ranks[0].items() if k != "rank"}
    row.update({k: max(r[k] for r in ranks) for k in MAX_OVER_RANKS if all(r.get(k) is not None for r in ranks)})
    row["tokens_per_s"] = sum(r["tokens_per_s"] for r in ranks) if all(r.get("tokens_per_s") for r in ranks) else None
    return {**row, "ranks": ranks}


def _row_note(label: str, row: dict) -> str:
    if row["status"] == "ok":
        what = f"ok {row['peak_mem_bytes'] / 2**20:.1f} MiB {row['tokens_per_s']:.0f} tok/s"
        if row.get("static_vs_one_process"):
            what += f", static per rank {row['static_vs_one_process']:.2f}x one process's"
    else:
        what = f"{row['status']}: {row.get('error', '')[:120]}"
    return f"{label} ... {what} ({row.get('process_s', 0):.1f} s)"


def measure(spec: BenchSpec, method: str, runner: Runner | None = None, env: dict | None = None) -> dict:
    """One result row: the worker's measurement (`runner`, default `run_worker`; `env`: extra
    environment of its processes; `spec.repeat` times, `repeated`), its static bytes, and the estimate. With
    `spec.nproc` > 1, each rank's static bytes and the same method in one process (`one_process`, measured first,
    and with --repeat in turn with the ranks: a drift in the machine's speed meets both alike), to which each
    rank's static bytes, peak and start-up are compared; on CPU both under `ALLOC_ENV`."""
    env = env or (ALLOC_ENV if spec.device == "cpu" or spec.nproc > 1 else None)
    specs = [replace(spec, nproc=1, distributed="none"), spec] if spec.nproc > 1 else [spec]
    args = [{**worker_args(s, method), **({"env": env} if env else {})} for s in specs]
    runs: list[list[dict]] = [[] for _ in specs]
    for _ in range(spec.repeat):
        for a, done in zip(args, runs, strict=True):
            done.append((runner or run_worker)(a, spec.timeout))
    rows = [_row({**repeated(done, method), "method": method}, a) for a, done in zip(args, runs, strict=True)]
    row = rows[-1]  # (the label: variants stay apart)
    if len(rows) == 1:
        return row
    one = row["one_process"] = rows[0]
    if row.get("status") == "ok" and one.get("status") == "ok":
        for r in [row, *row["ranks"]]:
            r["static_vs_one_process"] = r["static_bytes"] / one["static_bytes"]
            r["peak_vs_one_process"] = r["peak_mem_bytes"] / one["peak_mem_bytes"]
            if r.get("load_peak_rss_bytes") and one.get("load_peak_rss_bytes"):
                r["load_rss_vs_one_process"] = r["load_peak_rss_bytes"] / one["load_peak_rss_bytes"]
                r["load_s_vs_one_process"] = r["load_s"] / one["load_s"]
    return row


def _row(row: dict, args: dict) -> dict:
    """A measurement's row with what each process holds from step to step (`static_bytes`; the row's, the max over
    its ranks) and the estimate of the same configuration."""
    if row.get("status") == "ok":
        ranks = row.get("ranks") or [row]
        for r in ranks:
            r["static_bytes"] = r["param_bytes"] + r["grad_bytes"] + r["optimizer_state_bytes"]
        row["static_bytes"] = max(r["static_bytes"] for r in ranks)
    return {**row, **estimate_fields(args)}


def _git(*cmd: str) -> str | None:
    try:
        out = subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def run_info(spec: BenchSpec, argv: list[str] | None, **extra) -> dict:
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"command": " ".join(["revffn", *map(_quote, argv)]) if argv is not None else None,
            "args": asdict(spec), **extra, "git_commit": commit, "git_dirty": bool(dirty) if commit else None,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "loadavg_start": _loadavg()}


def _loadavg() -> list[float] | None:
    """1/5/15-minute load averages: other work on the machine distorts tokens/s."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _quote(a: str) -> str:
    import shlex

    return shlex.quote(a)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def meta_info(spec: BenchSpec, rows: list[dict]) -> dict:
    """Versions and hardware. GPU name and thread count come from the workers: the parent never
    initialises CUDA (its context would take GPU memory from the measured processes)."""
    import peft
    import torch
    import transformers

    ok = [r for r in rows if r.get("status") == "ok"]
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "platform": platform.platform(), "cpu": _cpu_name(), "cpu_count": os.cpu_count(),
            "torch_threads": next((r["threads"] for r in ok if r.get("threads")), spec.threads),
            "gpu": next((r["gpu"] for r in ok if r.get("gpu")), None),
            "cuda": torch.version.cuda if spec.device == "cuda" else None, "loadavg_end": _loadavg()}


def run_bench(spec: BenchSpec, argv: list[str] | None = None, runner: Runner | None = None) -> dict:
    """Every method of `spec`, one fresh process each (`runner`: how one is measured, default
    `run_worker`); the bench.json document."""
    info = run_info(spec, argv, **({"worker_env": ALLOC_ENV} if spec.device == "cpu" or spec.nproc > 1 else {}))
    rows, labels = [], [*spec.methods, *peer_labels(spec.peers)]
    with progress("bench", "run", len(labels), every=0, bar=False) as bar:
        for i, m in enumerate(labels, 1):
            rows.append(measure(spec, m, runner))
            bar(i, len(labels), _row_note(m, rows[-1]))
    return {"run_info": info, "meta_info": meta_info(spec, rows), "results": rows}


def parse_sweep(text: str) -> tuple[str, list[int]]:
    """'layers=4,8,16' -> ('layers', [4, 8, 16]); UserError otherwise."""
    var, _, vals = text.partition("=")
    if var not in SWEEP_VARS:
        raise UserError(f"--sweep {text!r}: unknown variable {var!r}.{closest(var, SWEEP_VARS)} Fix: one of "
                        f"{', '.join(SWEEP_VARS)} (e.g. --sweep layers=4,8,16,32).")
    try:
        values = [int(v) for v in vals.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise UserError(f"--sweep {text!r}: the values must be positive integers. Fix: e.g. --sweep {var}=4,8,16.")
    return var, values


def run_sweep(spec: BenchSpec, var: str, values: list[int], argv: list[str] | None = None,
              runner: Runner | None = None) -> dict:
    """Every method at every value of `var` (fresh process each); the sweep.json document."""
    info = run_info(spec, argv, sweep={"variable": var, "values": values},
                    **({"worker_env": ALLOC_ENV} if spec.device == "cpu" else {}))
    labels = [*spec.methods, *peer_labels(spec.peers)]
    rows, n = [], len(values) * len(labels)
    with progress("bench", "run", n, every=0, bar=False) as bar:
        for v in values:
            point = BenchSpec(**{**asdict(spec), SWEEP_VARS[var]: v})
            for m in labels:
                rows.append({"value": v, **measure(point, m, runner)})
                bar(len(rows), n, _row_note(f"{var}={v} {m}", rows[-1]))
    return {"run_info": info, "meta_info": meta_info(spec, rows), "sweep": {"variable": var, "values": values},
            "results": rows}


def train_config(args: dict):
    """The validated `TrainConfig` of one bench measurement: the built-in quickstart plus model,
    method, dtype, device, seed and data-parallel strategy, `model_config` replaced by the bench's
    overrides, then the user's `--set key=value` items (dotted keys reach method sections). Raises
    UserError."""
    from revffn.training.config import load_config, parse_overrides

    overrides = [f"model={args['model']}", f"method={args['method']}", "max_steps=100000",
                 f"dtype={args.get('dtype', 'auto')}", f"device={args.get('device', 'auto')}",
                 f"seed={args.get('seed', 0)}", f"distributed={args.get('distributed', 'none')}",
                 *args.get("set", [])]
    cfg = load_config(None, overrides)
    user = parse_overrides(list(args.get("set", []))).get("model_config", {})
    return cfg.replace(model_config={**args.get("model_config", {}), **(user if isinstance(user, dict) else {})})

"""Where a training step's time goes, variant by variant: the GPU question of stop 58, when the buffered coupling ran
at 0.39-0.51x ckpt's tokens/s on an H100 (0.925x on one CPU thread).

    python scripts/gpu_profile.py --out $OUT/profile          # CUDA, bf16, the bench's hidden-1024 profile (3-5 min)
    python scripts/gpu_profile.py --out /tmp/p --device cpu --dtype float32 --hidden 64 --layers 2 --batch 2 --seq 32

Each variant runs in a fresh process, as `revffn bench` runs a method, through the bench worker's own build and
steps (`revffn.reports.workers.bench.run`) twice: once plain, for its row (tokens/s, peak memory), and once with
torch.profiler on over its timed steps, for its ops table (the top ops by self device time; by self CPU time on a
CPU) and its time by category (`CATEGORIES`: attention, matmul, MoE dispatch, the fixed-point int ops, casts and
copies, the optimizer, the loss, other). The variants:

    ckpt                 gradient checkpointing, the baseline
    revffn               the buffered default
    ckpt+det             ckpt under the buffered coupling's deterministic kernels (`deterministic_kernels`), which
                         it sets process-wide: what determinism alone costs a model of this shape
    revffn-nondet        the buffered default with `deterministic_kernels` a no-op: whether this model's kernels
                         recompute bitwise without it (else the row's error is the `RebuildError`), and how fast
    revffn-unchunked     the buffered default without the chunked recompute (`revffn.recompute_chunk_tokens=0`)
    revffn-additive      the additive coupling (`revffn.coupling=additive`), which needs no determinism

Writes profile.json (rows and categories), profile.md (side by side) and ops_<variant>.txt to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

VARIANTS = {  # name: (method, its --set items, deterministic kernels: as the method sets them, "on", or "off")
    "ckpt": ("ckpt", [], None),
    "revffn": ("revffn", [], None),
    "ckpt+det": ("ckpt", [], "on"),
    "revffn-nondet": ("revffn", [], "off"),
    "revffn-unchunked": ("revffn", ["revffn.recompute_chunk_tokens=0"], None),
    "revffn-additive": ("revffn", ["revffn.coupling=additive"], None),
}
# an op's category, by the first pattern its name matches: host-side (aten) ops, each with the device time of the
# kernels it launched (the kernels' own rows are listed apart, `kernels`, not counted twice)
CATEGORIES = [
    ("loss", r"log_softmax|nll_loss|cross_entropy"),
    ("attention", r"attention|sdpa|flash|efficient_attention|_cudnn_attention|softmax"),
    ("matmul", r"aten::(mm|addmm|bmm|baddbmm|matmul|linear|_grouped_mm)$"),
    ("moe dispatch", r"aten::(sort|argsort|topk|index|index_add_|index_put_|_index_put_impl_|index_select|scatter"
                     r"|scatter_add_|gather|histc|bincount|nonzero|one_hot|where|cumsum|masked_select)"),
    ("fixed-point int ops", r"aten::(bitwise_|__rshift__|__lshift__|round|aminmax|any$)"),
    ("casts and copies", r"aten::(copy_|to$|_to_copy|contiguous|clone|cat$|empty_like|zeros_like|fill_|zero_)"),
    ("optimizer", r"Optimizer|_foreach_|addcdiv_|addcmul_|lerp_"),
]


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def worker_args(ns, variant: str) -> dict:
    from revffn.reports.bench import BenchSpec
    from revffn.reports.bench import worker_args as bench_args

    method, sets, _ = VARIANTS[variant]
    spec = BenchSpec(model=ns.model, methods=[method], layers=ns.layers, hidden=ns.hidden, batch=ns.batch,
                     seq=ns.seq, steps=ns.steps, dtype=ns.dtype, device=ns.device, threads=ns.threads, set=sets)
    return bench_args(spec, method)


def unprofiled(row: dict, profiled_status: str | None = None) -> dict:
    """A variant's result where nothing was profiled (its run, or its profiled run, failed before the timed steps)."""
    return {"row": row, "profiled_status": profiled_status, "ops": [], "kernels": [], "kernel_us": 0.0,
            "categories": {}, "table": ""}


def profile_one(args: dict, deterministic: str | None, top: int) -> dict:
    """In this process: the plain row, then the profiled one's ops (self time per op, and per category)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    import revffn.methods.revffn as revffn_method
    import revffn.reports.workers.bench as worker
    from revffn.reports.workers.bench import run
    from revffn.reversible.buffered import deterministic_kernels

    cuda = args["device"] == "cuda"
    if deterministic == "on":
        deterministic_kernels(torch.device(args["device"]))
    elif deterministic == "off":  # what the method would call as it prepares the model
        revffn_method.deterministic_kernels = lambda device: None
    row = run(args)
    if row.get("status") != "ok":  # (its error says why; a profile of the same failure would only repeat it)
        return unprofiled(row)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    step, calls, state = worker.train_step, [], {"on": False}

    def profiled_step(*a, **k):  # the timed steps only: not the build (an additive run's calibration) nor the warm-up
        calls.append(None)
        if len(calls) == 2:
            prof.start()
            state["on"] = True
        result = step(*a, **k)
        if len(calls) == int(args["steps"]) + 1 and state["on"]:
            if cuda:
                torch.cuda.synchronize()
            prof.stop()
            state["on"] = False
        return result

    worker.train_step = profiled_step
    try:
        profiled = run(args)
    finally:
        worker.train_step = step
        if state["on"]:  # a step raised (the row says so): what ran until then is still profiled
            prof.stop()
    if len(calls) < 2:  # the build or the warm-up step failed: nothing was profiled
        return unprofiled(row, profiled.get("status"))
    events = prof.key_averages()

    # the device clock's name: `self_device_time_total` since torch 2.4 (`self_cuda_time_total` is its deprecated alias)
    key = ("self_device_time_total" if not events or hasattr(events[0], "self_device_time_total")
           else "self_cuda_time_total") if cuda else "self_cpu_time_total"

    def self_us(e) -> float:
        return float(getattr(e, key))

    def rows(host: bool) -> list[dict]:  # the ops (host side), or the device's kernels, by self time
        chosen = [e for e in events if (e.device_type == DeviceType.CPU) == host]
        return sorted(({"op": e.key, "self_us": self_us(e), "calls": e.count} for e in chosen),
                      key=lambda o: -o["self_us"])

    ops, kernels = rows(True), rows(False)
    totals: dict[str, float] = {}
    for o in ops:
        totals[category(o["op"])] = totals.get(category(o["op"]), 0.0) + o["self_us"]
    table = events.table(sort_by=key, row_limit=top)
    return {"row": row, "profiled_status": profiled.get("status"), "ops": ops[:top], "kernels": kernels[:top],
            "kernel_us": sum(k["self_us"] for k in kernels), "categories": totals, "table": table}


def render(result: dict) -> str:
    """profile.md: each variant's tokens/s (÷ ckpt's) and its profiled time by category."""
    rows = result["variants"]
    base = (rows.get("ckpt", {}).get("row") or {}).get("tokens_per_s")
    cats = [c for c, _ in CATEGORIES] + ["other"]
    lines = [f"# Step profile: {result['model']}, hidden {result['hidden']}, {result['layers']} layers, "
             f"{result['batch']} x {result['seq']} tokens, {result['dtype']}, {result['device']}", "",
             "`python scripts/gpu_profile.py " + " ".join(result["argv"]) + "`", "",
             "Tokens/s from the plain run; milliseconds of self " + ("device" if result["device"] == "cuda" else "cpu")
             + f" time per category over the profiled run's {result['steps']} timed steps (host-side ops, each with"
             " the device time of the kernels it launched; `kernels`: the device's kernels in all).", "",
             "| variant | status | tokens/s | ÷ ckpt | " + " | ".join(cats) + " | kernels |",
             "|---|---|---:|---:|" + "---:|" * (len(cats) + 1)]
    for name, r in rows.items():
        tps = r["row"].get("tokens_per_s")
        ratio = f"{tps / base:.2f}" if tps and base else "-"
        ms = [f"{r['categories'].get(c, 0.0) / 1000:.1f}" for c in cats]
        lines.append(f"| {name} | {r['row'].get('status')} | {tps:,.0f} | {ratio} | " if tps else
                     f"| {name} | {r['row'].get('status')} | - | - | ")
        kernels = f"{r['kernel_us'] / 1000:.1f}" if r.get("kernel_us") else "-"
        lines[-1] += " | ".join(ms) + f" | {kernels} |"
    for name, r in rows.items():
        if r["row"].get("status") != "ok":
            lines += ["", f"{name}: {r['row'].get('error', '')[:300]}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="tiny-qwen2-moe")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3, help="timed (and profiled) steps, after one warm-up step; >= 1")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--timeout", type=float, default=240, help="seconds per variant")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: profile one variant in this process
    ns = p.parse_args(argv)
    if ns.one:
        spec = json.loads(ns.one)
        print(json.dumps(profile_one(spec["args"], spec["deterministic"], ns.top)))
        return 0
    variants = [v.strip() for v in ns.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"gpu_profile: --variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if ns.steps < 1:
        print(f"gpu_profile: --steps: {ns.steps} timed steps profile nothing; give 1 or more", file=sys.stderr)
        return 2
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"model": ns.model, "hidden": ns.hidden, "layers": ns.layers, "batch": ns.batch, "seq": ns.seq,
              "steps": ns.steps, "dtype": ns.dtype, "device": ns.device, "argv": argv, "variants": {}}
    for v in variants:
        one = json.dumps({"args": worker_args(ns, v), "deterministic": VARIANTS[v][2]})
        try:
            done = subprocess.run([sys.executable, __file__, "--out", str(out), "--top", str(ns.top), "--one", one],
                                  capture_output=True, text=True, timeout=ns.timeout)
            got = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else None
            error = None if got else f"exit {done.returncode}: {done.stderr.strip()[-500:]}"
        except subprocess.TimeoutExpired:
            got, error = None, f"over {ns.timeout:.0f} s"
        if got is None:
            got = unprofiled({"status": "error", "error": error})
        (out / f"ops_{v.replace('+', '_')}.txt").write_text(got.pop("table"))
        result["variants"][v] = got
        tps = got["row"].get("tokens_per_s")
        print(f"gpu_profile: {v}: {got['row'].get('status')}" + (f", {tps:,.0f} tokens/s" if tps else ""), flush=True)
        (out / "profile.json").write_text(json.dumps(result, indent=1) + "\n")  # after each variant: a run stopped
        (out / "profile.md").write_text(render(result))                           # at its limit keeps the done ones
    print((out / "profile.md").read_text())
    return 0 if all(r["row"].get("status") == "ok" for r in result["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Write docs/benchmarks.md from docs/bench/bench.json, docs/bench/sweep.json, docs/bench_peer/sweep.json,
docs/bench_in_backward/sweep.json, docs/bench_chunks/sweep.json, docs/bench_fold/sweep.json and
docs/memory_timeline.json.

    python scripts/benchmarks_page.py --run                              # run every bench, then write the page
    python scripts/benchmarks_page.py [BENCH_DIR] [PAGE] [PEER_SWEEP_DIR]  # write the page from the JSON there

The page opens with the commands that regenerate it (what `--run` runs, one after the other), checks the
issue's targets against the measured numbers, and embeds the rendered tables and plots (`revffn.reports.render.bench`).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from revffn.methods.revffn import RECOMPUTE_CHUNK_TOKENS
from revffn.reports.render.bench import bench_markdown, render_dir, sweep_markdown

ROOT = Path(__file__).resolve().parent.parent
ADDITIVE = "revffn:revffn.coupling=additive"  # `revffn` is the buffered default; beside it the additive coupling
PROFILE = (f"--model tiny-qwen2-moe --methods full,ckpt,revffn,{ADDITIVE},lora,dora,hift,refta --hidden 256 --batch 4 "
           "--seq 512")
PEER = "hf-trainer+ckpt"  # what users would run instead: transformers' Trainer with gradient checkpointing
INB = ":optimizer_in_backward=true"
IN_BACKWARD = ["ckpt", "revffn", f"ckpt{INB}", f"revffn{INB}"]  # the in-backward sweep's methods
CHUNKS = [f"revffn:revffn.recompute_chunk_tokens={n}" for n in (4096, 2048)] + [  # the chunk sweep's methods
    "revffn", "revffn:revffn.recompute_chunk_tokens=512"]  # (the default is plain `revffn`)
FOLD = ["ckpt", "revffn", "revffn:revffn.fold_adapters=false"]  # the fold sweep's, on the additive coupling (it folds
# by default; the buffered coupling has no adapters to fold)
COMMANDS = [f"revffn bench {PROFILE} --layers 16 --steps 3 --peers hf-trainer --threads 1 --out docs/bench",
            f"revffn bench {PROFILE} --steps 1 --sweep layers=4,8,16,32 --threads 1 --out docs/bench",
            f"revffn bench --model tiny-qwen2-moe --methods ckpt,revffn,{ADDITIVE} --hidden 256 --batch 4 --layers 16 "
            f"--steps 2 --sweep seq=512,1024,2048,4096 --peers {PEER} --threads 1 --out docs/bench_peer",
            f"revffn bench --model tiny-qwen2-moe --methods {','.join(IN_BACKWARD)} --hidden 256 --batch 4 --layers 16 "
            f"--steps 2 --sweep seq=512,2048 --peers {PEER} --threads 1 --out docs/bench_in_backward",
            f"revffn bench --model tiny-qwen2-moe --methods {','.join(CHUNKS)} --hidden 256 --batch 4 "
            f"--layers 16 --steps 3 --sweep seq=512,2048 --peers {PEER} --threads 1 --out docs/bench_chunks",
            f"revffn bench --model tiny-qwen2-moe --methods {','.join(FOLD)} --set revffn.coupling=additive "
            "--set revffn.adapter_init=coordinate --hidden 256 --batch 4 --layers 16 --steps 3 --sweep seq=512,2048 "
            f"--peers {PEER} --threads 1 --out docs/bench_fold",
            "python scripts/memory_timeline.py --out docs/memory_timeline.json",
            "python scripts/benchmarks_page.py"]


def _chunk(method: str) -> tuple[str, str]:
    """A chunk sweep's method -> (its chunk size, ' (default)' or ''): plain `revffn` runs the method's default."""
    return (method.rpartition("=")[2], "") if "=" in method else (str(RECOMPUTE_CHUNK_TOKENS), " (default)")


def _ok(data: dict) -> dict[str, dict]:
    return {r["method"]: r for r in data["results"] if r.get("status") == "ok"}


def targets(bench: dict, sweep: dict | None, peer_sweep: dict | None = None, in_backward: dict | None = None,
            chunks: dict | None = None) -> list[tuple[str, str, float | None, bool | None]]:
    """(what, goal, reached, met) for each target of the issues (23: against full and ckpt; 24: against the peer)."""
    rows = _ok(bench)

    def ratio(key, a, b):
        return rows[a][key] / rows[b][key] if a in rows and b in rows else None

    out = []
    for m in ("revffn", ADDITIVE):  # the buffered default, then the additive coupling
        out += [(f"peak memory, {m} ÷ full", "≤ 0.50", ratio("peak_mem_bytes", m, "full"), lambda x: x <= 0.5),
                (f"peak memory, {m} ÷ ckpt", "≤ 1.00", ratio("peak_mem_bytes", m, "ckpt"), lambda x: x <= 1.0),
                (f"tokens/s, {m} ÷ full", "≥ 0.75", ratio("tokens_per_s", m, "full"), lambda x: x >= 0.75),
                (f"tokens/s, {m} ÷ ckpt", "≥ 0.90", ratio("tokens_per_s", m, "ckpt"), lambda x: x >= 0.9)]
    # flat in depth: the additive coupling's goal; the buffered one keeps k bits a coordinate a layer (no goal)
    for m, goal, test in ((ADDITIVE, "≤ 1.05", lambda x: x <= 1.05), ("revffn", "none: k/8 B a coordinate a layer",
                                                                       None)):
        flat = None
        if sweep:
            values = sweep["sweep"]["values"]
            acts = {r["value"]: r["activation_bytes"] for r in sweep["results"]
                    if r["method"] == m and r.get("status") == "ok"}
            if values[0] in acts and values[-1] in acts:
                flat = acts[values[-1]] / acts[values[0]]
            what = f"sweep: {m} saved-for-backward bytes, {values[-1]} ÷ {values[0]} layers"
        else:
            what = f"sweep: {m} saved-for-backward bytes, deepest ÷ shallowest"
        out.append((what, goal, flat, test))
    out += [(f"peak memory, ckpt ÷ {PEER}", "≤ 1.05", ratio("peak_mem_bytes", "ckpt", PEER), lambda x: x <= 1.05)]
    out += [(f"peak memory, {m} ÷ {PEER}", "≤ 1.00", ratio("peak_mem_bytes", m, PEER), lambda x: x <= 1.0)
            for m in ("revffn", ADDITIVE)]
    for value in [v for v in (peer_sweep or {}).get("sweep", {}).get("values", []) if v >= 2048]:
        at = {r["method"]: r for r in peer_sweep["results"] if r["value"] == value and r.get("status") == "ok"}
        for m in ("revffn", ADDITIVE):
            for key, goal, test in (("peak_mem_bytes", "≤ 0.80", lambda x: x <= 0.8),
                                    ("tokens_per_s", "≥ 0.85", lambda x: x >= 0.85)):
                value_ratio = at[m][key] / at[PEER][key] if m in at and PEER in at else None
                what = "peak memory" if key == "peak_mem_bytes" else "tokens/s"
                out.append((f"seq {value}: {what}, {m} ÷ {PEER}", goal, value_ratio, test))
    for value in (in_backward or {}).get("sweep", {}).get("values", []):
        at = {r["method"]: r for r in in_backward["results"] if r["value"] == value and r.get("status") == "ok"}
        pairs = [("peak_mem_bytes", "≤ 1.00" if value < 2048 else "≤ 0.80", 1.0 if value < 2048 else 0.8)]
        pairs += [("tokens_per_s", "≥ 0.85", None)] if value >= 2048 else []
        for key, goal, bound in pairs:
            r = at[f"revffn{INB}"][key] / at[PEER][key] if f"revffn{INB}" in at and PEER in at else None
            what = "peak memory" if key == "peak_mem_bytes" else "tokens/s"
            test = (lambda x, b=bound: x <= b) if bound is not None else (lambda x: x >= 0.85)
            out.append((f"seq {value}: {what}, revffn + optimizer_in_backward ÷ {PEER}", goal, r, test))
    for value in (chunks or {}).get("sweep", {}).get("values", []):  # the crossover by recompute chunk size
        at = {r["method"]: r for r in chunks["results"] if r["value"] == value and r.get("status") == "ok"}
        goals = [("peak_mem_bytes", "≤ 1.00", lambda x: x <= 1.0)] if value < 2048 else [
            ("peak_mem_bytes", "≤ 0.80", lambda x: x <= 0.8), ("tokens_per_s", "≥ 0.85", lambda x: x >= 0.85)]
        for method in CHUNKS:
            for key, goal, test in goals:
                r = at[method][key] / at[PEER][key] if method in at and PEER in at else None
                what = "peak memory" if key == "peak_mem_bytes" else "tokens/s"
                n, default = _chunk(method)
                out.append((f"seq {value}: {what}, revffn, {n}-token chunks{default} ÷ {PEER}", goal, r, test))
    return [(w, g, v, None if v is None or test is None else bool(test(v))) for w, g, v, test in out]


def fold_section(fold: dict) -> list[str]:
    """The P_down adapters folded into the layers at stage 2 (`revffn.fold_adapters`, the default) against not."""
    lines = [f"## P_down folded into the layers (`revffn.fold_adapters`), against {PEER}", "",
             "The additive coupling's (`--set revffn.coupling=additive`: the buffered default has no adapters), "
             "from the coordinate init.", "",
             _body(sweep_markdown(fold)), "", "![sweep: RevFFN folded and unfolded](bench_fold/sweep.png)", ""]
    at = {(r["method"], r["value"]): r for r in fold["results"] if r.get("status") == "ok"}
    unfolded = "revffn:revffn.fold_adapters=false"
    for value in fold["sweep"]["values"]:
        if all((m, value) in at for m in ("revffn", unfolded, PEER)):
            a, b, p = at[("revffn", value)], at[(unfolded, value)], at[(PEER, value)]
            lines.append(f"- seq {value}: folding took RevFFN from {b['peak_mem_bytes'] / 2**20:.1f} to "
                         f"{a['peak_mem_bytes'] / 2**20:.1f} MiB ({b['peak_mem_bytes'] / p['peak_mem_bytes']:.3f}x "
                         f"-> {a['peak_mem_bytes'] / p['peak_mem_bytes']:.3f}x the peer's) and from "
                         f"{b['tokens_per_s']:.0f} to {a['tokens_per_s']:.0f} tokens/s "
                         f"({b['tokens_per_s'] / p['tokens_per_s']:.3f}x -> "
                         f"{a['tokens_per_s'] / p['tokens_per_s']:.3f}x); trainable parameters "
                         f"{b['trainable_params'] / 1e6:.2f} M -> {a['trainable_params'] / 1e6:.2f} M.")
    lines += ["- Stage 2 multiplies each P_down into its branch's output projection and down projections "
              "(`revffn/conversion/fold.py`, docs/engine.md): the same function, 2·d² fewer parameters a layer and "
              "two fewer d × d matmuls per token in the forward, the recompute and the backward. The skips stay. "
              "With the adapters frozen in stage 2 (the default since stop 43) the trainable count is the same "
              "either way and folding saves P_down's weights; with `revffn.train_adapters=true` it also drops "
              "their gradients and AdamW moments.", ""]
    return lines


def in_backward_gains(in_backward: dict) -> str:
    """'(seq S: ckpt A -> B MiB, RevFFN C -> D; ...)': each method's peak without and with the in-backward step."""
    at = {(r["method"], r["value"]): r["peak_mem_bytes"] / 2**20 for r in in_backward["results"]
          if r.get("status") == "ok"}
    parts = [f"seq {v}: ckpt {at[('ckpt', v)]:.1f} -> {at[(f'ckpt{INB}', v)]:.1f} MiB, RevFFN "
             f"{at[('revffn', v)]:.1f} -> {at[(f'revffn{INB}', v)]:.1f}" for v in in_backward["sweep"]["values"]
             if all((m, v) in at for m in IN_BACKWARD)]
    return f" ({'; '.join(parts)})" if parts else ""


def chunk_section(chunks: dict) -> list[str]:
    """RevFFN by recompute chunk size (`revffn.recompute_chunk_tokens`) against the peer, seq by seq."""
    lines = [f"## The recompute's chunk size (`revffn.recompute_chunk_tokens`), against {PEER}", "",
             _body(sweep_markdown(chunks)), "", "![sweep: RevFFN by recompute chunk size](bench_chunks/sweep.png)", ""]
    at = {(r["method"], r["value"]): r for r in chunks["results"] if r.get("status") == "ok"}
    for value in chunks["sweep"]["values"]:
        peer = at.get((PEER, value))
        if not peer:
            continue
        parts = []
        for method in CHUNKS:
            if (method, value) in at:
                r = at[(method, value)]
                n, default = _chunk(method)
                parts.append(f"{n}{default.replace('(', '(the ')}: {r['peak_mem_bytes'] / 2**20:.1f} MiB and "
                             f"{r['tokens_per_s']:.0f} tokens/s "
                             f"({r['peak_mem_bytes'] / peer['peak_mem_bytes']:.3f}x, "
                             f"{r['tokens_per_s'] / peer['tokens_per_s']:.3f}x)")
        lines.append(f"- seq {value}, against the peer's {peer['peak_mem_bytes'] / 2**20:.1f} MiB and "
                     f"{peer['tokens_per_s']:.0f} tokens/s, by chunks of " + "; ".join(parts) + ".")
    lines += ["- The chunk bounds the backward's working set: each layer is recomputed and back-propagated by "
              "chunks of whole sequences of at most N tokens, and its forward runs the same chunks (the buffered "
              "coupling's recompute must be bitwise: a matmul over fewer rows may round otherwise). These rows "
              "run the buffered default.", ""]
    return lines


def _body(markdown: str) -> str:
    """A rendered report without its title line (the page gives its own headings)."""
    return "\n".join(markdown.splitlines()[2:]).strip()


def timeline_section(rows: list[dict]) -> list[str]:
    """Where the peak is: `scripts/memory_timeline.py`'s bytes alive at each step's peak, by torch's categories."""
    cats = ["parameter", "optimizer_state", "gradient", "activation", "temporary", "autograd_detail", "input",
            "uncategorized"]
    lines = ["## Where the peak is (torch.profiler's memory timeline)", "",
             "One step of the 16-layer profile at seq 512 (`scripts/memory_timeline.py`, one thread): the MiB "
             "alive at the step's peak by torch's categories, and where in the step it falls (0: the step's first "
             "allocation, 1: its last).", "",
             "| method | " + " | ".join(c.replace("_", " ") for c in cats) + " | peak MiB | at | trainable params |",
             "|---|" + "---:|" * (len(cats) + 3)]
    for r in rows:
        label = r["method"] + "".join(f" {x}" for x in r["set"] if not x.startswith("revffn.adapter_init"))
        lines.append(f"| {label} | " + " | ".join(f"{r['at_peak_mib'].get(c, 0):.1f}" for c in cats)
                     + f" | {r['peak_mib']:.1f} | {r['peak_at']:.2f} | {r['trainable_params'] / 1e6:.2f} M |")
    by = {(r["method"], any("optimizer_in_backward" in x for x in r["set"])): r for r in rows}
    if ("ckpt", False) in by and ("revffn", False) in by:
        c, v = by[("ckpt", False)], by[("revffn", False)]
        d = {k: v["at_peak_mib"].get(k, 0) - c["at_peak_mib"].get(k, 0) for k in ("parameter", "optimizer_state",
                                                                                 "gradient")}
        gap = v["peak_mib"] - c["peak_mib"]
        held = {k: (v["at_peak_mib"].get(k, 0), c["at_peak_mib"].get(k, 0)) for k in ("autograd_detail", "temporary")}
        lines += ["", f"- RevFFN (the buffered default) peaks {abs(gap):.1f} MiB "
                  f"{'above' if gap > 0 else 'below'} revffn's checkpointing. The model adds no parameter; the "
                  f"timeline files {d['parameter']:+.1f} MiB more under parameters (+2.0 at seq 256, `python "
                  "scripts/memory_timeline.py --method revffn|ckpt --seq 256`: a token-sized 8-byte tensor, the size "
                  "of one of its saved int64 streams), and RevFFN trains "
                  f"{v['trainable_params'] / 1e6:.2f} M (its routers "
                  f"frozen) against checkpointing's {c['trainable_params'] / 1e6:.2f} M (AdamW state "
                  f"{d['optimizer_state']:+.1f} MiB); the gradients at the peak differ by {d['gradient']:+.1f} MiB "
                  "by when the peak falls. At the peak checkpointing holds "
                  f"{held['autograd_detail'][1]:.1f} MiB of autograd's saved tensors and "
                  f"{held['temporary'][1]:.1f} of temporaries, RevFFN {held['autograd_detail'][0]:.1f} and "
                  f"{held['temporary'][0]:.1f} (its int64 streams, the bit buffer and one chunk's recompute). The "
                  f"peaks fall at {c['peak_at']:.2f} and {v['peak_at']:.2f} of the step."]
        if ("revffn", True) in by:
            b = by[("revffn", True)]
            lines.append(f"- With the optimizer stepped in backward each gradient is freed as soon as it is "
                         f"complete: RevFFN's peak falls to {b['peak_mib']:.1f} MiB (gradients "
                         f"{b['at_peak_mib'].get('gradient', 0):.1f} MiB at the peak instead of "
                         f"{v['at_peak_mib'].get('gradient', 0):.1f}).")
    return lines + [""]


def page(bench: dict, sweep: dict | None, peer_sweep: dict | None = None, in_backward: dict | None = None,
         timeline: list[dict] | None = None, fold: dict | None = None, chunks: dict | None = None) -> str:
    meta, info = bench["meta_info"], bench["run_info"]
    threads = meta.get("torch_threads")
    lines = ["# Benchmarks", "",
             "Regenerate this page with one command, `python scripts/benchmarks_page.py --run` (CPU, on an otherwise "
             "idle machine; about an hour on 2 cores: 61 min at stop 49), which runs these one after the other:",
             "", "```bash", *COMMANDS, "```", "",
             f"Measured on {meta.get('cpu')} ({meta.get('cpu_count')} cores), **{threads} torch threads** per method "
             f"process, torch {meta.get('torch')}, transformers {meta.get('transformers')}, peft {meta.get('peft')}; "
             f"commit {(info.get('git_commit') or 'unknown')[:12]}"
             + (" plus uncommitted changes" if info.get("git_dirty") else "") + f", {info.get('started', '')} "
             f"(load average {info.get('loadavg_start')} at the start, {meta.get('loadavg_end')} at the end).",
             "Each method runs in a fresh process (`revffn.reports.workers.bench`), built and stepped as `revffn "
             "train` does (revffn in stage 2, hift cycling its groups); one warm-up step, then the timed steps.",
             "", "## Targets", "", "| target | goal | reached | met |", "|---|---|---:|---|"]
    for what, goal, value, met in targets(bench, sweep, peer_sweep, in_backward, chunks):
        shown = "n/a" if value is None else f"{value:.3f}"
        lines.append(f"| {what} | {goal} | {shown} | {'n/a' if met is None else 'yes' if met else '**no**'} |")
    lines += ["", "## Bench: every method, 16 layers", "", _body(bench_markdown(bench)), "",
              "![bench: peak memory and tokens/s per method](bench/bench.png)", "",
              "Measured peak against the estimate's total (held tensors + 5%):", "",
              "| method | peak mem MiB | estimated total MiB | peak ÷ estimate |", "|---|---:|---:|---:|"]
    for r in bench["results"]:
        if r.get("status") == "ok" and r.get("est_total_bytes"):
            lines.append(f"| {r['method']} | {r['peak_mem_bytes'] / 2**20:.0f} | {r['est_total_bytes'] / 2**20:.0f} | "
                         f"{r['peak_mem_bytes'] / r['est_total_bytes']:.2f} |")
    lines.append("")
    if sweep:
        lines += ["## Sweep: depth 4 to 32 layers", "", _body(sweep_markdown(sweep)), "",
                  "![sweep: peak memory and saved-for-backward bytes vs depth](bench/sweep.png)", ""]
    if peer_sweep:
        lines += [f"## Against transformers' Trainer with gradient checkpointing ({PEER}): sequence length", "",
                  _body(sweep_markdown(peer_sweep)), "",
                  "![sweep: memory, saved bytes and tokens/s vs sequence length, with the peer](bench_peer/sweep.png)",
                  ""]
    if chunks:
        lines += chunk_section(chunks)
    if fold:
        lines += fold_section(fold)
    if timeline:
        lines += timeline_section(timeline)
    if in_backward:
        lines += [f"## The optimizer stepped in backward (`optimizer_in_backward: true`), against {PEER}", "",
                  _body(sweep_markdown(in_backward)), "",
                  "![sweep: with the optimizer stepped in backward](bench_in_backward/sweep.png)", "",
                  "- `optimizer_in_backward` steps each parameter from its gradient hook and frees the gradient "
                  "(`training/optim.py`, `InBackward`): it needs `gradient_accumulation_steps: 1` and one process "
                  "(no DDP or FSDP), and clips each gradient by its share of `max_grad_norm` instead of the global "
                  "norm, so it is an option, not RevFFN's default. transformers' Trainer has no such option.",
                  "- It helps RevFFN more than checkpointing at long rows: checkpointing's peak moves into the "
                  "backward's recompute, which keeps every layer's saved input, while RevFFN's stays where the "
                  "gradients pile up" + in_backward_gains(in_backward) + ".",
                  ""]
    lines += ["## Reading the numbers", "",
              "- Since stop 49 every `revffn` row is RevFFN's default, the buffered coupling (docs/conversion.md: "
              "each decoder layer whole on int64 fixed-point streams, 6 bits a coordinate a layer kept for the "
              f"backward, no adapters, no calibration); `{ADDITIVE}` is the adapters' coupling, flat in depth, which "
              "the pages before measured as `revffn` (and which the history below is about).",
              f"- *{PEER}* is transformers' own `Trainer` (`TrainingArguments(activation_checkpointing=True)`, "
              "non-reentrant) on the same model, batch, dtype and AdamW, in its own fresh process "
              "(`revffn.reports.workers.peer`); `hf-trainer` the same without checkpointing. Its loss is HF's, "
              "which keeps the whole batch's fp32 log-softmax for backward (the estimate's `--option loss=hf`); "
              "revffn's chunked cross-entropy keeps one chunk.",
              "- revffn's `ckpt` used to peak far above the peer's checkpointing (669 against 396 MiB at the "
              "16-layer profile, measured at commit 239cdf2's parent with `--methods ckpt --peers hf-trainer "
              "--steps 2 --threads 1`): `CausalLM`'s router taps were forward hooks that also fired in the "
              "checkpoint's recompute during backward and kept each recomputed layer's logits, and with them that "
              "layer's whole graph, until the next step (290 MiB of live tensors after backward). The taps now "
              "listen only during the forward (`RouterTap.listen`); ckpt peaks at the peer's memory.",
              "- The additive coupling recomputes each layer's MoE branch in backward by chunks of "
              "`revffn.recompute_chunk_tokens` tokens and its attention by chunks of whole sequences (section above;"
              " 1024 by default since stop 44, 4096 before, 0 before that: the whole batch). History: the first "
              "chunking took seq 2048 from 657 to 579 MiB at the same tokens/s; torch.profiler's timeline (`python "
              "scripts/memory_timeline.py --method revffn --seq S --set revffn.adapter_init=coordinate --set "
              "revffn.recompute_chunk_tokens=N`, one thread) put the peak of seq 512 at 415.5 MiB with N 4096, "
              "401.2 with 1024, 388.1 with 512 (the peak then falls in F: one 512-token sequence's working set) "
              "and of seq 2048 at 540.6, 488.4 (N 2048) and 474.4 (N 1024). Stop 42's and 43's benches, with the "
              "adapters trained in stage 2, then found 2048- and 1024-token chunks meeting both seq-2048 crossover "
              "goals (0.78x and 0.75x the peer's memory at 0.91x and 0.93x its tokens/s) and 4096 missing the "
              "memory goal (0.85x); the default stayed 4096 until the rows above, with the adapters frozen, showed "
              "1024 meeting the seq-512 goal too.",
              "- Not measured on a GPU: there a chunk of 1024 tokens gives each expert of a 60-expert top-4 MoE "
              "about 68 rows a matmul in the recompute, against about 273 with 4096; raise "
              "`revffn.recompute_chunk_tokens` where memory allows (`revffn estimate --option "
              "recompute_chunk_tokens=N` gives the working set).",
              "- Since stop 44 every revffn row on this page runs the method's defaults: the adapters frozen in "
              "stage 2 (`revffn.train_adapters=false`; docs/conversion.md: on SmolLM2 it forgets far less), P_down "
              "folded, 1024-token chunks. The pages before trained the adapters (stop 43 at this profile, one "
              "thread: RevFFN 435.9 MiB trained, 411.5 frozen, against the peer's checkpointing 392.3, with "
              "4096-token chunks; static 336.4 and 312.4 MiB against 304.8: the frozen adapters' weights remain, "
              "their gradients and AdamW moments go).",
              "- Stop 45: each block's backward rebuilds its inputs and their gradients in the buffers of its "
              "outputs and theirs (the top block's are the stack's saved outputs; docs/engine.md, \"Streams rebuilt in "
              "place\"): up to four fewer (B, T, 256) fp32 streams alive in backward, 2 MiB each at seq 512, 16 at "
              "4096. The same commands took RevFFN's peak from 394.9 to 389.1 MiB at seq 512 (1.007x the peer's "
              "to 0.993x), 413.5 to 399.4 at 1024, 460.0 to 420.1 at 2048 (0.729x to 0.666x) and 565.8 to 524.2 "
              "at 4096 (0.567x to 0.526x); the chunk sweep's default rows 385.6 to 379.4 and 450.5 to 410.6. With "
              "the optimizer stepped in backward the seq-2048 peak falls earlier in the step and stays 400.9.",
              "- The 16-layer bench's additive row calibrates (the default `adapter_init`); stop 45's chunk sweep "
              "did not (389.0 against 379.4 MiB at seq 512). Stop 44, side by side (`revffn bench --model "
              "tiny-qwen2-moe --methods "
              "revffn,revffn:revffn.adapter_init=coordinate --hidden 256 --batch 4 --seq 512 --layers 16 --steps 2 "
              "--threads 1`) the calibrated step peaks 9.3 MiB higher, 394.9 against 385.6 MiB, with the same "
              "tensors alive (329 storages, 92.2 MiB, after the build): the calibrated process keeps 21 MiB more "
              "resident after its set-up, 10.7 MiB of it library code paged in by the fp64 fits (`RssFile` in "
              "/proc/self/status) and 7.9 MiB anonymous, of which `gc.collect`, `malloc_trim(0)` and MKL's "
              "`mkl_serv_free_buffers` return 3.6 MiB; not found further.",
              "- *peak mem* on CPU is the worker's peak resident set minus its RSS right after the imports (since "
              "stop 41 the peak over the steps only: the kernel's high-water mark is reset once the model is built,"
              " `peak_since: built` in bench.json, as CUDA's peak is; before, a small model's figure could be its "
              "start-up's: `revffn bench --model builtin:base --methods revffn,revffn:revffn.distill_coef=1 --peers"
              " hf-trainer --batch 8 --seq 128 --steps 2 --threads 1` read 377.4 and 377.9 MiB, the calibration's "
              "peak, and now reads 162.8 and 190.2 MiB, the frozen teacher copy showing): it includes what glibc's "
              "allocator keeps after frees, library code paged in while running, and transient buffers, so it sits "
              "above the estimate's held-tensor total. Most of the gap is the allocator: with "
              "`MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=0` (large blocks returned on free; about 2x "
              "slower) the same 16-layer runs peaked at full 1008, ckpt 667, revffn 418 MiB (estimates 1088, 424, "
              "432). On CUDA the bench reports `torch.cuda.max_memory_allocated` (and reserved).",
              "- *saved for backward* is what autograd holds after one forward (parameters excluded, unique "
              "storages); revffn's routing records (one byte per token, choice and MoE layer) are listed apart. "
              "The `(est.)` values are `revffn estimate` for the same configuration.",
              "- Stops 44 and 45 ran the page's benches two at a time, one per core (each method process one "
              "thread): tokens/s read lower than on an idle machine (stop 44: RevFFN at seq 2048 in 1024-token "
              "chunks 183 tokens/s, 276 alone the same day; stop 45: 277), and a ratio compares rows of one sweep, "
              "run under the same load.",
              f"- tokens/s are medians over the timed steps on {threads} threads of a small shared VM: expect 10-20% "
              "of noise between runs (the first timed step after the warm-up is often slower for the "
              "methods that hold the most memory; the sweep times a single step, so its tokens/s are rougher "
              "still). Small models on CPU are dominated by per-op overhead.",
              "- GPU: `scripts/gpu_bench.sh` runs `revffn check` (bf16) and this bench for full, ckpt and revffn "
              "at the Qwen1.5-MoE-A2.7B geometry (random init, 8 of 24 layers, batch 4 x 1024, bf16) in about 5 "
              "minutes. Its one partial run so far (one H200, transformers 5.17.0, torch 2.11, 4 layers, full/ckpt/"
              "revffn; log and check.json in [gpu_bench/](gpu_bench/)): `revffn check` passed in bf16 at the real "
              "width "
              "(2 layers: reconstruction error 7.5e-8, max relative gradient error 3.7e-6 against the plain twin, "
              "saved-tensor bytes 1.07 MB against 24.8 MB); the 1-GPU `torchrun` smoke runs (NCCL) finished for ddp "
              "and fsdp; **the bench step failed at once** (`unknown model 'qwen1.5-moe-a2.7b'`: the calibration-text "
              "check refused config-only geometries, a regression of the real-text default, since fixed and tested "
              "by `test_sweep_over_layers_on_a_config_only_preset`, not rerun on a GPU), so no GPU bench numbers "
              "appear yet.",
              ""]
    return "\n".join(lines)


def run_all(run=subprocess.run) -> None:
    """Every bench command of the page, one after the other, from the repository root (`python` is this
    interpreter); the page itself is written after them."""
    for command in COMMANDS[:-1]:
        print(f"+ {command}", flush=True)
        args = shlex.split(command)
        run([sys.executable, *args[1:]] if args[0] == "python" else args, cwd=ROOT, check=True)


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if argv[:1] == ["--run"]:
        run_all()
        argv = argv[1:]
    bench_dir = Path(argv[0]) if argv else ROOT / "docs" / "bench"
    out = Path(argv[1]) if len(argv) > 1 else ROOT / "docs" / "benchmarks.md"
    bench = json.loads((bench_dir / "bench.json").read_text())
    sweep_path = bench_dir / "sweep.json"
    sweep = json.loads(sweep_path.read_text()) if sweep_path.is_file() else None
    peer_dir = Path(argv[2]) if len(argv) > 2 else ROOT / "docs" / "bench_peer"
    peer_sweep = json.loads((peer_dir / "sweep.json").read_text()) if (peer_dir / "sweep.json").is_file() else None
    inb_path = ROOT / "docs" / "bench_in_backward" / "sweep.json"
    in_backward = json.loads(inb_path.read_text()) if inb_path.is_file() else None
    tl_path = ROOT / "docs" / "memory_timeline.json"
    timeline = json.loads(tl_path.read_text()) if tl_path.is_file() else None
    fold_path = ROOT / "docs" / "bench_fold" / "sweep.json"
    fold = json.loads(fold_path.read_text()) if fold_path.is_file() else None
    render_dir(bench_dir)  # the .md and .png next to the JSON, from the JSON
    if fold:
        render_dir(fold_path.parent)
    if peer_sweep:
        render_dir(peer_dir)
    if in_backward:
        render_dir(inb_path.parent)
    chunks_path = ROOT / "docs" / "bench_chunks" / "sweep.json"
    chunks = json.loads(chunks_path.read_text()) if chunks_path.is_file() else None
    if chunks:
        render_dir(chunks_path.parent)
    out.write_text(page(bench, sweep, peer_sweep, in_backward, timeline, fold, chunks))
    print(f"wrote {out}")
    for what, goal, value, met in targets(bench, sweep, peer_sweep, in_backward, chunks):
        shown = "n/a" if value is None else f"{value:.3f}"
        print(f"  {what}: {shown} (goal {goal}) {'NOT MET' if met is False else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

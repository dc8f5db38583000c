"""Render bench.json / sweep.json into markdown tables and plots; from the JSON alone.

    python -m revffn.reports.render DIR        # or: revffn bench --render DIR

`write_bench` / `write_sweep` write the JSON and render it; `render_dir` regenerates the .md and
.png files of a directory from the JSON files it holds.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

MiB = 2**20


def _cpu_peak(rows: list[dict]) -> str:
    """What a CPU row's peak covers: the steps (the RSS high-water mark reset once the model was built, as CUDA's
    peak is), or the process from its start (rows measured before the reset, or a kernel that refused it)."""
    if rows and all(r.get("peak_since") == "built" for r in rows):
        return "peak RSS over the steps (reset once the model is built; the start-up's is `load_peak_rss_bytes`)"
    return "process peak RSS"


def _mib(n) -> str:
    if n is None:
        return ""
    return f"{n / MiB:.1f}" if n >= 10 * MiB else f"{n / MiB:.2f}" if n >= MiB / 10 else f"{n / MiB:.2g}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a is not None and b else ""


def _ok(rows: list[dict]) -> dict[str, dict]:
    return {r["method"]: r for r in rows if r.get("status") == "ok"}


def describe(data: dict) -> str:
    """One line: model, geometry, batch, dtype, device, threads (and ranks, with --nproc)."""
    a, meta = data["run_info"]["args"], data.get("meta_info", {})
    geo = next((r["geometry"] for r in data["results"] if r.get("geometry")), {})
    layers = geo.get("num_hidden_layers", a.get("layers"))
    hidden = geo.get("hidden_size", a.get("hidden"))
    where = meta.get("gpu") or meta.get("cpu") or a.get("device")
    layers, hidden = layers or "the preset's", hidden or "the preset's"
    swept = data.get("sweep", {}).get("variable")
    if swept:  # the swept variable varies over the rows
        layers, hidden = ("(swept)" if swept == "layers" else layers), ("(swept)" if swept == "hidden" else hidden)
        a = {**a, **{k: "(swept)" for k in ("batch", "seq") if k == swept}}
    ranks = f", {a['nproc']} ranks ({a['distributed']})" if a.get("nproc", 1) > 1 else ""
    per_rank = " per rank" if ranks else ""
    runs = f", each figure the median of {a['repeat']} runs" if a.get("repeat", 1) > 1 else ""
    return (f"{a['model']}, {layers} layers, hidden {hidden}, batch {a['batch']} x seq {a['seq']}{per_rank}, "
            f"{a['dtype']}, {a['device']} ({where}; {meta.get('torch_threads')} threads), timed steps: "
            f"{a['steps']}{ranks}{runs}")


def _header(data: dict, title: str) -> list[str]:
    info, meta = data["run_info"], data.get("meta_info", {})
    commit = (info.get("git_commit") or "unknown")[:12] + (" (uncommitted changes)" if info.get("git_dirty") else "")
    return [f"## {title}", "", describe(data), "", f"    {info.get('command') or ''}", "",
            f"commit {commit}; torch {meta.get('torch')}, transformers {meta.get('transformers')}, "
            f"peft {meta.get('peft')}, python {meta.get('python')}", ""]


def failures(rows: list[dict], key: str = "") -> list[str]:
    bad = [r for r in rows if r.get("status") != "ok"]
    if not bad:
        return []
    out = ["", "Failed:", "", f"| {key + ' | ' if key else ''}method | status | error |",
           f"|{'---|' if key else ''}---|---|---|"]
    for r in bad:
        err = str(r.get("error", "")).replace("|", "/").replace("\n", " ")[:300]
        out.append(f"| {str(r.get('value', '')) + ' | ' if key else ''}{r['method']} | {r['status']} | {err} |")
    return out


def peer_ckpt(rows: list[dict]) -> dict | None:
    """The first peer's checkpointed row that ran (`hf-trainer+ckpt`): what users would run instead."""
    return next((r for r in rows if r.get("status") == "ok" and r.get("peer") and r.get("checkpointing")), None)


def bench_markdown(data: dict) -> str:
    """bench.md: one row per method (and peer), ratios to full, ckpt and the peer's checkpointing, measured vs
    estimated bytes."""
    if _ranked(data):
        return ranks_markdown(data)
    rows = data["results"]
    ok = _ok(rows)
    full, ckpt, peer = ok.get("full"), ok.get("ckpt"), peer_ckpt(rows)
    cuda = any(r.get("peak_reserved_bytes") for r in ok.values())
    lines = _header(data, "Bench")
    vs_peer = [f"÷ {peer['method']}"] if peer else []
    head = ["method", "status", "peak mem MiB", "÷ full", "÷ ckpt", *vs_peer] + (["reserved MiB"] if cuda else []) + \
        ["tokens/s", "÷ full", "÷ ckpt", *vs_peer, "saved for backward MiB (est.)", "static MiB (est.)",
         "trainable params", "routing records MiB"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['method']} | {r['status']} |" + " |" * (len(head) - 2))
            continue
        peak, tps = r["peak_mem_bytes"], r["tokens_per_s"]
        cells = [r["method"], "ok", _mib(peak), _ratio(peak, full and full["peak_mem_bytes"]),
                 _ratio(peak, ckpt and ckpt["peak_mem_bytes"])]
        cells += [_ratio(peak, peer["peak_mem_bytes"])] if peer else []
        cells += [_mib(r.get("peak_reserved_bytes"))] if cuda else []
        cells += [f"{tps:.0f}", _ratio(tps, full and full["tokens_per_s"]), _ratio(tps, ckpt and ckpt["tokens_per_s"])]
        cells += [_ratio(tps, peer["tokens_per_s"])] if peer else []
        cells += [f"{_mib(r['activation_bytes'])} ({_mib(r.get('est_activation_bytes'))})",
                  f"{_mib(r['static_bytes'])} ({_mib(r.get('est_static_bytes'))})", f"{r['trainable_params']:,}",
                  _mib(r["routing_record_bytes"]) if r.get("routing_record_bytes") else ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "peak mem: " + ("CUDA max allocated" if cuda else _cpu_peak(rows) + " minus the RSS after imports")
              + "; tokens/s: median over the timed steps; saved for backward: bytes autograd holds after one "
              "forward (parameters excluded; revffn's routing records listed apart); static: weights + grads + "
              "optimizer states; (est.): `revffn estimate` for the same configuration."]
    peers = [r for r in ok.values() if r.get("peer")]
    if peers:
        lines += ["", "Peers: " + "; ".join(
            f"`{r['method']}` is {r['trainer']} (transformers {r.get('versions', {}).get('transformers')}), "
            f"{r['global_step']} optimizer steps, gradient checkpointing {'on' if r['checkpointing'] else 'off'}, "
            f"estimated as `{r['like']}`" for r in peers) + ": the same model, batch, dtype and AdamW, each in a "
            "fresh process; its Trainer log is in bench.json."]
    lines += _alloc_note(data, cuda)
    return "\n".join(lines + failures(rows)) + "\n"


def _alloc_note(data: dict, cuda: bool) -> list[str]:
    env = data["run_info"].get("worker_env")
    if not env or cuda:
        return []
    return ["", "Every process ran with " + ", ".join(f"`{k}={v}`" for k, v in env.items()) + ": with glibc's "
            "default, a freed block raises malloc's mmap threshold and later blocks of its size stay resident once "
            "freed, so peak RSS measures the allocator's retention as much as the tensors (FSDP's gather and "
            "reduce-scatter buffers, a layer's recompute); fixed, peak RSS follows the tensors "
            "(`revffn.reports.bench.ALLOC_ENV`)."]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_bench(data: dict, path: Path) -> None:
    """bench.png: peak memory and tokens/s per method (failed methods marked)."""
    if _ranked(data):
        return plot_ranks(data, path)
    plt = _pyplot()
    rows = data["results"]
    names = [r["method"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8))
    for ax, key, scale, label in ((axes[0], "peak_mem_bytes", MiB, "peak memory (MiB)"),
                                  (axes[1], "tokens_per_s", 1, "tokens / s")):
        vals = [r[key] / scale if r.get("status") == "ok" and r.get(key) else 0 for r in rows]
        colors = ["tab:red" if n == "revffn" else "tab:gray" if r.get("status") != "ok" else
                  "tab:green" if r.get("peer") else "tab:blue" for n, r in zip(names, rows)]
        ax.barh(names, vals, color=colors)
        ax.invert_yaxis()
        ax.set_xlabel(label)
        for y, (v, r) in enumerate(zip(vals, rows)):
            ax.text(v, y, f" {v:.0f}" if r.get("status") == "ok" else f" {r.get('status')}", va="center", fontsize=8)
    fig.suptitle(describe(data), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ranked(data: dict) -> bool:
    """A bench of torchrun ranks (`--nproc` > 1): each row holds its ranks and its one-process twin."""
    return data["run_info"]["args"].get("nproc", 1) > 1


def _each(row: dict, key: str) -> str:
    """Each rank's `key` in seconds, rank 0 first."""
    return " / ".join(f"{r[key]:.2f}" for r in row["ranks"])


def _per_rank(row: dict, key: str) -> str:
    """'max (rank 0 / rank 1 / ...)' in MiB."""
    ranks = row.get("ranks") or []
    return f"{_mib(row[key])} ({' / '.join(_mib(r[key]) for r in ranks)})"


def _runs(row: dict) -> str:
    """Each `--repeat` run's `load_s` (of its slowest rank, under torchrun), in run order."""
    return ", ".join(f"{max(x['load_s'] for x in run.get('ranks') or [run]):.2f}" for run in row["repeats"])


def ranks_markdown(data: dict) -> str:
    """bench.md of a `--nproc N` bench: per method, what each rank holds (static) and peaks at, next to
    the same method in one process, and the ratio."""
    rows, a = data["results"], data["run_info"]["args"]
    n, strategy = a["nproc"], a["distributed"]
    lines = _header(data, f"Bench: {n} ranks ({strategy}) vs one process")
    ranks = " / ".join(f"rank {r}" for r in range(n))
    lines += [f"### Memory per rank ({ranks})", "",
              f"| method | status | static MiB, 1 process | static MiB per rank: max ({ranks}) | ÷ 1 process | "
              f"static MiB per rank (est.) | peak MiB, 1 process | peak MiB per rank: max ({ranks}) | ÷ 1 process |",
              "|---|---|" + "---:|" * 7]
    kinds = [("param_bytes", "params"), ("grad_bytes", "grads"), ("optimizer_state_bytes", "optimizer states")]
    by_kind = ["", "### Static bytes by kind, MiB: 1 process -> per rank (max)", "",
               "| method | " + " | ".join(label for _, label in kinds) + " |", "|---|" + "---:|" * len(kinds)]
    load = ["", "### Start-up per rank: peak RSS from the process's start until the model is ready (built, "
            "prepared, sharded), and the time that took", "",
            f"| method | load peak MiB, 1 process | load peak MiB per rank: max ({ranks}) | ÷ 1 process | "
            f"load s, 1 process | load s per rank: max ({ranks}) | ÷ 1 process | "
            f"rendezvous s per rank: max ({ranks}) |", "|---|" + "---:|" * 7]
    speed = ["", "### Speed and saved-for-backward bytes", "",
             "| method | tokens/s, 1 process | tokens/s, all ranks | saved for backward MiB, 1 process | "
             "saved for backward MiB per rank: max |", "|---|" + "---:|" * 4]
    for r in rows:
        one = r.get("one_process") or {}
        if r.get("status") != "ok" or one.get("status") != "ok":
            lines.append(f"| {r['method']} | {r['status'] if r.get('status') != 'ok' else 'no 1-process row'} |"
                         + " |" * 7)
            continue
        lines.append(f"| {r['method']} | ok | {_mib(one['static_bytes'])} | {_per_rank(r, 'static_bytes')} | "
                     f"{r['static_vs_one_process']:.2f} | {_mib(r.get('est_static_bytes'))} | "
                     f"{_mib(one['peak_mem_bytes'])} | {_per_rank(r, 'peak_mem_bytes')} | "
                     f"{r['peak_vs_one_process']:.2f} |")
        by_kind.append(f"| {r['method']} | " + " | ".join(f"{_mib(one[k])} -> {_mib(r[k])} ({_ratio(r[k], one[k])})"
                                                         for k, _ in kinds) + " |")
        if r.get("load_rss_vs_one_process"):
            met = (f"{r['rendezvous_s']:.2f} ({_each(r, 'rendezvous_s')})" if "rendezvous_s" in r
                   else "–")  # (a bench.json from before the field)
            load.append(f"| {r['method']} | {_mib(one['load_peak_rss_bytes'])} | "
                        f"{_per_rank(r, 'load_peak_rss_bytes')} | {r['load_rss_vs_one_process']:.2f} | "
                        f"{one['load_s']:.2f} | {r['load_s']:.2f} ({_each(r, 'load_s')}) | "
                        f"{r['load_s_vs_one_process']:.2f} | {met} |")
        speed.append(f"| {r['method']} | {one['tokens_per_s']:.0f} ({one.get('threads')} threads) | "
                     f"{r['tokens_per_s']:.0f} ({r.get('threads')} threads each) | "
                     f"{_mib(one['activation_bytes'])} | {_mib(r['activation_bytes'])} |")
    library = [x for r in rows for x in (r.get("one_process") or {}, *r.get("ranks", ())) if "library_s" in x]
    if library and len(load) > 4:  # (a bench.json from before the field has none)
        load += ["", "The time counts from the end of the imports (transformers' lazily loaded ones included: the "
                 "model's module and its table of checkpoint conversions, made before the clock, "
                 f"{min(x['library_s'] for x in library):.2f}-{max(x['library_s'] for x in library):.2f} s a "
                 "process) and of the process group's rendezvous (its own column, the wait for the last rank's "
                 "imports in it)."]
    spread = [f"{r['method']}: 1 process {_runs(r['one_process'])} s, per rank (max) {_runs(r)} s" for r in rows
              if r.get("repeats") and (r.get("one_process") or {}).get("repeats")]
    if spread and len(load) > 4:
        load += ["", "Each run's start-up: " + "; ".join(spread) + "."]
    cuda = any(r.get("peak_reserved_bytes") for r in rows)
    notes = ["", f"static: the parameters, gradients and optimizer states a process holds from step to step (of a "
             f"sharded FSDP2 DTensor, its local shard); (est.): `revffn estimate --world-size {n} --distributed "
             f"{strategy}`. peak: " + ("CUDA max allocated" if cuda else f"each process's {_cpu_peak(rows)} minus its "
                                       "RSS after the imports (a rank's includes the process group and the gathered "
                                       "units)")
             + ". `--batch` is per rank: every rank steps batch x seq tokens of its own, and the one-process run "
             "steps one such batch, so its activations are one rank's; tokens/s of all ranks is their sum."]
    notes += _alloc_note(data, cuda)
    bad = [{**r["one_process"], "method": f"{r['method']} (1 process)"} for r in rows
           if (r.get("one_process") or {}).get("status") not in (None, "ok")]
    return "\n".join(lines + by_kind + (load if len(load) > 4 else []) + speed + notes + failures(rows + bad)) + "\n"


def plot_ranks(data: dict, path: Path) -> None:
    """bench.png of a `--nproc N` bench: static and peak memory per method, one process vs per rank (max)."""
    plt = _pyplot()
    rows = [r for r in data["results"] if r.get("status") == "ok" and r.get("one_process", {}).get("status") == "ok"]
    n = data["run_info"]["args"]["nproc"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "static_bytes", "static: params + grads + optimizer states (MiB)"),
                           (axes[1], "peak_mem_bytes", "peak memory (MiB)")):
        xs = range(len(rows))
        for dx, color, name, vals in ((-0.2, "tab:gray", "1 process", [r["one_process"][key] / MiB for r in rows]),
                                      (0.2, "tab:red", f"per rank of {n} (max)", [r[key] / MiB for r in rows])):
            ax.bar([x + dx for x in xs], vals, width=0.4, color=color, label=name)
            for x, v in zip(xs, vals):
                ax.text(x + dx, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), [r["method"] for r in rows])
        ax.set_ylabel(label)
        ax.margins(y=0.25)  # room for the legend above the bars
        ax.legend(fontsize=8)
    fig.suptitle(describe(data), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _series(rows: list[dict], method: str, key: str, values: list[int]) -> list:
    by = {r["value"]: r for r in rows if r["method"] == method and r.get("status") == "ok"}
    return [by[v].get(key) if v in by else None for v in values]


def sweep_markdown(data: dict) -> str:
    """sweep.md: peak memory, saved-for-backward bytes and tokens/s per method and value."""
    rows, var, values = data["results"], data["sweep"]["variable"], data["sweep"]["values"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    lines = _header(data, f"Sweep over {var}")
    head = "| method | " + " | ".join(f"{var}={v}" for v in values) + " |"
    rule = "|---|" + "---:|" * len(values)

    def table(title, key, fmt, extra=()):
        out = [f"### {title}", "", head, rule]
        for m in methods:
            out.append(f"| {m} | " + " | ".join(fmt(x) for x in _series(rows, m, key, values)) + " |")
        return out + list(extra)

    mib = _mib
    lines += table("Peak memory (MiB)", "peak_mem_bytes", mib)
    est = ["", "Estimated (`revffn estimate`), MiB:", "", head, rule] + [
        f"| {m} | " + " | ".join(mib(x) for x in _series(rows, m, "est_activation_bytes", values)) + " |"
        for m in methods]
    records = ["| revffn routing records (not included above) | " + " | ".join(
        mib(x) for x in _series(rows, "revffn", "routing_record_bytes", values)) + " |"] if "revffn" in methods else []
    lines += ["", *table("Saved for backward (MiB, measured)", "activation_bytes", mib, records + est)]
    lines += ["", *table("Tokens/s", "tokens_per_s", lambda x: "" if x is None else f"{x:.0f}")]
    growth = []
    for m in methods:
        acts = _series(rows, m, "activation_bytes", values)
        if acts[0] and acts[-1]:
            growth.append(f"| {m} | {acts[-1] / acts[0]:.2f} |")
    if growth:
        lines += ["", f"### Growth of saved-for-backward bytes: {var}={values[-1]} ÷ {var}={values[0]}", "",
                  "| method | ratio |", "|---|---:|", *growth]
    peer = peer_ckpt(rows)
    if peer:
        lines += ["", f"### Against {peer['method']} ({peer['trainer']} with gradient checkpointing)", "",
                  head, rule]
        for m in (m for m in methods if m != peer["method"]):
            for key, what in (("peak_mem_bytes", "peak mem"), ("tokens_per_s", "tokens/s")):
                pairs = zip(_series(rows, m, key, values), _series(rows, peer["method"], key, values))
                lines.append(f"| {m}: {what} ÷ peer's | " + " | ".join(_ratio(a, b) for a, b in pairs) + " |")
        cross = crossover(rows, peer["method"], values)
        lines += ["", f"RevFFN's peak memory is below {peer['method']}'s from {var}={cross} on." if cross is not None
                  else f"RevFFN's peak memory is not below {peer['method']}'s at any {var} measured."]
    return "\n".join(lines + failures(rows, var)) + "\n"


def crossover(rows: list[dict], peer: str, values: list[int], method: str = "revffn"):
    """The first value from which `method`'s peak memory stays below `peer`'s (None: nowhere)."""
    ours, theirs = _series(rows, method, "peak_mem_bytes", values), _series(rows, peer, "peak_mem_bytes", values)
    below = [a is not None and b is not None and a < b for a, b in zip(ours, theirs)]
    for i in range(len(values)):
        if all(below[i:]):
            return values[i]
    return None


def plot_sweep(data: dict, path: Path) -> None:
    """sweep.png: peak memory, saved-for-backward bytes and tokens/s vs the swept variable, one line per method
    (and peer); with a peer, a dotted line where RevFFN's peak memory drops below the peer's checkpointing."""
    plt = _pyplot()
    rows, var, values = data["results"], data["sweep"]["variable"], data["sweep"]["values"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    peer = peer_ckpt(rows)
    cross = crossover(rows, peer["method"], values) if peer else None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for ax, key, label, scale in ((axes[0], "peak_mem_bytes", "peak memory (MiB)", MiB),
                                  (axes[1], "activation_bytes", "saved for backward (MiB)", MiB),
                                  (axes[2], "tokens_per_s", "tokens / s", 1)):
        for m in methods:
            ys = [None if y is None else y / scale for y in _series(rows, m, key, values)]
            style = "--" if any(r.get("peer") for r in rows if r["method"] == m) else "-"
            ax.plot(values, ys, style, marker="o", label=m, linewidth=2.5 if m == "revffn" else 1.2)
        if cross is not None and key != "activation_bytes":
            ax.axvline(cross, color="tab:red", linestyle=":", label=f"revffn below {peer['method']}")
        if key == "activation_bytes" and "revffn" in methods:
            ys = [None if y is None else y / MiB for y in _series(rows, "revffn", "routing_record_bytes", values)]
            ax.plot(values, ys, "k--", marker="x", label="revffn routing records (apart)")
            ax.set_yscale("log")
        ax.set_xlabel(var)
        ax.set_ylabel(label)
        ax.set_xticks(values)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(describe(data), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


KINDS = {"bench": (bench_markdown, plot_bench), "sweep": (sweep_markdown, plot_sweep)}


def render(data: dict, out_dir: Path, kind: str) -> list[str]:
    """Write `{kind}.md` and `{kind}.png` (skipped, with a warning, where matplotlib is missing)."""
    markdown, plot = KINDS[kind]
    (Path(out_dir) / f"{kind}.md").write_text(markdown(data))
    try:
        plot(data, Path(out_dir) / f"{kind}.png")
    except ImportError as e:
        print(f"revffn bench: no {kind}.png ({e}); the JSON and markdown are complete", file=sys.stderr)
        return [f"{kind}.md"]
    return [f"{kind}.md", f"{kind}.png"]


def write(data: dict, out_dir: Path, kind: str) -> list[str]:
    """Write `{kind}.json` and render it; the files written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{kind}.json.tmp"
    try:  # whole or not at all: a full disk leaves the previous file (or none), not a cut one
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, out_dir / f"{kind}.json")
    finally:
        tmp.unlink(missing_ok=True)
    return [f"{kind}.json", *render(data, out_dir, kind)]


def write_bench(data: dict, out_dir: Path) -> list[str]:
    return write(data, out_dir, "bench")


def write_sweep(data: dict, out_dir: Path) -> list[str]:
    return write(data, out_dir, "sweep")


def render_dir(out_dir: Path) -> list[str]:
    """Regenerate .md and .png from the bench.json / sweep.json in `out_dir`; the files written."""
    written = []
    for kind in KINDS:
        path = Path(out_dir) / f"{kind}.json"
        if path.is_file():
            written += render(json.loads(path.read_text()), Path(out_dir), kind)
    return written


if __name__ == "__main__":
    print(" ".join(render_dir(Path(sys.argv[1]))) or "nothing to render")

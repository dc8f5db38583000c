"""study.json -> study.md + plots (accuracy per method, loss curves, conversion gap)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from revffn.reports.study import protocol_runs

PLOTS = ("study_accuracy.png", "study_loss.png", "study_gap.png")


# runs without `peak_since: training` (`workers.study`: studies before stop 58, or a kernel that does not let a
# process restart its RSS peak): the seed-0 runs that first evaluated the base or the conversion at init did so in
# the process whose peak they report
PEAK_BEFORE_STOP_58 = ("); the runs that first evaluated the base (the first run) or the conversion at init (seed 0) "
                       "include those evaluations where the peak was not restarted after them (studies before stop "
                       "58)")


def _pct(s: dict | None) -> str:
    if not s or s.get("mean") is None:
        return "n/a"
    if s["n"] == 1:
        return f"{100 * s['mean']:.1f}"
    return f"{100 * s['mean']:.1f} [{100 * s['min']:.0f}–{100 * s['max']:.0f}]"


def _num(s: dict | None, fmt: str = ".3f", scale: float = 1.0, signed: bool = False) -> str:
    if not s or s.get("mean") is None:
        return "n/a"
    f = ("+" if signed else "") + fmt
    return f"{s['mean'] * scale:{f}}" + (f" [{s['min'] * scale:{f}}, {s['max'] * scale:{f}}]" if s["n"] > 1 else "")


def _row(data: dict, method: str, task: str) -> dict | None:
    return next((r for r in data["summary"] if r["method"] == method and r["task"] == task), None)


def goal_check(data: dict) -> list[str]:
    """The study's stated goal, checked per task from the means (no judgement added)."""
    lines = []
    for task in data["plan"]["tasks"]:
        rev = _row(data, "revffn", task)
        if rev is None or rev["test_exact_match"]["mean"] is None:
            continue
        acc = rev["test_exact_match"]["mean"]
        parts = []
        for other in ("lora", "dora"):
            o = _row(data, other, task)
            if o and o["test_exact_match"]["mean"] is not None:
                ok = acc >= o["test_exact_match"]["mean"]
                parts.append(f"RevFFN {'≥' if ok else '<'} {dict(lora='LoRA', dora='DoRA')[other]} "
                             f"({100 * acc:.1f} vs {100 * o['test_exact_match']['mean']:.1f}) {'✓' if ok else '✗'}")
        full = _row(data, "full", task)
        if full and full["test_exact_match"]["mean"] is not None:
            d = 100 * (acc - full["test_exact_match"]["mean"])
            parts.append(f"within 2 points of full: {d:+.1f} {'✓' if d >= -2 else '✗'}")
            if rev["retention_change"] and full["retention_change"]:
                a, b = rev["retention_change"]["mean"], full["retention_change"]["mean"]
                parts.append(f"forgetting ≤ full: Δretention {a:+.3f} vs {b:+.3f} {'✓' if a <= b + 1e-9 else '✗'}")
            a, b = (rev.get("probe_accuracy") or {}).get("mean"), (full.get("probe_accuracy") or {}).get("mean")
            if a is not None and b is not None:
                parts.append(f"probes kept ≥ full's: {100 * a:.1f} vs {100 * b:.1f} % {'✓' if a >= b else '✗'}")
        lines.append(f"- **{task}**: " + ("; ".join(parts) or "no full, LoRA or DoRA row in this study to check "
                                                           "RevFFN against (`--methods`)"))
    return lines


def _method_options(data: dict) -> dict:
    """Method -> the YAML section of its study runs (a study.json before `method_options`: plan.revffn)."""
    plan = data["plan"]
    return data.get("method_options", {"revffn": plan["revffn"]} if "revffn" in plan else {})


def _base(data: dict) -> dict:
    """The study's base (a study.json from before `StudyBase`: the shipped builtin:base)."""
    return data["plan"].get("base") or {"model": "builtin:base", "retention_data": "builtin:retention_test",
                                        "probes": None, "convert": []}


def study_markdown(data: dict, plot_prefix: str = "") -> str:
    plan = data["plan"]
    base = _base(data)
    probes = bool(base.get("probes"))
    seeds = ", ".join(map(str, plan["seeds"]))
    lines = [
        "# RevFFN quality study",
        "",
        f"Regenerate: `{data.get('command') or 'revffn study --out runs/study --docs docs/study.md'}`",
        "",
        f"Wall time {data['wall_s'] / 60:.1f} min; {plan.get('jobs', 1)} run(s) at a time, each a fresh process "
        f"with {data['threads']} CPU thread(s)"
        + (f", git {data['git_commit'][:10]}" if data.get("git_commit") else "") + f", started {data['started']}.",
        "",
        f"Base: `{base['model']}`, retention loss {data['base_retention_loss']:.4f} on `{base['retention_data']}` "
        + (f"(held-out text, its first {plan['retention_limit']} documents)" if plan.get("retention_limit") else
           "(held-out text)") + (f", {100 * data['base_probe_accuracy']:.1f} % of `{base['probes']}` answered "
                             "(containment)" if data.get("base_probe_accuracy") is not None else "")
        + ". Every method: "
        f"{plan['steps']} optimizer steps × batch {plan['batch']} (same batches), cosine LR with "
        f"{plan['warmup_steps']} warm-up steps, fp32. LR chosen per method and task from the declared grid by "
        f"val exact match (seed {plan['seeds'][0]}); test numbers are mean [min–max] over seeds {seeds}. "
        + "".join(f"{m} options: {o}. " for m, o in _method_options(data).items())
        + "What the numbers say, and what was tried: docs/results.md.",
        "",
        "| task | method | LR (grid) | test exact match % | retention loss | Δ retention | "
        + ("probes % | " if probes else "") + "peak mem MiB | tokens/s |",
        "|---|---|---|---|---|---|---|---|" + ("---|" if probes else ""),
    ]
    for r in data["summary"]:
        grid = ", ".join(f"{x:g}" for x in r["lr_grid"])
        lines.append(f"| {r['task']} | {r['method']} | {r['lr']:g} ({grid}) | {_pct(r['test_exact_match'])} | "
                     f"{_num(r['retention_loss'])} | {_num(r['retention_change'], signed=True)} | "
                     + (f"{_pct(r.get('probe_accuracy'))} | " if probes else "")
                     + f"{_num(r['peak_mem_bytes'], '.0f', 2**-20)} | {_num(r['tokens_per_s'], '.0f')} |")
    conv = data.get("conversion")
    if conv:
        took = "reused" if conv.get("reused") else f"{conv['wall_s']:.0f} s" + (f", failed: {conv['error']}"
                                                                               if conv.get("error") else "")
        lines += ["", f"RevFFN starts from one conversion made for the study: `{conv['command']}` ({took})."]
    if data["runs"] and data["runs"][0].get("shared_process"):
        lines += ["", "Peak memory: all runs shared one process (`--quick`), so it is not per method."]
    else:
        ok = [r for r in data["runs"] if r["status"] == "ok"]
        lines += ["", "Peak memory: process peak RSS during training minus the RSS after imports (fresh process per "
                  "run; includes allocator retention" + (", restarted after the evaluations before training)" if ok
                                                        and all(r.get("peak_since") == "training" for r in ok) else
                  PEAK_BEFORE_STOP_58) + ". tokens/s: median over logging intervals."]
    lines += ["", "## Goal check (computed from the means above)", "", *goal_check(data)]
    errors = [r for r in data["runs"] if r["status"] != "ok"]
    if errors:
        lines += ["", "## Failed runs", ""] + [f"- {r['name']}: {r['error']}" for r in errors]
    lines += ["", "## Conversion gap (RevFFN, retention loss)", "",
              "| task | variant | adapter init | stage 1 | distill_coef | base | converted at init | after stage 1 | "
              "after schedule | " + ("probes % at init | probes % after | " if probes else "")
              + "test exact match % | peak mem MiB | tokens/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if probes else "")]

    def cell(v, fmt=".4f", scale=1.0):
        return "n/a" if v is None else f"{v * scale:{fmt}}"

    for g in data["conversion_gap"]:
        buffered = g.get("coupling", "additive") == "buffered"  # (pages from before the key: additive)
        stage1 = "none" if buffered else f"{g['adapter_warmup_steps']} steps on {g.get('heal_data', 'self')}"
        momentum = f", {g['buffer_momentum']} momentum" if "buffer_momentum" in g else ""  # (not in older pages)
        init = (f"none (buffered, {g.get('buffer_bits', 6)} bits{momentum})" if buffered
                else g.get("adapter_init", "calibrated"))
        distill = f"{g.get('distill_coef', 0):g}" + (f" ({g.get('distill_teacher', 'copy')})"
                                                    if g.get("distill_coef") else "")
        lines.append(f"| {g['task']} | {g['variant']} | {init} | {stage1} | "
                     f"{distill} | {g['base']:.4f} | {cell(g['converted_init'])} | "
                     f"{cell(g['after_stage1'])} | {g['after_schedule']:.4f} | "
                     + (f"{cell(g.get('converted_probes'), '.1f', 100)} | {cell(g.get('probes_after'), '.1f', 100)} | "
                        if probes else "") + f"{100 * g['test_exact_match']:.1f} | "
                     f"{cell(g.get('peak_mem_bytes'), '.0f', 2 ** -20)} | {cell(g.get('tokens_per_s'), '.0f')} |")
    if data["conversion_gap"]:
        lines += ["", f"Seed {plan['seeds'][0]}, each task at RevFFN's chosen LR for it; the default's gap at init "
                  "is measured on the first task (the conversion does not depend on the task)."]
    lines += ["", "## LR selection (val exact match % per LR, seed 0)", "", "| task | method | " +
              " | ".join("LR grid value" for _ in range(max(len(v) for v in plan["lr_grid"].values()))) + " |",
              "|---|---|" + "---|" * max(len(v) for v in plan["lr_grid"].values())]
    for r in data["summary"]:
        cells = [f"{lr}: {100 * v:.0f}" + (" ←" if float(lr) == r["lr"] else "")
                 for lr, v in r["val_exact_match_by_lr"].items()]
        lines.append(f"| {r['task']} | {r['method']} | " + " | ".join(cells) + " |")
    lines += ["", "## Plots", ""] + [f"![{p}]({plot_prefix}{p})" for p in PLOTS]
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)


def plot_accuracy(data: dict, path: Path) -> None:
    plt = _pyplot()
    tasks, methods = data["plan"]["tasks"], data["plan"]["methods"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    width = 0.8 / len(tasks)
    for i, task in enumerate(tasks):
        xs, ys, lo, hi = [], [], [], []
        for j, m in enumerate(methods):
            s = _row(data, m, task)["test_exact_match"]
            if s["mean"] is None:
                continue
            xs.append(j + i * width)
            ys.append(100 * s["mean"])
            lo.append(100 * (s["mean"] - s["min"]))
            hi.append(100 * (s["max"] - s["mean"]))
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=task)
    ax.set_xticks([j + width * (len(tasks) - 1) / 2 for j in range(len(methods))], methods)
    ax.set_ylabel("test exact match %")
    ax.set_title("Accuracy per method (bars: mean, whiskers: min-max over seeds)")
    ax.legend()
    _save(fig, path)


def plot_loss(data: dict, path: Path) -> None:
    plt = _pyplot()
    tasks = data["plan"]["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    seed0 = data["plan"]["seeds"][0]
    for ax, task in zip(axes[0], tasks):
        for m in data["plan"]["methods"]:
            lr = data["chosen_lr"][f"{m}/{task}"]
            run = next((r for r in protocol_runs(data["runs"], m, task, lr) if r["job"]["seed"] == seed0), None)
            if run:
                ax.plot([p[0] for p in run["curve"]], [p[1] for p in run["curve"]], label=f"{m} (lr {lr:g})")
        ax.set_title(f"{task}: training loss (seed {seed0})")
        ax.set_xlabel("step")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    _save(fig, path)


def plot_gap(data: dict, path: Path) -> None:
    plt = _pyplot()
    gap = data["conversion_gap"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    stages = ("base", "converted_init", "after_stage1", "after_schedule")
    width = 0.8 / len(stages)
    for i, st in enumerate(stages):
        ys = [g[st] if g[st] is not None else float("nan") for g in gap]
        ax.bar([j + i * width for j in range(len(gap))], ys, width, label=st.replace("_", " "))
    ax.set_xticks([j + width * 1.5 for j in range(len(gap))],
                  [f"{g['task']}\n{g['variant']}" for g in gap])
    ax.set_ylabel("retention loss (nats/token)")
    ax.set_title(f"RevFFN conversion gap on held-out text ({_base(data)['model']})")
    ax.legend(fontsize=7)
    _save(fig, path)


def write_study(data: dict, out_dir: Path, docs: Path | None = None) -> list[str]:
    """study.json, study.md and the plots in `out_dir`; with `docs`, also the md there and plots beside it
    (in a `study/` folder next to it)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "study.json").write_text(json.dumps(data, indent=1) + "\n")
    plot_accuracy(data, out_dir / PLOTS[0])
    plot_loss(data, out_dir / PLOTS[1])
    if data["conversion_gap"]:
        plot_gap(data, out_dir / PLOTS[2])
    (out_dir / "study.md").write_text(study_markdown(data))
    written = ["study.json", "study.md", *(p for p in PLOTS if (out_dir / p).exists())]
    if docs is not None:
        assets = docs.parent / docs.stem
        assets.mkdir(parents=True, exist_ok=True)
        if assets.resolve() != out_dir.resolve():  # rendering the docs' own copy (`--out docs/x --docs docs/x.md`)
            for p in PLOTS:
                if (out_dir / p).exists():
                    shutil.copy(out_dir / p, assets / p)
            shutil.copy(out_dir / "study.json", assets / "study.json")
        docs.write_text(study_markdown(data, plot_prefix=f"{assets.name}/"))
        written.append(str(docs))
    return written

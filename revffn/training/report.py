"""Per-run report: report.md, loss.png (train + eval, stage boundaries marked), memory.png.

Rendered from `metrics.jsonl`, `events.jsonl` (stalls, memory-growth warnings) and `config.yaml` in
the run directory, so it can be regenerated at any time; the loop writes it at the end of a run and
also when the run stops on an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from revffn.training.watch import read_jsonl


def read_metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def event_lines(run_dir: Path) -> list[str]:
    """The report's lines for events.jsonl's stalls and memory-growth warnings (restarts: the summary)."""
    lines = []
    for e in read_jsonl(Path(run_dir) / "events.jsonl"):
        if e["event"] == "stall":
            lines.append(f"- stalled after step {e['step']}: no step in {e['stall_timeout_s']} s, the process exited "
                         "with code 3 (every thread's stack: events.jsonl)")
        elif e["event"] == "memory_growth":
            lines.append(f"- **warning: memory in use rose {e['rise_mib']} MiB over steps {e['from_step']}-{e['step']}"
                         f"** (rising on {e['steps_rising']} of {e['window']} steps; tolerance "
                         f"{e['tolerance_mib']:g} MiB): a leak? Look for tensors kept by hooks or lists.")
    return lines


def _stage_boundaries(rows: list[dict]) -> list[tuple[int, str]]:
    out, prev = [], None
    for r in rows:
        if r.get("stage") != prev and prev is not None:
            out.append((r["step"], r["stage"]))
        prev = r.get("stage")
    return out


def plot_loss(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    ev = [r for r in rows if "eval_loss" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss")
    for step, stage in _stage_boundaries(rows):
        ax.axvline(step - 0.5, color="gray", ls="--", lw=1)
        ax.text(step, ax.get_ylim()[1], f" {stage}", va="top", fontsize=8, color="gray")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_memory(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["step"] for r in rows], [r["peak_mem_bytes"] / 2**20 for r in rows])
    for step, _ in _stage_boundaries(rows):
        ax.axvline(step - 0.5, color="gray", ls="--", lw=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_run_report(run_dir: Path, summary: dict) -> None:
    """Write report.md, loss.png and memory.png into `run_dir` (whatever state the run is in)."""
    run_dir = Path(run_dir)
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    cfg_path = run_dir / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text()) if cfg_path.exists() else {}
    title = f"{cfg.get('method', '?')} on {cfg.get('model', '?')}"
    if rows:
        plot_loss(rows, run_dir / "loss.png", title)
        plot_memory(rows, run_dir / "memory.png", "peak memory: " + title)
    lines = [f"# Run report: {title}", "", f"- status: **{summary.get('status', '?')}**"]
    if summary.get("error"):
        lines.append(f"- error: `{summary['error']}`")
    if rows:
        first, last = rows[0], rows[-1]
        lines += [
            f"- steps logged: {len(rows)} (last step {last['step']})",
            f"- train loss: {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} (step {last['step']})",
            f"- peak memory: {max(r['peak_mem_bytes'] for r in rows) / 2**20:.1f} MiB",
            f"- tokens/s (median): {sorted(r['tokens_per_s'] for r in rows)[len(rows) // 2]:.0f}",
        ]
        for step, stage in _stage_boundaries(rows):
            lines.append(f"- stage `{stage}` starts at step {step}")
    if "eval_loss" in summary:
        lines.append(f"- final eval loss: {summary['eval_loss']:.4f}")
    if summary.get("eval_exact_match") is not None:
        lines.append(f"- final eval exact match: {100 * summary['eval_exact_match']:.1f} % of the first "
                     f"{summary['eval_scored']} examples (greedy)")
    stats = summary.get("train_stats")
    if stats and stats.get("streaming"):
        lines.append(f"- data: streamed from {stats['source']}; read by this process: {stats['epoch']} whole "
                     f"epoch(s) and {stats['examples']} examples of the next")
    elif stats:
        lines.append(f"- data: {json.dumps(stats)}")
    if summary.get("restarts"):
        lines.append(f"- automatic restarts: {summary['restarts']} (see events.jsonl)")
    lines += event_lines(run_dir)
    lines += ["", "![loss](loss.png)", "", "![memory](memory.png)", "", "## Config", "", "```yaml",
              yaml.safe_dump(cfg, sort_keys=False).rstrip(), "```", ""]
    (run_dir / "report.md").write_text("\n".join(lines))

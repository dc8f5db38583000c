"""`revffn study`: fine-tuning quality of every method on the shipped pretrained base.

    revffn study --out runs/study --docs docs/study.md     # full study, ~40 min on 2 CPU cores
    revffn study --quick --out /tmp/study                  # smoke version, < 1 min

For each method and task the base (`builtin:base`) is fine-tuned for the same optimizer steps on the
same batches (same seed -> same data order). Protocol (`StudyPlan`):

1. LR selection: seed 0, every learning rate of the method's declared grid; the LR with the best
   exact match on the task's *val* split wins (ties: lower val loss). The test split is never used.
2. More seeds at the chosen LR. Reported: test exact match (mean, min-max over seeds), retention
   loss on held-out pretraining text and its change from the base, peak memory and tokens/s.
3. Conversion gap of RevFFN on the retention set, for each (adapter init, warm-up length) variant:
   the base's loss, the converted model at init, after stage 1 (adapters only), after the schedule.

Every run is a fresh process (`revffn.reports.workers.study`) so its peak memory is its own; with
`--quick` all runs share one process to fit the time budget, and memory is marked as shared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from revffn.errors import UserError

WORKER_MODULE = "revffn.reports.workers.study"
METHODS = ("full", "revffn", "lora", "dora", "hift", "refta")


@dataclass(frozen=True)
class StudyPlan:
    methods: tuple[str, ...] = METHODS
    tasks: tuple[str, ...] = ("commas", "gsm")
    seeds: tuple[int, ...] = (0, 1)
    # Declared LR grids: full-parameter methods around the usual SFT range, adapters ~10x higher.
    lr_grid: dict[str, tuple[float, ...]] = field(default_factory=lambda: {
        "full": (3e-4, 1e-3), "revffn": (3e-4, 1e-3), "hift": (3e-4, 1e-3),
        "lora": (1e-3, 3e-3), "dora": (1e-3, 3e-3), "refta": (1e-3, 3e-3)})
    steps: int = 150
    batch: int = 8
    warmup_steps: int = 10
    logging_steps: int = 5
    max_seq_length: int = 128
    eval_limit: int = 100
    retention_limit: int | None = None  # first N retention documents (None: all)
    max_new_tokens: dict[str, int] = field(default_factory=lambda: {"gsm": 20, "commas": 12, "format": 12})
    revffn: dict = field(default_factory=lambda: {"adapter_warmup_steps": 20, "adapter_init": "coordinate",
                                                  "freeze_router": True})
    # (adapter_init, adapter_warmup_steps) for the conversion-gap runs (task: tasks[0], seed 0).
    gap_variants: tuple[tuple[str, int], ...] = (("coordinate", 20), ("coordinate", 50), ("zero", 20), ("zero", 50))
    shared_process: bool = False
    jobs: int = 1  # worker processes at once (each with REVFFN_STUDY_THREADS torch threads)

    @property
    def default_gap_variant(self) -> tuple[str, int]:
        """The (adapter_init, adapter_warmup_steps) of the protocol's RevFFN runs."""
        return self.revffn["adapter_init"], self.revffn["adapter_warmup_steps"]


QUICK = StudyPlan(tasks=("commas",), seeds=(0,), steps=2, batch=4, warmup_steps=0, logging_steps=1,
                  eval_limit=4, retention_limit=8, max_new_tokens={"commas": 4},
                  lr_grid={m: (1e-4,) for m in METHODS},
                  revffn={"adapter_warmup_steps": 1, "adapter_init": "coordinate", "freeze_router": True},
                  gap_variants=(("coordinate", 1),), shared_process=True)


def _job(plan: StudyPlan, out: Path, method: str, task: str, seed: int, lr: float, eval_val: bool,
         revffn: dict | None = None, gap_init: bool = False, tag: str = "") -> dict:
    name = f"{method}-{task}-s{seed}-lr{lr:g}{tag}"
    return {"name": name, "method": method, "task": task, "seed": seed, "lr": lr, "steps": plan.steps,
            "batch": plan.batch, "warmup_steps": plan.warmup_steps, "logging_steps": plan.logging_steps,
            "max_seq_length": plan.max_seq_length, "eval_limit": plan.eval_limit,
            "retention_limit": plan.retention_limit,
            "max_new_tokens": plan.max_new_tokens[task], "eval_val": eval_val, "gap_init": gap_init,
            "revffn": dict(revffn or plan.revffn), "run_dir": str(out / "runs" / name)}


def run_jobs(jobs: list[dict], out: Path, shared_process: bool, log=print, parallel: int = 1) -> list[dict]:
    """Run jobs in fresh worker processes (one each, or one for all), `parallel` processes at a time;
    a failed job is an error row. Rows come back in job order."""
    from concurrent.futures import ThreadPoolExecutor

    groups = [jobs] if shared_process else [[j] for j in jobs]
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return [row for rows in pool.map(lambda g: _run_group(g, out, shared_process, log), groups) for row in rows]


def _run_group(group: list[dict], out: Path, shared_process: bool, log) -> list[dict]:
    results = []
    files = []
    for job in group:
        path = out / "jobs" / f"{job['name']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(job, indent=1))
        files.append(str(path))
    t0 = time.perf_counter()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-m", WORKER_MODULE, *files], capture_output=True, text=True, env=env)
    got = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            got[row["name"]] = row
    for job in group:
        row = got.get(job["name"])
        if row is None:
            tail = " | ".join(proc.stderr.strip().splitlines()[-3:])[-500:]
            row = {"name": job["name"], "status": "error", "error": f"worker exit {proc.returncode}: {tail}"}
        else:
            row["status"] = "ok"
        row["job"] = {k: v for k, v in job.items() if k != "run_dir"}
        row["process_s"] = round((time.perf_counter() - t0) / len(group), 1)
        row["shared_process"] = shared_process
        results.append(row)
        em = row.get("test_exact_match")
        log(f"[study] {job['name']}: " + (f"test EM {em:.2f}, retention {row['retention_loss']:.3f}, "
                                          f"{row['process_s']:.0f}s" if row["status"] == "ok" else row["error"]))
    return results


def protocol_runs(runs: list[dict], method: str, task: str, lr: float | None = None) -> list[dict]:
    """The successful protocol runs (LR grid and seeds, not the gap-only variants) of a method and task."""
    return [r for r in runs if r["status"] == "ok" and r["job"]["method"] == method and r["job"]["task"] == task
            and not r["job"].get("gap_only") and (lr is None or r["job"]["lr"] == lr)]


def select_lr(rows: list[dict]) -> float:
    """The grid LR with the best val exact match (ties: lower val loss). Never looks at test."""
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return rows[0]["job"]["lr"]
    return max(ok, key=lambda r: (r["val_exact_match"], -r["val_loss"]))["job"]["lr"]


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values),
            "values": values} if values else {"mean": None, "min": None, "max": None, "n": 0, "values": []}


def summarize(plan: StudyPlan, runs: list[dict], chosen: dict, base_loss: float | None) -> list[dict]:
    """One row per (method, task): the chosen LR's runs over all seeds."""
    rows = []
    for task in plan.tasks:
        for method in plan.methods:
            mine = protocol_runs(runs, method, task, chosen[f"{method}/{task}"])
            ret = [r["retention_loss"] for r in mine]
            rows.append({
                "method": method, "task": task, "lr": chosen[f"{method}/{task}"],
                "lr_grid": list(plan.lr_grid[method]), "seeds": [r["job"]["seed"] for r in mine],
                "test_exact_match": _spread([r["test_exact_match"] for r in mine]),
                "retention_loss": _spread(ret),
                "retention_change": _spread([x - base_loss for x in ret]) if base_loss is not None else None,
                "peak_mem_bytes": _spread([r["peak_mem_bytes"] for r in mine]),
                "tokens_per_s": _spread([r["tokens_per_s"] for r in mine]),
                "val_exact_match_by_lr": {str(r["job"]["lr"]): r["val_exact_match"]
                                          for r in protocol_runs(runs, method, task) if "val_exact_match" in r},
            })
    return rows


def gap_plan(plan: StudyPlan, out: Path, grid: list[dict], chosen: dict) -> tuple[list[dict], dict]:
    """Extra RevFFN runs for the conversion-gap variants, and the run name of every variant.

    All variants use tasks[0], seed 0 and RevFFN's chosen LR; the default variant is the grid run itself.
    """
    if "revffn" not in plan.methods:
        return [], {}
    task0, lr0 = plan.tasks[0], chosen[f"revffn/{plan.tasks[0]}"]
    default = plan.default_gap_variant
    names = {default: next(j["name"] for j in grid if j["method"] == "revffn" and j["task"] == task0
                           and j["lr"] == lr0)}
    jobs = []
    for init, warm in plan.gap_variants:
        if (init, warm) != default:
            job = _job(plan, out, "revffn", task0, plan.seeds[0], lr0, eval_val=False, gap_init=True,
                       revffn={**plan.revffn, "adapter_init": init, "adapter_warmup_steps": warm},
                       tag=f"-{init}-w{warm}")
            job["gap_only"] = True
            jobs.append(job)
            names[(init, warm)] = job["name"]
    return jobs, names


def run_study(plan: StudyPlan, out: Path, argv: list[str] | None = None, log=print) -> dict:
    from revffn.reports.bench import _git, _loadavg

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    if plan.jobs > 1:  # parallel workers share the cores rather than oversubscribe them
        os.environ.setdefault("REVFFN_STUDY_THREADS", str(max(1, (os.cpu_count() or 1) // plan.jobs)))
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    # 1. LR selection on val (seed 0); the default RevFFN run of tasks[0] also measures the gap at init.
    grid = [_job(plan, out, m, t, plan.seeds[0], lr, eval_val=True, gap_init=(m == "revffn" and t == plan.tasks[0]))
            for t in plan.tasks for m in plan.methods for lr in plan.lr_grid[m]]
    grid[0]["measure_base"] = True
    runs = run_jobs(grid, out, plan.shared_process, log, plan.jobs)
    chosen = {f"{m}/{t}": select_lr([r for r in runs if r["job"]["method"] == m and r["job"]["task"] == t])
              for t in plan.tasks for m in plan.methods}
    # 2. The other seeds at the chosen LR.
    more = [_job(plan, out, m, t, s, chosen[f"{m}/{t}"], eval_val=False)
            for t in plan.tasks for m in plan.methods for s in plan.seeds[1:]]
    # 3. Conversion-gap variants other than the default (which ran in step 1).
    gap_jobs, gap_names = gap_plan(plan, out, grid, chosen)
    runs += run_jobs(more + gap_jobs, out, plan.shared_process, log, plan.jobs)
    base_loss = next((r["base_retention_loss"] for r in runs if r.get("base_retention_loss") is not None), None)
    by_name = {r["name"]: r for r in runs if r["status"] == "ok"}
    gap = []
    for init, warm in plan.gap_variants:
        r = by_name.get(gap_names.get((init, warm)))
        if r is not None:
            gap.append({"adapter_init": init, "adapter_warmup_steps": warm, "task": r["job"]["task"],
                        "lr": r["job"]["lr"], "base": base_loss,
                        "converted_init": r["converted_retention_loss"], "after_stage1": r["stage1_retention_loss"],
                        "after_schedule": r["retention_loss"], "test_exact_match": r["test_exact_match"],
                        "default": (init, warm) == plan.default_gap_variant})
    return {
        "schema": "revffn.study/1",
        "command": " ".join(["revffn", *argv]) if argv is not None else None,
        "plan": asdict(plan), "started": started, "wall_s": round(time.perf_counter() - t0, 1),
        "git_commit": _git("rev-parse", "HEAD"), "loadavg_end": _loadavg(), "threads": _threads(),
        "base_retention_loss": base_loss, "chosen_lr": chosen,
        "summary": summarize(plan, runs, chosen, base_loss), "conversion_gap": gap, "runs": runs,
    }


def _threads() -> int:
    import torch

    return int(os.environ.get("REVFFN_STUDY_THREADS", torch.get_num_threads()))


def plan_for(quick: bool, **overrides) -> StudyPlan:
    plan = QUICK if quick else StudyPlan()
    unknown = [m for m in overrides.get("methods") or () if m not in METHODS]
    if unknown:
        raise UserError(f"--methods: unknown method(s) {', '.join(unknown)}. Fix: choose from {', '.join(METHODS)}.")
    return replace(plan, **{k: v for k, v in overrides.items() if v})

"""`revffn study`: fine-tuning quality of every method on a pretrained base.

    revffn study --out runs/study --docs docs/study.md     # full study, ~40 min on 2 CPU cores (--jobs 2)
    revffn study --quick --out /tmp/study                  # smoke version, < 1 min
    revffn study --base builtin:smollm2 --out runs/study-smollm2 --docs docs/study_smollm2.md
                                                           # the real base, ~35 min on 2 CPU cores (--jobs 2)

For each method and task the base (`StudyBase`: the shipped 4-layer `builtin:base` by default, or a real
pretrained model with `--base`) is fine-tuned for the same optimizer steps on the same batches (same
seed -> same data order). Protocol (`StudyPlan`):

1. LR selection: seed 0, every learning rate of the method's declared grid; the LR with the best
   exact match on the task's *val* split wins (ties: lower val loss). The test split is never used.
2. More seeds at the chosen LR. Reported: test exact match (mean, min-max over seeds), retention
   loss on held-out pretraining text and its change from the base, peak memory and tokens/s.
3. Forgetting: the retention loss on held-out text and, on a real base, knowledge-probe accuracy
   (containment: the base's facts, `builtin:smollm2_probes`), of the base and of every trained model.
4. Conversion gap on the retention set, for each method that changes the model before training
   (RevFFN) and each of its declared variants (adapter init, warm-up length): the base's loss, the
   prepared model at init, at the method's stage boundary (after RevFFN's stage 1), after the schedule.

Everything about a method comes from its class in the registry (`revffn.methods`): whether it is in
the study and its LR grid (`STUDY_LR_GRID`), the YAML section of its runs (`study_options`), its
conversion-gap variants (`STUDY_GAP_VARIANTS`) and its stage boundary (`steady_state_step`).

On a real base a method that trains a converted model (`ACCEPTS_CONVERTED`: RevFFN) starts from one
`revffn convert` made once per study (`StudyBase.convert`), since calibrating a 30-layer model takes
minutes a run on a CPU; its gap at init is that conversion's.

Every run is a fresh process (`revffn.reports.workers.study`) so its peak memory is its own; with
`--quick` all runs share one process to fit the time budget, and memory is marked as shared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from revffn.data import DEFAULT_CALIBRATION
from revffn.errors import UserError, unread
from revffn.progress import progress
from revffn.schema import check_value, coerce

WORKER_MODULE = "revffn.reports.workers.study"


def study_methods() -> tuple[str, ...]:
    """Every registered method that declares an LR grid (`STUDY_LR_GRID`), in registry order."""
    from revffn.methods import METHODS

    return tuple(m for m, cls in METHODS.items() if cls.STUDY_LR_GRID is not None)


def _method(name: str):
    from revffn.methods import method_class

    return method_class(name)


@dataclass(frozen=True)
class StudyBase:
    """The model a study fine-tunes, and how forgetting is measured on it."""

    model: str = "builtin:base"
    retention_data: str = "builtin:retention_test"  # held-out text: the loss on it before and after training
    probes: str | None = None  # knowledge probes scored by containment before and after training (None: none)
    # `revffn convert` flags: methods that accept a converted model start from one conversion made once per
    # study with them (empty: such a method converts in each run, at prepare)
    convert: tuple[str, ...] = ()
    # method -> its YAML section on this base, replacing the method's `study_options`
    method_options: dict = field(default_factory=dict)


# A real instruct model (SmolLM2-135M-Instruct and its MoE upcycle): the tasks it cannot do before
# (0 of 30 test examples exact on commas, format, gsm and the reversal task), LRs an order below the toy's,
# forgetting on the Python manual's held-out text and on the 76 facts the model answers. RevFFN starts from
# the conversion calibrated on the manual's other pages (docs/conversion.md's best calibrated variant: the
# same domain as the retention text, which favours RevFFN's retention figure; `self` text loses far more)
# and trains everything from step 1 (a heal step of the real model on 2 CPU cores: docs/conversion.md).
REAL_LR_GRID = {"full": (1e-5, 3e-5), "hift": (1e-5, 3e-5), "revffn": (1e-5, 3e-5),
                "lora": (3e-4, 1e-3), "dora": (3e-4, 1e-3), "refta": (3e-4, 1e-3)}
REAL_CONVERT = ("--coupling", "additive", "--calibration-data", "builtin:pydoc_calibration", "--calibration-tokens",
                "16384")  # the additive coupling's one conversion (the buffered one trains from the base)
# `--heal-steps N` (a GPU budget): that conversion also healed N steps on the same text at lr 1e-4, the variant that
# reached base + 0.28 nats in 400 steps on one H200 (docs/conversion.md, "The first GPU figure")
REAL_HEAL = ("--heal-data", "builtin:pydoc_calibration", "--heal-lr", "1e-4")


def real_base(model: str) -> StudyBase:
    # RevFFN's defaults: the buffered coupling (stop 47), full fine-tuning of the whole layers with the routers frozen,
    # at full's LRs, from the base itself (nothing to calibrate). The additive coupling trains from the study's one
    # conversion (REAL_CONVERT) at an order above: --set revffn.coupling=additive --lr-grid revffn=1e-4,3e-4 (frozen
    # adapters, stop 46); docs/study_smollm2_additive.md ran it with the adapters trained and float32 streams at 1e-5
    # and 3e-5
    return StudyBase(model, "builtin:pydoc_text", "builtin:smollm2_probes", REAL_CONVERT,
                     {"revffn": {"coupling": "buffered", "adapter_warmup_steps": 0, "freeze_router": True}})


@dataclass(frozen=True)
class StudyPlan:
    """The protocol's knobs. Methods, LR grids and each method's options come from the registry."""

    base: StudyBase = field(default_factory=StudyBase)
    methods: tuple[str, ...] = field(default_factory=study_methods)
    # Tasks the base learns in this budget (full fine-tuning >= 40 % test exact match at some LR of its grid;
    # gsm stayed under 30 % even at 600 x 16, so the word-reversal task replaced it; the study of docs/study.md names
    # it `quickstart`, its name then).
    tasks: tuple[str, ...] = ("commas", "reversal")
    seeds: tuple[int, ...] = (0, 1)
    # The methods' declared LR grids (full-parameter methods around the usual SFT range, adapters ~10x higher).
    lr_grid: dict[str, tuple[float, ...]] = field(default_factory=lambda: {
        m: tuple(_method(m).STUDY_LR_GRID) for m in study_methods()})
    steps: int = 300
    batch: int = 16
    warmup_steps: int = 10
    logging_steps: int = 5
    max_seq_length: int = 256  # the tasks' examples are far shorter; 256 is `retention_loss`'s cut, so the
    # loop's retention eval at the stage boundary measures what the other gap columns measure
    eval_limit: int = 100
    retention_limit: int | None = None  # first N retention documents (None: all)
    probe_limit: int | None = None  # first N knowledge probes (None: all)
    max_new_tokens: dict[str, int] = field(default_factory=lambda: {"gsm": 20, "commas": 12, "format": 12,
                                                                       "reversal": 12})
    # Also run the methods' other conversion-gap variants (`STUDY_GAP_VARIANTS`; task: tasks[0], seed 0).
    # False: only the protocol run's gap (the default variant).
    gap_variants: bool = True
    shared_process: bool = False
    jobs: int = 1  # worker processes at once
    threads: int | None = None  # torch threads per run (None: cores / jobs when jobs > 1, else torch's default)
    overrides: dict[str, dict] = field(default_factory=dict)  # method -> options set on top of the method's own

    def options(self, method: str, **variant) -> dict:
        """The method's YAML section in this plan's runs (`variant`: a conversion-gap variant's options)."""
        preset = {**self.base.method_options[method], **variant} if method in self.base.method_options else \
            _method(method).study_options(self.steps, **variant)
        options = {**preset, **self.overrides.get(method, {})}
        unused = _method(method).unused_options(options)  # (a preset's key another setting overrules:
        return {k: v for k, v in options.items() if k not in unused}  # dropped; a --set one is refused up front)

    def converts_once(self, method: str) -> bool:
        """Whether `method`'s runs start from the study's one conversion (`StudyBase.convert`)."""
        return bool(self.base.convert) and _method(method).trains_converted(self.options(method))

    @property
    def run_threads(self) -> int | None:
        """Torch threads of each run: parallel workers share the cores rather than oversubscribe them."""
        if self.threads or self.jobs <= 1:
            return self.threads
        return max(1, (os.cpu_count() or 1) // self.jobs)


def real_plan(model: str) -> StudyPlan:
    """The study on a real pretrained model (`--base`): full, LoRA and RevFFN on the comma task, 3 seeds,
    sized to about 90 min on 2 CPU cores (`--steps` and `--seeds` raise the budget, e.g. on a GPU)."""
    methods = ("full", "lora", "revffn")
    return StudyPlan(base=real_base(model), methods=methods, tasks=("commas",), seeds=(0, 1, 2),
                     lr_grid={m: REAL_LR_GRID.get(m) or tuple(_method(m).STUDY_LR_GRID) for m in study_methods()},
                     steps=60, batch=8, warmup_steps=6, logging_steps=5, max_seq_length=64, eval_limit=50,
                     retention_limit=32, gap_variants=False)


def quick_plan() -> StudyPlan:
    """The smoke version (`--quick`): every study method, 2 steps, one task, one seed, one shared process."""
    return StudyPlan(tasks=("commas",), seeds=(0,), steps=2, batch=4, warmup_steps=0, logging_steps=1,
                     eval_limit=4, retention_limit=8, max_new_tokens={"commas": 4},
                     lr_grid={m: (1e-4,) for m in study_methods()}, gap_variants=False, shared_process=True,
                     overrides={"revffn": {"calibration_tokens": 1024}})  # 2 steps need no 32k-token calibration


def _job(plan: StudyPlan, out: Path, method: str, task: str, seed: int, lr: float, eval_val: bool,
         options: dict | None = None, gap_init: bool = False, tag: str = "") -> dict:
    """One run's JSON for the worker. `method_module`: the module that registers the method (the worker
    imports it first, so a method registered outside the package works); `options`: its YAML section."""
    name = f"{method}-{task}-s{seed}-lr{lr:g}{tag}"
    base = plan.base
    return {"name": name, "base": base.model, "model": str(out / "converted") if plan.converts_once(method) else None,
            "retention_data": base.retention_data, "probes": base.probes, "probe_limit": plan.probe_limit,
            "method": method, "method_module": _method(method).__module__, "task": task,
            "seed": seed, "lr": lr, "steps": plan.steps, "batch": plan.batch, "warmup_steps": plan.warmup_steps,
            "logging_steps": plan.logging_steps, "max_seq_length": plan.max_seq_length,
            "eval_limit": plan.eval_limit, "retention_limit": plan.retention_limit,
            "max_new_tokens": plan.max_new_tokens[task], "eval_val": eval_val, "gap_init": gap_init,
            "threads": plan.run_threads, "options": options if options is not None else plan.options(method),
            "run_dir": str(out / "runs" / name)}


def run_worker(job_files: list[str]) -> subprocess.CompletedProcess:
    """The default runner: one fresh worker process for `job_files` (returncode, stdout, stderr)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([sys.executable, "-m", WORKER_MODULE, *job_files], capture_output=True, text=True, env=env)


Runner = Callable[[list[str]], subprocess.CompletedProcess]


def _log_run(note: str) -> None:
    print(f"[study] {note}", flush=True)


class RunTally:
    """The study's progress, fed one finished run at a time from the runner threads: a line with its result,
    the runs done of `total` and the ETA (`revffn.progress`)."""

    def __init__(self, bar, total: int):
        self.bar, self.total, self.done, self.lock = bar, total, 0, threading.Lock()

    def __call__(self, note: str) -> None:
        with self.lock:
            self.done += 1
            self.bar(self.done, max(self.total, self.done), note)


def run_jobs(jobs: list[dict], out: Path, shared_process: bool, log=_log_run, parallel: int = 1,
             runner: Runner | None = None) -> list[dict]:
    """Run jobs in fresh worker processes (one each, or one for all; `runner`, default `run_worker`),
    `parallel` processes at a time; a failed job is an error row. Rows come back in job order; `log(note)` is
    called with each finished run's result."""
    from concurrent.futures import ThreadPoolExecutor

    runner = runner or run_worker

    groups = [jobs] if shared_process else [[j] for j in jobs]
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        return [row for rows in pool.map(lambda g: _run_group(g, out, shared_process, log, runner), groups)
                for row in rows]


def _run_group(group: list[dict], out: Path, shared_process: bool, log, runner: Runner) -> list[dict]:
    results = []
    files = []
    for job in group:
        path = out / "jobs" / f"{job['name']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(job, indent=1))
        files.append(str(path))
    t0 = time.perf_counter()
    proc = runner(files)
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
        log(f"{job['name']}: " + (f"test EM {em:.2f}, retention {row['retention_loss']:.3f}, "
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
                "probe_accuracy": _spread([r["probe_accuracy"] for r in mine if r.get("probe_accuracy") is not None]),
                "peak_mem_bytes": _spread([r["peak_mem_bytes"] for r in mine]),
                "tokens_per_s": _spread([r["tokens_per_s"] for r in mine]),
                "val_exact_match_by_lr": {str(r["job"]["lr"]): r["val_exact_match"]
                                          for r in protocol_runs(runs, method, task) if "val_exact_match" in r},
            })
    return rows


def gap_plan(plan: StudyPlan, out: Path, grid: list[dict], chosen: dict) -> tuple[list[dict], dict]:
    """The conversion-gap runs of every plan method that declares variants (`STUDY_GAP_VARIANTS`:
    RevFFN's old default and its stage-2 guard), and the run of each, (method, task, label) -> name.

    Every task, seed 0 and the method's chosen LR for the task; the default variant (the method's study
    options) is the grid run itself (its gap at init measured on tasks[0] only: the conversion does not
    depend on the task), the others are extra runs (only with `plan.gap_variants`).
    """
    jobs, names = [], {}
    for m in plan.methods:
        variants = _method(m).STUDY_GAP_VARIANTS
        if not variants:
            continue
        default = plan.options(m)
        for task in plan.tasks:
            lr = chosen[f"{m}/{task}"]
            names[m, task, "default"] = next(j["name"] for j in grid if j["method"] == m and j["task"] == task
                                             and j["lr"] == lr)
            for label, variant in variants.items() if plan.gap_variants else ():
                options = plan.options(m, **variant)
                if options != default:
                    job = _job(plan, out, m, task, plan.seeds[0], lr, eval_val=False, options=options,
                               gap_init=True, tag=f"-{label}")
                    job["gap_only"] = True
                    jobs.append(job)
                    names[m, task, label] = job["name"]
    return jobs, names


def gap_rows(names: dict, runs: list[dict], base_loss: float | None) -> list[dict]:
    """One row per conversion-gap variant that ran: the variant's options and its retention losses."""
    from revffn.reversible.buffered import DEFAULT_BUFFER_BITS, DEFAULT_MOMENTUM

    by_name = {r["name"]: r for r in runs if r["status"] == "ok"}
    rows = []
    for (method, _, label), name in names.items():
        r = by_name.get(name)
        if r is not None:
            options = dict(r["job"]["options"])
            if options.get("coupling") == "buffered":  # the defaults it ran with, which a later version may change
                options = {"buffer_bits": DEFAULT_BUFFER_BITS, "buffer_momentum": DEFAULT_MOMENTUM, **options}
            rows.append({"method": method, "variant": label, **options, "task": r["job"]["task"],
                         "lr": r["job"]["lr"], "base": base_loss, "converted_init": r.get("converted_retention_loss"),
                         "after_stage1": r["stage1_retention_loss"], "after_schedule": r["retention_loss"],
                         "converted_probes": r.get("converted_probe_accuracy"), "probes_after": r.get("probe_accuracy"),
                         "test_exact_match": r["test_exact_match"], "peak_mem_bytes": r.get("peak_mem_bytes"),
                         "tokens_per_s": r.get("tokens_per_s"), "default": label == "default"})
    return rows


def convert_once(plan: StudyPlan, out: Path, log=print) -> dict | None:
    """The study's one `revffn convert` (`StudyBase.convert`) for the methods that train a converted model,
    in a fresh process; a conversion already in `out/converted` (an interrupted study's) is reused. None when
    no method of the plan needs one. A failed conversion is logged; the runs that need it then fail."""
    if not any(plan.converts_once(m) for m in plan.methods):
        return None
    dest = out / "converted"
    cmd = ["revffn", "convert", plan.base.model, "--out", str(dest), *plan.base.convert,
           "--eval-data", plan.base.retention_data, "--device", "auto", "--json"]
    if (dest / "revffn.json").is_file():
        manifest = json.loads((dest / "revffn.json").read_text())
        flags = dict(zip(plan.base.convert[::2], plan.base.convert[1::2]))
        made = manifest.get("convert", {})
        want = {"converted_from": plan.base.model,
                "calibration_data": flags.get("--calibration-data", DEFAULT_CALIBRATION),
                "calibration_tokens": int(flags.get("--calibration-tokens", 32768)),
                "heal_steps": int(flags.get("--heal-steps", 0))}
        have = {"converted_from": manifest.get("converted_from"), "calibration_data": made.get("calibration_data"),
                "calibration_tokens": made.get("calibration_tokens"), "heal_steps": made.get("heal_steps", 0)}
        if have != want:
            raise UserError(f"--out: {dest} holds a conversion this study did not ask for ({have}; this study: "
                            f"{want}). Nothing was run. Fix: delete {dest}, or give a new --out.")
        log(f"[study] reusing the conversion in {dest}")
        return {"command": " ".join(cmd), "reused": True, "manifest": manifest}
    log(f"[study] converting once: {' '.join(cmd)}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    if plan.run_threads:
        env["OMP_NUM_THREADS"] = str(plan.run_threads)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, env=env)
    wall = round(time.perf_counter() - t0, 1)
    if proc.returncode:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])[-500:]
        log(f"[study] the conversion failed (exit {proc.returncode}): {tail}")
        return {"command": " ".join(cmd), "wall_s": wall, "error": tail}
    manifest = json.loads(next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")))
    log(f"[study] converted in {wall:.0f} s")
    return {"command": " ".join(cmd), "wall_s": wall, "manifest": manifest}


def run_study(plan: StudyPlan, out: Path, argv: list[str] | None = None, log=print,
              runner: Runner | None = None) -> dict:
    """The whole protocol (module docstring); the study.json document. `runner`: how a group of jobs
    runs (default: one fresh worker process per group)."""
    import torch

    from revffn.reports.bench import _git, _loadavg

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    conversion = convert_once(plan, out, log)
    # 1. LR selection on val (seed 0); the default run of tasks[0] of a method with a conversion gap also
    # measures the gap at init.
    grid = [_job(plan, out, m, t, plan.seeds[0], lr, eval_val=True,
                 gap_init=bool(_method(m).STUDY_GAP_VARIANTS) and t == plan.tasks[0])
            for t in plan.tasks for m in plan.methods for lr in plan.lr_grid[m]]
    grid[0]["measure_base"] = True
    seeds_left = len(plan.tasks) * len(plan.methods) * (len(plan.seeds) - 1)
    with progress("study", "run", every=0, bar=False) as bar:
        tally = RunTally(bar, len(grid) + seeds_left)  # + the gap variants, counted once the LRs are chosen
        runs = run_jobs(grid, out, plan.shared_process, tally, plan.jobs, runner)
        chosen = {f"{m}/{t}": select_lr([r for r in runs if r["job"]["method"] == m and r["job"]["task"] == t])
                  for t in plan.tasks for m in plan.methods}
        # 2. The other seeds at the chosen LR.
        more = [_job(plan, out, m, t, s, chosen[f"{m}/{t}"], eval_val=False)
                for t in plan.tasks for m in plan.methods for s in plan.seeds[1:]]
        # 3. Conversion-gap variants other than the default (which ran in step 1).
        gap_jobs, gap_names = gap_plan(plan, out, grid, chosen)
        tally.total = len(grid) + len(more) + len(gap_jobs)
        runs += run_jobs(more + gap_jobs, out, plan.shared_process, tally, plan.jobs, runner)
    base_loss = next((r["base_retention_loss"] for r in runs if r.get("base_retention_loss") is not None), None)
    base_probes = next((r["base_probe_accuracy"] for r in runs if r.get("base_probe_accuracy") is not None), None)
    return {
        "schema": "revffn.study/1",
        "command": " ".join(["revffn", *argv]) if argv is not None else None,
        "plan": asdict(plan), "started": started, "wall_s": round(time.perf_counter() - t0, 1),
        "git_commit": _git("rev-parse", "HEAD"), "loadavg_end": _loadavg(),
        "threads": plan.run_threads or torch.get_num_threads(),
        "method_options": {m: o for m in plan.methods if (o := plan.options(m))},
        "base_retention_loss": base_loss, "base_probe_accuracy": base_probes, "conversion": conversion,
        "chosen_lr": chosen,
        "summary": summarize(plan, runs, chosen, base_loss), "conversion_gap": gap_rows(gap_names, runs, base_loss),
        "runs": runs,
    }


def plan_for(quick: bool, base: str | None = None, heal_steps: int = 0, **overrides) -> StudyPlan:
    """The full or the quick plan (on `base`: a real model's plan, `real_plan`), with the CLI's overrides
    (methods, jobs, threads, steps, seeds; None: keep). `heal_steps`: the real base's one conversion is also
    healed that many steps (`REAL_HEAL`)."""
    real = base and base != StudyBase.model
    if heal_steps and not real:
        raise UserError("--heal-steps: only a real base's study converts once (--base builtin:smollm2 or "
                        "builtin:smollm2-moe); builtin:base's RevFFN heals in each run. Fix: drop --heal-steps or "
                        "give --base.")
    plan = quick_plan() if quick else real_plan(base) if real else StudyPlan()
    if quick and real:  # the smoke version on the real base: little calibration text
        rb = real_base(base)
        plan = replace(plan, base=replace(rb, convert=(*rb.convert[:-1], "1024")), methods=real_plan(base).methods,
                       max_seq_length=64, retention_limit=4, probe_limit=4)
    if heal_steps:
        plan = replace(plan, base=replace(plan.base, convert=(*plan.base.convert, "--heal-steps", str(heal_steps),
                                                              *REAL_HEAL)))
    unknown = [m for m in overrides.get("methods") or () if m not in plan.lr_grid]
    if unknown:
        raise UserError(f"--methods: {', '.join(map(repr, unknown))} not in the study. Fix: choose from "
                        f"{', '.join(plan.methods)} (a method joins the study by declaring STUDY_LR_GRID).")
    sets, grids = overrides.pop("sets", None) or (), overrides.pop("lr_grids", None) or ()
    if sets:
        plan = replace(plan, overrides=method_sets(plan, sets))
        for item in sets:  # a --set the run would not read (`Method.unused_options`): refused, not dropped
            method, _, key = item.partition("=")[0].partition(".")
            if method in plan.methods:
                preset = plan.options(method)
                unused = _method(method).unused_options({**preset, key: plan.overrides[method][key]})
                if key in unused:
                    reads, has = unused[key]
                    raise UserError(unread(f"--set {item!r}", reads, f"this study's {method} runs have {has}",
                                           f"drop it, or --set {reads}"))
    if grids:
        plan = replace(plan, lr_grid={**plan.lr_grid, **lr_grids(plan, grids)})
    plan = replace(plan, **{k: v for k, v in overrides.items() if v})
    for flag, items, sep in (("--set", sets, "."), ("--lr-grid", grids, "=")):
        for item in items:  # a method this study does not run: its setting would change nothing
            if (method := item.partition(sep)[0]) not in plan.methods:
                raise UserError(f"{flag} {item!r}: {method} is not among this study's methods "
                                f"({', '.join(plan.methods)}). Fix: drop it, or add {method} to --methods.")
    if heal_steps and not any(plan.converts_once(m) for m in plan.methods):
        raise UserError(f"--heal-steps {heal_steps}: no method of this study trains a converted model (RevFFN's "
                        "buffered coupling, the default, trains the base: nothing to heal). Fix: drop --heal-steps, or "
                        "--set revffn.coupling=additive.")
    return plan


def method_sets(plan: StudyPlan, sets: list[str]) -> dict[str, dict]:
    """`--set METHOD.KEY=VALUE` (repeatable, the value as YAML) on top of `plan.overrides`, each key checked
    against the method's SCHEMA."""
    import yaml

    out = {m: dict(o) for m, o in plan.overrides.items()}
    for item in sets:
        name, eq, value = item.partition("=")
        method, dot, key = name.partition(".")
        if not eq or not dot or method not in plan.lr_grid:
            raise UserError(f"--set {item!r}: expected METHOD.KEY=VALUE with METHOD one of the study's "
                            f"({', '.join(plan.lr_grid)}). Fix: e.g. --set revffn.train_adapters=false.")
        schema = _method(method).SCHEMA
        if key not in schema:
            raise UserError(f"--set {item!r}: {method} has no option {key!r}. Fix: one of "
                            f"{', '.join(sorted(schema))}.")
        parsed = coerce(yaml.safe_load(value), schema[key])  # checked here, as the config would, not in a worker
        if problem := check_value(name, parsed, schema[key]):
            raise UserError(f"--set {problem} Fix: a valid value for {name} ({schema[key].help}).")
        out.setdefault(method, {})[key] = parsed
    return out


def lr_grids(plan: StudyPlan, grids: list[str]) -> dict[str, tuple[float, ...]]:
    """`--lr-grid METHOD=LR,LR,...` (repeatable): the LRs the study chooses METHOD's from."""
    out = {}
    for item in grids:
        method, eq, values = item.partition("=")
        try:
            lrs = tuple(float(v) for v in values.split(","))
        except ValueError:
            lrs = ()
        if not eq or method not in plan.lr_grid or not lrs or min(lrs) <= 0:
            raise UserError(f"--lr-grid {item!r}: expected METHOD=LR[,LR...] with METHOD one of the study's "
                            f"({', '.join(plan.lr_grid)}) and positive LRs. Fix: e.g. --lr-grid revffn=1e-4,3e-4.")
        out[method] = lrs
    return out

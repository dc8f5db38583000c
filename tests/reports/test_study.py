"""`revffn study`: the quick smoke run end to end, LR selection on val only, aggregation, rendering."""

import json
import os
import subprocess
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from revffn import cli
from revffn.errors import UserError
from revffn.reports import study
from revffn.reports.render.study import goal_check, study_markdown, write_study
from revffn.reports.study import StudyPlan, plan_for, quick_plan, select_lr, summarize
from revffn.reports.workers import study as worker

pytestmark = pytest.mark.integration  # subprocess runs (CLI, workers)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The CI smoke version: every study method, 2 steps each, one shared worker process."""
    root = tmp_path_factory.mktemp("study")
    rc = cli.main(["study", "--quick", "--out", str(root / "out"), "--docs", str(root / "docs" / "study.md")])
    assert rc == 0
    return root


def test_quick_study_runs_every_method_and_writes_the_report(quick):
    data = json.loads((quick / "out" / "study.json").read_text())
    assert data["command"] == f"revffn study --quick --out {quick / 'out'} --docs {quick / 'docs' / 'study.md'}"
    quick_methods = quick_plan().methods
    assert quick_methods == ("full", "revffn", "lora", "dora", "hift", "refta")  # every method with an LR grid
    assert [r["status"] for r in data["runs"]] == ["ok"] * 6
    assert [r["method"] for r in data["summary"]] == list(quick_methods)
    for row in data["summary"]:
        assert 0.0 <= row["test_exact_match"]["mean"] <= 1.0
        assert row["retention_loss"]["mean"] > 0 and row["tokens_per_s"]["mean"] > 0
        assert row["retention_change"]["mean"] == pytest.approx(row["retention_loss"]["mean"]
                                                                - data["base_retention_loss"])
    for run in data["runs"]:  # each run went through the one loop and left its config and metrics
        run_dir = quick / "out" / "runs" / run["name"]
        assert (run_dir / "final" / "config.json").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0
        assert len(run["curve"]) == quick_plan().steps
        assert run["job"]["method_module"] == f"revffn.methods.{run['job']['method']}"
    gap = data["conversion_gap"]
    assert len(gap) == 1 and gap[0]["default"] and gap[0]["base"] == data["base_retention_loss"]
    # RevFFN's study options (warm-up cut to 1 of the 2 steps): its stage boundary got a retention eval
    assert gap[0]["method"] == "revffn" and gap[0]["adapter_warmup_steps"] == 1
    assert gap[0]["converted_init"] > 0 and gap[0]["after_stage1"] is None  # quick: no eval at the boundary
    assert data["method_options"] == {"revffn": {"coupling": "additive", "adapter_warmup_steps": 1,
                                                 "freeze_router": True, "stream_width": "half",
                                                 "calibration_tokens": 1024,
                                                 "calibration_data": "self", "heal_data": "self",
                                                 "train_adapters": True}}
    yaml_text = (quick / "out" / "runs" / "revffn-commas-s0-lr0.0001.yaml").read_text()
    assert "revffn:\n  coupling: additive\n  adapter_warmup_steps: 1\n" in yaml_text
    md = (quick / "docs" / "study.md").read_text()
    assert md.startswith("# RevFFN quality study\n\nRegenerate: `revffn study --quick")
    assert "| commas | revffn |" in md and "![study_accuracy.png](study/study_accuracy.png)" in md
    for name in ("study_accuracy.png", "study_loss.png", "study_gap.png", "study.json"):
        assert (quick / "docs" / "study" / name).stat().st_size > 1000


def test_study_refuses_an_existing_study_and_rerenders(quick, capsys):
    out = quick / "out"
    assert cli.main(["study", "--quick", "--out", str(out)]) == 2
    assert "holds a study already" in capsys.readouterr().err
    (out / "study.md").unlink()
    assert cli.main(["study", "--out", str(out), "--render"]) == 0
    assert (out / "study.md").read_text().startswith("# RevFFN quality study")
    assert cli.main(["study", "--out", str(quick / "empty"), "--render"]) == 2


@pytest.mark.parametrize("text,says", [("{bad", "study.json is not JSON ("),
                                       ("{}", "study.json is not a study revffn wrote (no plan, runs, summary")])
def test_render_of_a_damaged_study_json_exits_2(tmp_path, capsys, text, says):
    """A JSONDecodeError and a KeyError('plan') traceback before."""
    (tmp_path / "study.json").write_text(text)
    assert cli.main(["study", "--out", str(tmp_path), "--render"]) == 2
    assert says in capsys.readouterr().err and sorted(p.name for p in tmp_path.iterdir()) == ["study.json"]


def test_an_empty_methods_list_is_refused(tmp_path, capsys):
    """`--methods ""` (an empty shell variable) ran every method, hours of them."""
    assert cli.main(["study", "--methods", "", "--out", str(tmp_path / "s")]) == 2
    assert "--methods: empty" in capsys.readouterr().err and not (tmp_path / "s").exists()


def test_a_random_preset_as_the_base_is_refused(tmp_path, capsys):
    """Every run failed on its tokenizer, then the page with a TypeError (exit 1, study.json and plots left)."""
    assert cli.main(["study", "--quick", "--out", str(tmp_path / "s"), "--base", "tiny-qwen2-moe"]) == 2
    assert "--base tiny-qwen2-moe: a preset built with random weights" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_a_failing_method_is_an_error_row_and_exit_1(tmp_path, monkeypatch):
    """The real worker in a fresh process, with lora's runs made to fail (`faulty_study_worker`)."""
    monkeypatch.setattr(study, "WORKER_MODULE", "tests.reports.faulty_study_worker")
    assert cli.main(["study", "--quick", "--methods", "full,lora", "--out", str(tmp_path)]) == 1
    data = json.loads((tmp_path / "study.json").read_text())
    status = {r["job"]["method"]: r["status"] for r in data["runs"]}
    assert status == {"full": "ok", "lora": "error"}
    assert "injected fault in lora" in next(r["error"] for r in data["runs"] if r["status"] == "error")
    assert "## Failed runs" in (tmp_path / "study.md").read_text()


def _run(method, task, seed, lr, val=None, test=0.5, val_loss=1.0, retention=2.0):
    row = {"name": f"{method}-{task}-{seed}-{lr}", "status": "ok", "test_exact_match": test,
           "retention_loss": retention, "peak_mem_bytes": 100, "tokens_per_s": 10.0, "curve": [[1, 1.0]],
           "job": {"method": method, "task": task, "seed": seed, "lr": lr}}
    if val is not None:
        row.update(val_exact_match=val, val_loss=val_loss)
    return row


def test_lr_is_selected_on_val_never_on_test():
    rows = [_run("full", "gsm", 0, 1e-4, val=0.6, test=0.1), _run("full", "gsm", 0, 3e-4, val=0.4, test=0.9)]
    assert select_lr(rows) == 1e-4
    tie = [_run("full", "gsm", 0, 1e-4, val=0.5, val_loss=2.0), _run("full", "gsm", 0, 3e-4, val=0.5, val_loss=1.5)]
    assert select_lr(tie) == 3e-4


def test_summary_aggregates_seeds_at_the_chosen_lr():
    plan = StudyPlan(methods=("full", "revffn"), tasks=("gsm",))
    runs = [_run("full", "gsm", 0, 1e-4, val=0.5, test=0.4, retention=2.5),
            _run("full", "gsm", 1, 1e-4, test=0.6, retention=2.7),
            _run("full", "gsm", 0, 3e-4, val=0.1, test=1.0, retention=9.0),  # not chosen: left out
            _run("revffn", "gsm", 0, 1e-4, val=0.5, test=0.3), _run("revffn", "gsm", 1, 1e-4, test=0.5)]
    rows = summarize(plan, runs, {"full/gsm": 1e-4, "revffn/gsm": 1e-4}, base_loss=2.0)
    full = rows[0]
    assert full["test_exact_match"]["mean"] == pytest.approx(0.5)
    assert (full["test_exact_match"]["min"], full["test_exact_match"]["max"]) == (0.4, 0.6)
    assert full["retention_change"]["mean"] == pytest.approx(0.6)
    assert full["val_exact_match_by_lr"] == {"0.0001": 0.5, "0.0003": 0.1}


def test_goal_check_reports_shortfalls():
    plan = StudyPlan(methods=("full", "revffn", "lora", "dora"), tasks=("gsm",))
    runs = [_run("full", "gsm", 0, 1e-4, val=1, test=0.8, retention=2.1),
            _run("revffn", "gsm", 0, 1e-4, val=1, test=0.5, retention=2.3),
            _run("lora", "gsm", 0, 1e-4, val=1, test=0.6), _run("dora", "gsm", 0, 1e-4, val=1, test=0.4)]
    chosen = {f"{m}/gsm": 1e-4 for m in plan.methods}
    data = {"plan": {"tasks": ["gsm"]}, "summary": summarize(plan, runs, chosen, base_loss=2.0)}
    (line,) = goal_check(data)
    assert "RevFFN < LoRA (50.0 vs 60.0) ✗" in line and "RevFFN ≥ DoRA (50.0 vs 40.0) ✓" in line
    assert "within 2 points of full: -30.0 ✗" in line and "+0.300 vs +0.100 ✗" in line
    alone = StudyPlan(methods=("revffn",), tasks=("gsm",))
    data = {"plan": {"tasks": ["gsm"]}, "summary": summarize(alone, runs[1:2], chosen, base_loss=2.0)}
    assert goal_check(data) == ["- **gsm**: no full, LoRA or DoRA row in this study to check RevFFN against "
                                "(`--methods`)"]


def test_markdown_renders_from_json_alone(tmp_path):
    plan = StudyPlan(methods=("full",), tasks=("gsm",), seeds=(0,), gap_variants=False)
    runs = [_run("full", "gsm", 0, 1e-4, val=0.5)]
    data = {"command": "revffn study --out x", "plan": json.loads(json.dumps(asdict(plan))), "wall_s": 60,
            "threads": 2, "git_commit": None, "started": "now", "base_retention_loss": 2.0,
            "chosen_lr": {"full/gsm": 1e-4}, "summary": summarize(plan, runs, {"full/gsm": 1e-4}, 2.0),
            "conversion_gap": [], "runs": runs}
    write_study(data, tmp_path)
    md = study_markdown(data)
    assert "| gsm | full | 0.0001 (0.0003, 0.001) | 50.0 | 2.000 | +0.000 |" in md
    assert (tmp_path / "study_accuracy.png").exists() and not (tmp_path / "study_gap.png").exists()
    docs = tmp_path / "docs"  # the docs page, then re-rendered from the docs' own copy of the study (`--render`)
    write_study(data, tmp_path, docs / "page.md")
    assert write_study(data, docs / "page", docs / "page.md")[-1] == str(docs / "page.md")
    assert "![study_accuracy.png](page/study_accuracy.png)" in (docs / "page.md").read_text()


def test_plan_derives_from_the_registry_and_validates_methods():
    plan = StudyPlan()
    assert plan.methods == ("full", "revffn", "lora", "dora", "hift", "refta")  # ckpt: no grid (its grads are full's)
    assert plan.lr_grid["revffn"] == (3e-4, 1e-3) and plan.lr_grid["refta"] == (1e-3, 3e-3)
    assert plan.options("revffn") == {"coupling": "additive", "adapter_warmup_steps": 50, "freeze_router": True,
                                      "stream_width": "half", "calibration_data": "self", "heal_data": "self",
                                      "train_adapters": True}  # as the pages ran
    assert plan.options("lora") == {}
    assert plan_for(True, methods=("full", "lora")).methods == ("full", "lora")
    with pytest.raises(Exception, match="'ckpt', 'fulll' not in the study"):
        plan_for(False, methods=("ckpt", "fulll"))


def test_threads_travel_in_the_job_and_the_worker_applies_them(tmp_path, monkeypatch):
    assert StudyPlan(jobs=2).run_threads == max(1, (os.cpu_count() or 1) // 2)
    assert StudyPlan(jobs=2, threads=3).run_threads == 3 and StudyPlan().run_threads is None
    job = study._job(StudyPlan(threads=1), tmp_path, "full", "gsm", 0, 1e-3, eval_val=False)
    assert job["threads"] == 1 and job["options"] == {} and job["method_module"] == "revffn.methods.full"

    def stop(job, run_dir):
        raise KeyboardInterrupt("stop before training")

    monkeypatch.setattr(worker, "write_config", stop)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # (under xdist a test process has one thread already): the worker must change it
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.run_job(job, 0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_peak_is_trainings_not_the_evaluations_before_it(tmp_path, monkeypatch):
    """The base and the conversion at init are evaluated in the run's process before it trains; its peak memory
    restarts after them. Here the evaluations touch 768 MiB, far above what 2 steps of `full` on the toy base
    take: without the restart the run's peak is at least that."""
    from revffn.memory.measure import current_rss_bytes

    big = 768 * 2**20

    def heavy_evaluations(job, method):
        touched = torch.ones(big // 4)
        return {"base_retention_loss": float(touched[0])}

    monkeypatch.setattr(worker, "losses_before_training", heavy_evaluations)
    plan = replace(quick_plan(), shared_process=False)
    job = study._job(plan, tmp_path, "full", "commas", 0, 1e-4, eval_val=False)
    row = worker.run_job(job, current_rss_bytes())
    assert row["base_retention_loss"] == 1.0 and row["peak_since"] == "training"
    assert 0 < row["peak_mem_bytes"] < big / 2, row["peak_mem_bytes"] / 2**20


def test_a_stage_boundary_gets_a_retention_eval(tmp_path):
    """The worker asks the method for its stage boundary (`steady_state_step`): RevFFN's warm-up, cut by
    its `study_options` to leave a stage-2 step; none for HiFT."""
    plan = StudyPlan(steps=6)
    for method, boundary in (("revffn", 5), ("hift", 0)):
        job = study._job(plan, tmp_path, method, "commas", 0, 1e-3, eval_val=False)
        cfg, m = worker.write_config(job, Path(job["run_dir"]))
        assert type(m).name == method and m.steady_state_step() == boundary
        assert cfg.eval_data == ("builtin:retention_test" if boundary else None)
        if boundary:
            assert cfg.eval_steps == boundary and cfg.section("revffn")["adapter_warmup_steps"] == boundary
        saved = (tmp_path / "runs" / f"{job['name']}.yaml").read_text()  # the kept config is the one that ran
        assert ("retention_test" in saved) == bool(boundary)


def test_a_real_base_gets_its_plan_and_one_conversion_for_revffn(tmp_path):
    """`--base builtin:smollm2`: full, LoRA and RevFFN on commas, 3 seeds, forgetting on the manual's held-out
    text and the probes; RevFFN (the buffered coupling) at full's LRs from the base, and with the additive coupling
    from the study's one conversion; the others from the base."""
    plan = plan_for(False, "builtin:smollm2")
    assert plan.methods == ("full", "lora", "revffn") and plan.seeds == (0, 1, 2) and plan.tasks == ("commas",)
    assert plan.base.retention_data == "builtin:pydoc_text" and plan.base.probes == "builtin:smollm2_probes"
    assert plan.lr_grid["full"] == (1e-5, 3e-5) and plan.lr_grid["lora"] == (3e-4, 1e-3)
    assert plan.options("revffn") == {"coupling": "buffered", "freeze_router": True}  # (no stage 1 to cut to 0)
    assert plan.lr_grid["revffn"] == plan.lr_grid["full"]  # the buffered coupling is full fine-tuning
    assert not plan.converts_once("revffn") and not plan.converts_once("full")  # nothing to calibrate: the base
    assert study._job(plan, tmp_path, "revffn", "commas", 0, 1e-5, eval_val=False)["model"] is None
    assert plan_for(False, "builtin:smollm2", steps=500, seeds=(0, 1, 2, 3)).steps == 500
    assert not StudyPlan().converts_once("revffn")  # builtin:base: each run converts at prepare, as before
    additive = plan_for(False, "builtin:smollm2", sets=["revffn.coupling=additive"])
    assert additive.converts_once("revffn") and not additive.converts_once("full")
    rev = study._job(additive, tmp_path, "revffn", "commas", 0, 1e-5, eval_val=False)
    full = study._job(additive, tmp_path, "full", "commas", 0, 1e-5, eval_val=False)
    assert rev["model"] == str(tmp_path / "converted") and full["model"] is None
    assert worker.train_config(rev, tmp_path / "r")["model"] == str(tmp_path / "converted")
    assert worker.train_config(full, tmp_path / "f")["model"] == "builtin:smollm2"
    assert full["retention_data"] == "builtin:pydoc_text" and full["probes"] == "builtin:smollm2_probes"
    assert "revffn" not in worker.train_config(full, tmp_path / "f")


def test_set_and_lr_grid_reach_the_runs(tmp_path):
    """`--set METHOD.KEY=VALUE` lands in every run of the method, `--lr-grid` replaces its grid; bad ones are
    one-line errors naming the flag."""
    plan = plan_for(False, "builtin:smollm2", sets=["revffn.coupling=additive", "revffn.train_adapters=true",
                                                    "lora.r=4"], lr_grids=["revffn=1e-5,3e-5"])  # the committed pages'
    assert plan.options("revffn") == {"coupling": "additive", "adapter_warmup_steps": 0, "freeze_router": True,
                                      "train_adapters": True}
    assert plan.lr_grid["revffn"] == (1e-5, 3e-5) and plan.lr_grid["full"] == (1e-5, 3e-5)
    job = study._job(plan, tmp_path, "revffn", "commas", 0, 1e-5, eval_val=False)
    assert job["options"]["train_adapters"] is True and plan.options("lora")["r"] == 4
    assert plan_for(False, "builtin:smollm2", sets=["revffn.buffer_bits=4"]).options("revffn")["buffer_bits"] == 4
    for bad, flag in ((dict(sets=["lora.r=4"]), "--set 'lora.r=4'"), (dict(lr_grids=["lora=1e-3"]), "--lr-grid")):
        with pytest.raises(UserError, match=f"^{flag}.*lora is not among this study's methods \\(full, revffn\\)"):
            plan_for(False, "builtin:smollm2", methods=("full", "revffn"), **bad)
    with pytest.raises(UserError, match=r"^--set 'revffn.train_adapters=true': read only "
                                        r"with revffn.coupling=additive, .*Fix: drop it, or --set revffn.coupling="):
        plan_for(False, "builtin:smollm2", sets=["revffn.train_adapters=true"])  # (the buffered default)
    for bad, flag in ((dict(sets=["revffn.train_adapter=false"]), "--set"), (dict(sets=["revffn=1"]), "--set"),
                      (dict(sets=["nope.r=1"]), "--set"), (dict(lr_grids=["revffn=fast"]), "--lr-grid"),
                      (dict(lr_grids=["revffn=0"]), "--lr-grid")):
        with pytest.raises(UserError, match=f"^{flag} .*Fix: "):
            plan_for(False, "builtin:smollm2", **bad)


def test_the_conversion_runs_once_and_is_reused(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        manifest = json.dumps({"format": "revffn", "converted_from": cmd[4], "convert": {
            "calibration_data": cmd[cmd.index("--calibration-data") + 1],
            "calibration_tokens": int(cmd[cmd.index("--calibration-tokens") + 1]),
            "heal_steps": int(cmd[cmd.index("--heal-steps") + 1]) if "--heal-steps" in cmd else 0}})
        (out / "revffn.json").write_text(manifest)
        return subprocess.CompletedProcess(cmd, 0, manifest + "\n", "")

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    additive = ["revffn.coupling=additive"]  # the buffered coupling (the default) converts nothing
    plan = plan_for(False, "builtin:smollm2", sets=additive)
    first = study.convert_once(plan, tmp_path, log=lambda *_: None)
    again = study.convert_once(plan, tmp_path, log=lambda *_: None)
    assert len(calls) == 1 and calls[0][-9:] == ["--calibration-data", "builtin:pydoc_calibration",
                                                 "--calibration-tokens", "16384", "--eval-data", "builtin:pydoc_text",
                                                 "--device", "auto", "--json"]
    assert calls[0][2:6] == ["revffn", "convert", "builtin:smollm2", "--out"] and "additive" in calls[0]
    assert first["manifest"]["converted_from"] == "builtin:smollm2" and again["reused"]
    assert study.convert_once(replace(plan, methods=("full", "lora")), tmp_path / "none") is None
    # a conversion left by a study of another base (or a --quick one): refused, not silently reused
    for other in (plan_for(False, "builtin:smollm2-moe", sets=additive),
                  plan_for(True, "builtin:smollm2", sets=additive),
                  plan_for(False, "builtin:smollm2", heal_steps=400, sets=additive)):  # nor unhealed for a healed one
        with pytest.raises(UserError, match="holds a conversion this study did not ask for.*Fix: delete"):
            study.convert_once(other, tmp_path, log=lambda *_: None)
    assert len(calls) == 1
    # `--heal-steps N` (a GPU budget): the one conversion also heals N steps on the calibration text at lr 1e-4
    healed = study.convert_once(plan_for(False, "builtin:smollm2", heal_steps=400, sets=additive), tmp_path / "h",
                                log=print)
    assert calls[1][calls[1].index("--heal-steps"):][:6] == ["--heal-steps", "400", "--heal-data",
                                                             "builtin:pydoc_calibration", "--heal-lr", "1e-4"]
    assert healed["manifest"]["convert"]["heal_steps"] == 400
    with pytest.raises(UserError, match="^--heal-steps: only a real base"):
        plan_for(False, None, heal_steps=10)
    with pytest.raises(UserError, match="^--heal-steps 10: no method of this study.*Fix: "):
        plan_for(False, "builtin:smollm2", heal_steps=10)  # the buffered coupling: nothing to heal


def test_probes_render_and_enter_the_goal_check(tmp_path):
    plan = replace(plan_for(False, "builtin:smollm2"), seeds=(0,))
    runs = [_run(m, "commas", 0, lr, val=v) for m, lr, v in (("full", 1e-5, 0.9), ("lora", 3e-4, 0.5),
                                                              ("revffn", 1e-4, 0.4))]
    for r, probes in zip(runs, (0.95, 0.99, 0.10)):
        r["probe_accuracy"] = probes
    chosen = {"full/commas": 1e-5, "lora/commas": 3e-4, "revffn/commas": 1e-4}
    data = {"command": "revffn study --base builtin:smollm2 --out x", "plan": json.loads(json.dumps(asdict(plan))),
            "wall_s": 60, "threads": 2, "git_commit": None, "started": "now", "base_retention_loss": 3.0,
            "base_probe_accuracy": 1.0, "conversion": {"command": "revffn convert ...", "wall_s": 12.0},
            "chosen_lr": chosen, "summary": summarize(plan, runs, chosen, 3.0), "conversion_gap": [], "runs": runs}
    md = study_markdown(data)
    assert "Base: `builtin:smollm2`, retention loss 3.0000 on `builtin:pydoc_text`" in md
    assert "100.0 % of `builtin:smollm2_probes` answered" in md and "| probes % |" in md
    assert "| commas | revffn | 0.0001 (1e-05, 3e-05) | 50.0 |" in md and "| 10.0 |" in md
    assert "probes kept ≥ full's: 10.0 vs 95.0 % ✗" in "\n".join(goal_check(data))
    assert "RevFFN starts from one conversion made for the study: `revffn convert ...` (12 s)" in md


@pytest.mark.slow
@pytest.mark.real
def test_quick_study_on_the_real_base(tmp_path):
    """The smoke version on SmolLM2 end to end (about 1 min on 2 cores): three methods; RevFFN with the buffered
    default needs no conversion made for the study, and its converted model keeps the base (loss and probe)."""
    assert cli.main(["study", "--quick", "--base", "builtin:smollm2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "study.json").read_text())
    assert data["conversion"] is None and data["base_probe_accuracy"] == 1.0
    assert [r["method"] for r in data["summary"]] == ["full", "lora", "revffn"]
    assert all(r["probe_accuracy"]["n"] == 1 for r in data["summary"])
    gap = data["conversion_gap"][0]
    assert gap["coupling"] == "buffered" and gap["converted_probes"] == 1.0
    assert abs(gap["converted_init"] - data["base_retention_loss"]) < 0.05  # (the additive coupling's: +1.8 nats)


def test_both_distillation_teachers_run_as_gap_variants_and_render_with_their_memory(tmp_path):
    """The stage-2 guard by each teacher route (issue 26: a frozen copy against the cached final states and the
    head) is a conversion-gap variant of the same run; its row shows the route, peak memory and tokens/s."""
    plan = StudyPlan(methods=("revffn",), tasks=("gsm",), seeds=(0,))
    grid = [{"name": "revffn-gsm-s0-lr0.0001", "method": "revffn", "task": "gsm", "seed": 0, "lr": 1e-4}]
    jobs, names = study.gap_plan(plan, tmp_path, grid, {"revffn/gsm": 1e-4})
    options = {label: job["options"] for (_, _, label), job in zip(list(names)[1:], jobs)}
    assert options["distill-1"]["distill_coef"] == options["distill-1-cached"]["distill_coef"] == 1.0
    assert options["distill-1-cached"]["distill_teacher"] == "cached" and "distill_teacher" not in options["distill-1"]
    runs = [{**_run("revffn", "gsm", 0, 1e-4), "name": grid[0]["name"], "stage1_retention_loss": 2.1,
             "job": {**grid[0], "options": plan.options("revffn")}}]
    for i, job in enumerate(jobs):
        runs.append({**_run("revffn", "gsm", 0, 1e-4), "name": job["name"], "job": job, "stage1_retention_loss": 2.1,
                     "converted_retention_loss": 2.3, "peak_mem_bytes": (200 + i) * 2 ** 20, "tokens_per_s": 50.0 + i})
    gap = study.gap_rows(names, runs, 2.0)
    by_label = {g["variant"]: g for g in gap}
    assert by_label["distill-1-cached"]["peak_mem_bytes"] == (200 + len(jobs) - 1) * 2 ** 20
    data = {"command": "revffn study --out x", "plan": json.loads(json.dumps(asdict(plan))), "wall_s": 60,
            "threads": 2, "git_commit": None, "started": "now", "base_retention_loss": 2.0,
            "chosen_lr": {"revffn/gsm": 1e-4}, "summary": summarize(plan, runs[:1], {"revffn/gsm": 1e-4}, 2.0),
            "conversion_gap": gap, "runs": runs}
    md = study_markdown(data)
    last = len(jobs) - 1
    assert f"| 1 (cached) | 2.0000 | 2.3000 | 2.1000 | 2.0000 | 50.0 | {200 + last} | {50 + last} |" in md
    assert "| 1 (copy) |" in md and "| peak mem MiB | tokens/s |" in md


def test_buffered_gap_rows_carry_the_bits_and_momentum_they_ran_with(tmp_path):
    """A buffered row records its bit count and momentum sign, defaults resolved at study time (a later default
    does not relabel it), and the table shows them; a row from before the keys renders without the sign."""
    from revffn.reversible.buffered import DEFAULT_BUFFER_BITS, DEFAULT_MOMENTUM

    names, runs = {}, []
    for label, options in (("default", {"coupling": "buffered"}),
                           ("negative", {"coupling": "buffered", "buffer_momentum": "negative", "buffer_bits": 4})):
        name = f"revffn-gsm-{label}"
        names[("revffn", "gsm", label)] = name
        run = _run("revffn", "gsm", 0, 1e-4)
        runs.append({**run, "name": name, "stage1_retention_loss": 2.1, "job": {**run["job"], "options": options}})
    gap = study.gap_rows(names, runs, 2.0)
    assert [(g["buffer_bits"], g["buffer_momentum"]) for g in gap] == [(DEFAULT_BUFFER_BITS, DEFAULT_MOMENTUM),
                                                                       (4, "negative")]
    plan = StudyPlan(methods=("revffn",), tasks=("gsm",), seeds=(0,))
    data = {"command": "revffn study --out x", "plan": json.loads(json.dumps(asdict(plan))), "wall_s": 60,
            "threads": 2, "git_commit": None, "started": "now", "base_retention_loss": 2.0,
            "chosen_lr": {"revffn/gsm": 1e-4}, "summary": summarize(plan, runs[:1], {"revffn/gsm": 1e-4}, 2.0),
            "conversion_gap": [*gap, {**gap[1], "variant": "old"}], "runs": runs}
    del data["conversion_gap"][2]["buffer_momentum"]
    md = study_markdown(data)
    assert f"| default | none (buffered, {DEFAULT_BUFFER_BITS} bits, {DEFAULT_MOMENTUM} momentum) |" in md
    assert "| negative | none (buffered, 4 bits, negative momentum) |" in md
    assert "| old | none (buffered, 4 bits) |" in md

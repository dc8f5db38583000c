"""`revffn bench`: outputs and their keys, failed methods as rows, rendering from JSON, sweeps."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from revffn import cli
from revffn.reports import bench
from revffn.reports.bench import BenchSpec, resolve, run_bench, worker_args
from revffn.reports.render.bench import bench_markdown, ranks_markdown, write_bench
from revffn.reports.workers import bench as bench_worker
from tests.reports import late_rank_worker

pytestmark = pytest.mark.integration  # subprocess runs (CLI, workers)

ROW_KEYS = ("method", "status", "peak_mem_bytes", "activation_bytes", "routing_record_bytes", "trainable_params",
            "grad_bytes", "optimizer_state_bytes", "tokens_per_s", "param_bytes", "static_bytes",
            "est_static_bytes", "est_activation_bytes")


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    """One real bench (a fresh process per method); dora's worker is made to fail (tests/reports/fault_worker.py)."""
    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "WORKER_MODULE", "tests.reports.fault_worker")
        rc = cli.main(["bench", "--model", "tiny-qwen2-moe", "--methods", "full,revffn,lora,dora", "--layers", "2",
                       "--batch", "2", "--seq", "32", "--steps", "1", "--out", str(out)])
    assert rc == 1  # a method failed; the others were still measured and written
    return out


def test_bench_writes_json_markdown_plot_with_the_keys(bench_dir):
    assert {p.name for p in bench_dir.iterdir()} >= {"bench.json", "bench.md", "bench.png"}
    data = json.loads((bench_dir / "bench.json").read_text())
    info, meta = data["run_info"], data["meta_info"]
    assert info["command"].startswith("revffn bench --model tiny-qwen2-moe")
    assert info["args"]["layers"] == 2 and info["args"]["device"] == "cpu" and info["args"]["dtype"] == "float32"
    assert "git_commit" in info
    for key in ("torch", "transformers", "peft", "python", "cpu", "torch_threads"):
        assert meta[key], key
    rows = {r["method"]: r for r in data["results"]}
    assert list(rows) == ["full", "revffn", "lora", "dora"]
    for m in ("full", "revffn", "lora"):
        r = rows[m]
        assert r["status"] == "ok", r
        for key in ROW_KEYS:
            assert key in r, (m, key)
        assert r["peak_mem_bytes"] > 0 and r["tokens_per_s"] > 0 and r["geometry"]["num_hidden_layers"] == 2
        assert r["static_bytes"] == pytest.approx(r["est_static_bytes"], rel=0.15)
        assert r["activation_bytes"] == pytest.approx(r["est_activation_bytes"], rel=0.15)
    assert rows["revffn"]["activation_bytes"] < rows["full"]["activation_bytes"] / 4
    # the buffered default records no routing choices: its backward rebuilds each layer's input bitwise, so the
    # recompute makes the forward's choices itself (the additive coupling's records: tests/memory/test_saved_bytes.py)
    assert rows["revffn"]["routing_record_bytes"] == 0
    assert rows["full"]["routing_record_bytes"] == 0
    assert rows["lora"]["trainable_params"] < rows["full"]["trainable_params"] / 2
    md = (bench_dir / "bench.md").read_text()
    assert "| revffn | ok |" in md and "÷ full" in md


def test_a_failed_method_is_a_row_and_the_others_are_ok(bench_dir):
    data = json.loads((bench_dir / "bench.json").read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert rows["dora"]["status"] == "error" and "injected fault" in rows["dora"]["error"]
    assert "est_static_bytes" in rows["dora"]  # the estimate is there even when the run failed
    assert all(rows[m]["status"] == "ok" for m in ("full", "revffn", "lora"))
    md = (bench_dir / "bench.md").read_text()
    assert "| dora | error |" in md and "Failed:" in md and "injected fault" in md


def test_render_from_json_alone_reproduces_the_markdown(bench_dir, tmp_path):
    shutil.copy(bench_dir / "bench.json", tmp_path / "bench.json")
    assert cli.main(["bench", "--render", str(tmp_path)]) == 0
    assert (tmp_path / "bench.md").read_text() == (bench_dir / "bench.md").read_text()
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert cli.main(["bench", "--render", str(tmp_path / "nothing")]) == 2


def test_parent_survives_killed_garbage_and_hanging_workers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "WORKER_MODULE", "tests.reports.fake_worker")
    spec = resolve(BenchSpec("tiny-qwen2-moe", ["full", "revffn", "lora", "dora"], layers=1, batch=1, seq=8,
                             timeout=3))
    data = run_bench(spec, ["bench"])
    rows = {r["method"]: r for r in data["results"]}
    assert rows["revffn"]["status"] == "ok" and rows["revffn"]["static_bytes"] == 4000
    assert rows["full"]["status"] == "error" and "signal 9" in rows["full"]["error"]
    assert rows["lora"]["status"] == "error" and "exit code 1" in rows["lora"]["error"] and "boom" in rows["lora"][
        "error"]
    assert rows["dora"]["status"] == "error" and "timed out" in rows["dora"]["error"]
    err = capsys.readouterr().err
    assert "[2/4 runs, 50%] revffn ... ok" in err and "[4/4 runs, 100%] dora ... error" in err
    write_bench(data, tmp_path)
    md = bench_markdown(data)
    assert "Failed:" in md and all(f"| {m} | error |" in md for m in ("full", "lora", "dora"))


@pytest.mark.parametrize("method, loaded", [("lora", True), ("full", False), ("revffn", False)])
def test_a_worker_loads_peft_before_its_baseline_only_for_the_methods_that_use_it(method, loaded):
    """A LoRA worker's memory baseline is taken with peft loaded (its peak counts its tensors, not peft's code); a
    worker of a method that never uses peft does not load it (its start-up is what `revffn train`'s is). Every
    worker has transformers' model classes loaded by then (lazy in transformers: else inside the timed start-up), the
    model's own module and transformers' table of checkpoint conversions (`load_library`)."""
    import subprocess
    import sys

    code = ("import json, sys; import transformers.conversion_mapping as cm; "
            "from revffn.reports.workers import bench as w; "
            "w.current_rss_bytes = lambda: print('baseline', 'peft' in sys.modules, "
            "'transformers.modeling_utils' in sys.modules, "
            "'transformers.models.qwen2_moe.modeling_qwen2_moe' in sys.modules, "
            "cm._checkpoint_conversion_mapping_cache is not None) or 0; "
            "w.run = lambda args, baseline: {'method': args['method']}; "
            f"w.main([json.dumps({{'model': 'tiny-qwen2-moe', 'method': '{method}'}})]); "
            "print('end', 'peft' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"baseline {loaded} True True True" in out.stdout and f"end {loaded}" in out.stdout
    row = json.loads(out.stdout.splitlines()[-2])
    assert row["library_s"] > 0


def test_a_worker_of_an_unknown_method_prints_an_error_row():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "revffn.reports.workers.bench",
                          json.dumps({"model": "tiny-qwen2-moe", "method": "nosuch", "batch": 1, "seq": 8})],
                         capture_output=True, text=True, timeout=120)
    row = json.loads(out.stdout)
    assert out.returncode == 0 and row["status"] == "error" and "unknown method 'nosuch'" in row["error"]


@pytest.mark.parametrize("error", [MemoryError, torch.OutOfMemoryError])
def test_out_of_memory_is_its_own_status(monkeypatch, error):
    def out_of_memory(run, step, *args, **kwargs):
        raise error(f"injected out-of-memory at step {step}")

    monkeypatch.setattr(bench_worker, "train_step", out_of_memory)
    spec = resolve(BenchSpec("tiny-qwen2-moe", ["full"], layers=1, batch=1, seq=8))
    row = bench_worker.run(worker_args(spec, "full"))
    assert row["status"] == "oom" and error.__name__ in row["error"] and "injected" in row["error"]
    assert set(row) == {"method", "status", "error", "wall_s"}  # no half-measured fields


@pytest.mark.slow  # ~1 min; the bench's CPU path is tested above, the sweep over layers by -m slow
def test_sweep_over_layers_on_a_config_only_preset(tmp_path):
    """The Qwen1.5-MoE-A2.7B geometry (random init), narrowed: the CPU path of scripts/gpu_bench.sh."""
    rc = cli.main(["bench", "--model", "qwen1.5-moe-a2.7b", "--hidden", "64", "--methods", "full,revffn",
                   "--batch", "1", "--seq", "16", "--steps", "1", "--dtype", "bfloat16", "--sweep", "layers=1,2",
                   "--out", str(tmp_path)])
    assert rc == 0
    assert {p.name for p in tmp_path.iterdir()} >= {"sweep.json", "sweep.md", "sweep.png"}
    data = json.loads((tmp_path / "sweep.json").read_text())
    assert data["sweep"] == {"variable": "layers", "values": [1, 2]}
    acts = {(r["method"], r["value"]): r["activation_bytes"] for r in data["results"] if r["status"] == "ok"}
    assert len(acts) == 4
    assert acts["revffn", 2] <= 1.05 * acts["revffn", 1]
    assert acts["full", 2] > 1.5 * acts["full", 1]
    records = {r["value"]: r["routing_record_bytes"] for r in data["results"] if r["method"] == "revffn"}
    assert records == {1: 0, 2: 0}  # the buffered default replays no choices (the additive one: one byte each)
    md = (tmp_path / "sweep.md").read_text()
    assert "layers=2" in md and "revffn routing records" in md


def test_repeat_runs_each_method_in_fresh_processes_and_the_page_says_medians(tmp_path):
    rc = cli.main(["bench", "--model", "tiny-qwen2-moe", "--methods", "full", "--layers", "1", "--hidden", "32",
                   "--batch", "1", "--seq", "8", "--steps", "1", "--threads", "1", "--repeat", "2",
                   "--out", str(tmp_path)])
    assert rc == 0
    (row,) = json.loads((tmp_path / "bench.json").read_text())["results"]
    loads = [r["load_s"] for r in row["repeats"]]
    assert row["status"] == "ok" and len(loads) == 2 and row["load_s"] == pytest.approx(sum(loads) / 2)
    assert "each figure the median of 2 runs" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("argv", [["--methods", "full,fulll"], ["--sweep", "depth=1,2"], ["--sweep", "layers=0"],
                                  ["--model", "tiny-nope"], ["--dtype", "float16"], ["--set", "lora.r=0"]])
def test_bad_input_exit_2(tmp_path, argv, capsys):
    assert cli.main(["bench", "--out", str(tmp_path), "--layers", "1", *argv]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


def test_nproc_2_under_fsdp_halves_what_each_rank_holds(tmp_path, monkeypatch):
    """Two torchrun ranks (FSDP2, gloo): each holds about half the parameters, gradients and AdamW states
    of one process (sharded along dim 0, so not exactly half), for full and revffn alike. Rank 1 joins the
    process group 3 s after rank 0 (tests/reports/late_rank_worker.py): rank 0's start-up does not count the wait."""
    monkeypatch.setattr(bench, "WORKER_MODULE", "tests.reports.late_rank_worker")
    monkeypatch.setenv("REVFFN_TEST_JOINING", str(tmp_path / "joining"))
    rc = cli.main(["bench", "--model", "tiny-qwen2-moe", "--methods", "full,revffn", "--layers", "2", "--hidden", "64",
                   "--batch", "1", "--seq", "16", "--steps", "1", "--threads", "1", "--nproc", "2", "--out",
                   str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["run_info"]["args"]["nproc"] == 2 and data["run_info"]["args"]["distributed"] == "fsdp"
    for r in data["results"]:
        one = r["one_process"]
        assert r["status"] == one["status"] == "ok", r
        assert [x["rank"] for x in r["ranks"]] == [0, 1] and all(x["world_size"] == 2 for x in r["ranks"])
        for x in r["ranks"]:
            assert 0.4 < x["static_bytes"] / one["static_bytes"] < 0.6, (r["method"], x["rank"])
            assert x["static_vs_one_process"] == x["static_bytes"] / one["static_bytes"]
            assert x["peak_mem_bytes"] > 0
        assert r["static_bytes"] == max(x["static_bytes"] for x in r["ranks"])
        assert r["static_bytes"] == pytest.approx(r["est_static_bytes"], rel=0.05)  # estimate --distributed fsdp
        for x in [one, *r["ranks"]]:  # start-up: the process's peak RSS until ready (imports included), its time
            assert x["load_peak_rss_bytes"] >= x["baseline_rss_bytes"] and x["load_s"] > 0, x
        assert r["load_peak_rss_bytes"] == max(x["load_peak_rss_bytes"] for x in r["ranks"])
        assert r["load_s_vs_one_process"] == r["load_s"] / one["load_s"]
        # the start-up's clock starts once every rank has joined: the rendezvous is timed apart, 0 in one process
        early, late = r["ranks"]
        assert one["rendezvous_s"] == 0.0 and early["rendezvous_s"] >= late_rank_worker.LATE_S > late["rendezvous_s"]
        assert early["load_s"] < one["load_s"] + late_rank_worker.LATE_S / 2  # half the work, without the wait
        assert r["rendezvous_s"] == max(x["rendezvous_s"] for x in r["ranks"])
    md = (tmp_path / "bench.md").read_text()
    assert "2 ranks (fsdp)" in md and "| full | ok |" in md and "| revffn | ok |" in md and "÷ 1 process" in md
    assert "### Start-up per rank" in md and "rendezvous s per rank" in md
    for r in data["results"]:  # as --repeat 2 leaves them: each run's start-up, its slowest rank's
        r["repeats"] = [{"load_s": 9.0, "ranks": [{"load_s": 0.5}, {"load_s": 0.7}]}, {"ranks": [{"load_s": 0.4}]}]
        r["one_process"]["repeats"] = [{"load_s": 1.0}, {"load_s": 3.0}]
    assert "full: 1 process 1.00, 3.00 s, per rank (max) 0.70, 0.40 s; revffn:" in ranks_markdown(data)


def test_a_failed_rank_fails_the_row_and_names_the_rank():
    ok = {"method": "full", "status": "ok", "peak_mem_bytes": 10, "tokens_per_s": 5.0, "param_bytes": 4}
    row = bench.combine_ranks("full", [{**ok, "rank": 0}, {"rank": 1, "status": "error", "error": "exit code 1"}])
    assert row["status"] == "error" and row["error"] == "rank 1: exit code 1" and len(row["ranks"]) == 2
    row = bench.combine_ranks("full", [{**ok, "rank": 0}, {**ok, "rank": 1, "peak_mem_bytes": 12}])
    assert row["status"] == "ok" and row["peak_mem_bytes"] == 12 and row["tokens_per_s"] == 10.0
    assert "rank" not in row and [x["rank"] for x in row["ranks"]] == [0, 1]


def test_repeat_keeps_each_figure_s_median_rank_by_rank_and_a_failed_run_fails_the_row():
    """--repeat 3: each figure is the median of the three runs' (each rank's apart; the row's max over ranks then of
    those medians, not the median of each run's max), every run's timings kept; a failed run is the row."""
    def rank(r, load_s, tokens):
        return {"rank": r, "status": "ok", "load_s": load_s, "tokens_per_s": tokens, "peak_mem_bytes": 10 + r,
                "loading": "sharded"}

    def run(loads, tokens, process_s):
        return {"method": "full", "status": "ok", "process_s": process_s,
                "ranks": [rank(0, loads[0], tokens[0]), rank(1, loads[1], tokens[1])]}

    runs = [run((1.0, 5.0), (4.0, 1.0), 30.0), run((2.0, 0.5), (6.0, 3.0), 10.0), run((9.0, 1.0), (5.0, 2.0), 20.0)]
    row = bench.repeated(runs, "full")
    assert [x["load_s"] for x in row["ranks"]] == [2.0, 1.0] and row["load_s"] == 2.0  # each run's max: 5, 2, 9
    assert row["tokens_per_s"] == 5.0 + 2.0 and row["peak_mem_bytes"] == 11 and row["process_s"] == 20.0
    assert row["ranks"][0]["loading"] == "sharded" and row["status"] == "ok"
    assert [r["ranks"][1]["load_s"] for r in row["repeats"]] == [5.0, 0.5, 1.0]
    one = [{"method": "full", "status": "ok", "load_s": v, "loading": "whole"} for v in (3.0, 1.0, 2.0)]
    assert bench.repeated(one, "full")["load_s"] == 2.0
    failed = {"method": "full", "status": "error", "error": "rank 1: exit code 1"}
    assert bench.repeated([runs[0], failed, runs[2]], "full") == failed


def test_repeat_measures_the_one_process_and_the_ranks_in_turn(monkeypatch):
    """--repeat with --nproc: one process, ranks, one process, ranks, ... (a drift in the machine's speed meets
    both), each row the medians of its own runs, the ratio theirs."""
    calls = []

    def runner(args, timeout):
        calls.append(args["nproc"])
        i = len(calls)
        row = {"status": "ok", "param_bytes": 8, "grad_bytes": 0, "optimizer_state_bytes": 0, "peak_mem_bytes": 4,
               "load_peak_rss_bytes": 4, "load_s": float(i), "process_s": 1.0}
        if args["nproc"] == 1:
            return {**row, "method": "full"}
        half = {**row, "param_bytes": 4, "load_s": i / 10}
        return {**half, "method": "full", "ranks": [{**half, "rank": 0}, {**half, "rank": 1}]}

    monkeypatch.setattr(bench, "estimate_fields", lambda args: {})
    spec = BenchSpec("tiny-qwen2-moe", ["full"], batch=1, seq=8, steps=1, device="cpu", dtype="float32", nproc=2,
                     distributed="fsdp", repeat=3)
    row = bench.measure(spec, "full", runner)
    assert calls == [1, 2, 1, 2, 1, 2]
    assert row["one_process"]["load_s"] == 3.0 and row["load_s"] == 0.4  # the medians of 1, 3, 5 and .2, .4, .6
    assert row["load_s_vs_one_process"] == pytest.approx(0.4 / 3.0) and row["static_vs_one_process"] == 0.5


@pytest.mark.parametrize("argv", [["--nproc", "2", "--distributed", "none"],  # (--nproc 0: argparse, test_fault_suite)
                                  ["--nproc", "2", "--distributed", "fsdpp"], ["--distributed", "ddp"],
                                  ["--nproc", "2", "--methods", "hift"],
                                  ["--nproc", "2", "--methods", "full", "--sweep", "layers=1,2"]])
def test_bad_nproc_or_strategy_exit_2_with_a_fix(tmp_path, argv, capsys):
    assert cli.main(["bench", "--out", str(tmp_path), "--layers", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err and "Fix:" in err, err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_a_bench_json_the_disk_cannot_take_leaves_the_previous_one(tmp_path):
    """bench.json is written whole or not at all: under a file-size limit it used to be cut at the limit."""
    (tmp_path / "bench.json").write_text('{"previous": true}\n')
    code = ("import resource, sys; from pathlib import Path; from revffn.reports.render.bench import write; "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024)); "
            f"write({{'rows': ['x' * 4096]}}, Path({str(tmp_path)!r}), 'bench')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "File too large" in proc.stderr, proc.stderr[-1000:]
    assert (tmp_path / "bench.json").read_text() == '{"previous": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]

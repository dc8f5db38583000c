"""The registry is the one list of methods: a method registered only by a test module
(`tests/methods/toy_method.py`) shows up in `revffn estimate`, `revffn bench` and `revffn study`, and
its memory terms agree with what the bench measures. Nothing else names it."""

import json
import sys

import pytest

from revffn import cli
from revffn.memory.estimate import count_params
from revffn.methods import METHODS, method_class
from revffn.models.loading import config_overrides, hf_config
from revffn.reports import bench
from revffn.reports.study import StudyPlan, plan_for, quick_plan
from tests.memory.test_estimate_agreement import CASES, check_agreement
from tests.methods.toy_method import ToyMethod

METHODS.pop(ToyMethod.name)  # registered on import (what a worker process needs); the `toy` fixture adds it back
MODULE = "tests.methods.toy_method"


@pytest.fixture
def toy(monkeypatch):
    """`toy` in the registry for one test only."""
    monkeypatch.setitem(METHODS, ToyMethod.name, ToyMethod)
    return ToyMethod


def test_unregistered_it_is_unknown_everywhere(capsys):
    assert "toy" not in METHODS
    assert cli.main(["estimate", "--model", "tiny-qwen2-moe", "--method", "toy"]) == 2
    assert "unknown method 'toy'" in capsys.readouterr().err
    assert "toy" not in StudyPlan().methods and "toy" not in quick_plan().methods
    with pytest.raises(Exception, match="'toy' not in the study"):
        plan_for(True, methods=("toy",))


@pytest.mark.integration
def test_a_worker_process_finds_it_through_its_module(toy, monkeypatch):
    """What a fresh worker process does: it knows only the name and the module, and imports the module."""
    monkeypatch.delitem(METHODS, "toy")
    monkeypatch.delitem(sys.modules, MODULE)
    cls = method_class("toy", MODULE)
    assert cls.name == "toy" and cls.__module__ == MODULE and METHODS["toy"] is cls


def test_revffn_estimate_method_toy(toy, capsys):
    argv = ["estimate", "--model", "tiny-qwen2-moe", "--method", "toy", "--batch", "2", "--seq", "64",
            "--dtype", "float32", "--json"]
    assert cli.main(argv) == 0
    est = json.loads(capsys.readouterr().out)
    assert cli.main([*argv[:4], "full", *argv[5:]]) == 0
    full = json.loads(capsys.readouterr().out)
    counts = count_params(hf_config("tiny-qwen2-moe", **config_overrides("tiny-qwen2-moe", None, None)))
    assert est["method"] == "toy" and "toy: full fine-tuning, input embedding frozen" in est["notes"]
    assert est["trainable_params"] == full["trainable_params"] - counts["embed"]
    assert est["activations"] < full["activations"] and est["total"] < full["total"]
    assert cli.main([*argv, "--option", "r=4"]) == 2  # its estimate_keys() (none) are what it accepts
    allowed = "Fix: one of attn_implementation, loss, offload, optimizer, optimizer_in_backward, padded."
    assert allowed in capsys.readouterr().err


def test_its_estimate_agrees_with_the_bench(toy):
    check_agreement("toy", [CASES[0], CASES[-1]])  # fp32 and bf16


@pytest.mark.integration
def test_revffn_bench_methods_toy(toy, tmp_path, capsys):
    """Each bench method runs in a real worker process, which imports the toy's module to see it."""
    assert bench.worker_args(bench.resolve(bench.BenchSpec("tiny-qwen2-moe", ["toy"], layers=1)), "toy")[
        "method_module"] == MODULE
    assert cli.main(["bench", "--model", "tiny-qwen2-moe", "--methods", "full,toy", "--layers", "2", "--batch", "2",
                     "--seq", "32", "--steps", "1", "--out", str(tmp_path)]) == 0
    rows = {r["method"]: r for r in json.loads((tmp_path / "bench.json").read_text())["results"]}
    assert list(rows) == ["full", "toy"] and rows["toy"]["status"] == "ok"
    embed = count_params(hf_config("tiny-qwen2-moe", **config_overrides("tiny-qwen2-moe", 2, None)))["embed"]
    assert rows["toy"]["trainable_params"] == rows["full"]["trainable_params"] - embed
    assert rows["toy"]["est_trainable_params"] == rows["toy"]["trainable_params"]
    assert rows["toy"]["static_bytes"] == pytest.approx(rows["toy"]["est_static_bytes"], rel=0.01)
    assert "| toy | ok |" in (tmp_path / "bench.md").read_text()


@pytest.mark.integration
def test_revffn_study_methods_toy(toy, tmp_path, capsys):
    """Its LR grid puts it in the study; the quick study runs it in a real worker process, which
    imports `tests.methods.toy_method` (the job's `method_module`) to see it."""
    assert StudyPlan().methods[-1] == "toy" and StudyPlan().lr_grid["toy"] == (5e-4,)
    assert "toy" in quick_plan().methods
    assert cli.main(["study", "--quick", "--methods", "toy", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "study.json").read_text())
    (run,) = data["runs"]
    assert run["status"] == "ok" and run["job"]["method_module"] == MODULE and run["name"] == "toy-commas-s0-lr0.0001"
    assert [r["method"] for r in data["summary"]] == ["toy"] and data["conversion_gap"] == []
    manifest = json.loads((tmp_path / "runs" / run["name"] / "final" / "revffn.json").read_text())
    assert manifest["method"] == "toy"

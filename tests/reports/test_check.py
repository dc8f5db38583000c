"""`revffn check`'s gradient metric: relative per parameter, its denominator floored at 1e-3 x the
largest parameter-gradient norm, so a gradient that is zero up to rounding passes and a real error fails."""

import pytest
import torch

from revffn.models.tiny_any import tiny_model_for
from revffn.reports import check

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


def test_grad_error_floors_near_zero_gradients_only():
    g = {"big": torch.ones(100), "zero_up_to_rounding": torch.full((4,), 1e-10)}
    noise = {"big": g["big"].clone(), "zero_up_to_rounding": torch.full((4,), -1e-10)}
    assert check.grad_error(g, noise)[0] < 1e-6  # 4e-10 against the floor 1e-3 * 10
    wrong = {"big": g["big"] * 1.01, "zero_up_to_rounding": g["zero_up_to_rounding"]}
    assert check.grad_error(g, wrong) == (pytest.approx(0.01, rel=1e-3), "big")
    assert check.grad_error(g, {"big": g["big"]}) == (float("inf"), "zero_up_to_rounding")
    assert check.grad_error(g, {**g, "big": torch.full((100,), float("nan"))})[1] == "big"


def _hunyuan_dir(tmp_path, **stochastic):
    """hunyuan_v1_moe is top-1 with renormalised weights: its router gradient is zero up to rounding."""
    hf = tiny_model_for("hunyuan_v1_moe", stochastic=stochastic or 0.0)
    assert hf.config.moe_topk == 1
    hf.save_pretrained(tmp_path)
    return str(tmp_path)


def test_a_top1_router_does_not_fail_the_check_but_a_real_error_does(tmp_path, monkeypatch):
    path = _hunyuan_dir(tmp_path, attention_dropout=0.1)
    report = check.run_check(model=path, layers=2, seq=16)
    assert report["passed"], report
    assert report["max_rel_grad_error"] < check.TOL["max_rel_grad_error"]

    monkeypatch.setattr(check, "GRAD_FLOOR", 0.0)  # the unfloored metric judges the router on its noise
    unfloored = check.run_check(model=path, layers=2, seq=16)
    assert not unfloored["passed"] and ".mlp.gate." in unfloored["worst_param"], unfloored["worst_param"]
    monkeypatch.undo()

    convert = check.convert

    def convert_without_rng_replay(*args, **kwargs):  # the dropout is then redrawn in backward: wrong
        model = convert(*args, **kwargs)
        model.debug.rng_replay = False
        return model

    monkeypatch.setattr(check, "convert", convert_without_rng_replay)
    wrong = check.run_check(model=path, layers=2, seq=16)
    assert not wrong["passed"] and wrong["max_rel_grad_error"] > 1e-2, wrong["max_rel_grad_error"]


def test_large_activations_are_judged_with_fp64_streams(tmp_path):
    """A model whose streams reach ~1e4 (a real model's massive activations, scaled up) rounds in fp32 by more
    than the absolute tolerance; fp64 streams show the math exact, and decide."""
    import transformers

    from revffn.reports.check import TOL, run_check

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(1e5)
        for layer in m.model.layers:
            layer.mlp.down_proj.weight.mul_(1e5)
    m.save_pretrained(tmp_path / "big")
    r = run_check(str(tmp_path / "big"), seq=64)
    assert r["max_reconstruction_error"] > TOL["max_reconstruction_error"]  # fp32 rounding alone fails it
    assert r["fp64_streams"]["max_reconstruction_error"] <= TOL["max_reconstruction_error"]
    assert r["fp64_streams"]["max_rel_grad_error"] <= TOL["max_rel_grad_error"]
    assert r["passed"]


def test_a_check_beyond_the_free_memory_exits_2_naming_what_to_shrink(monkeypatch, capsys):
    """Past the host's memory the OOM killer ended `revffn check` without a word (`--seq 100000`: 151 GiB of
    attention). It now exits 2 first, naming the part to shrink: the sequence, or the model."""
    from revffn.cli import main

    monkeypatch.setattr("revffn.memory.measure.free_memory_bytes", lambda device: 2**30)
    assert main(["check", "--seq", "16384"]) == 2
    err = capsys.readouterr().err
    assert "--batch 2 --seq 16384: the check" in err and "1.0 GiB are free in host memory" in err, err
    assert "Fix: a smaller --seq or --batch." in err
    assert main(["check", "--model", "qwen1.5-moe-a2.7b"]) == 2  # 14 B parameters, fp32, twice
    assert "Fix: fewer --layers or a smaller --hidden." in capsys.readouterr().err


@pytest.mark.integration
def test_the_checks_memory_floor_is_below_what_it_takes(tmp_path):
    """`check_bytes` is a floor (what it refuses surely does not fit): a fresh process's peak RSS rise over the
    check is above it, where the attention's activations dominate and where the weights do."""
    import subprocess
    import sys

    script = ("import json, sys\n"
              "from revffn.memory.measure import current_rss_bytes, peak_rss_bytes, reset_rss_peak\n"
              "from revffn.reports.check import check_bytes, run_check\n"
              "for seq in (64, 1536):\n"
              "    base = current_rss_bytes(); reset_rss_peak()\n"
              "    assert run_check(seq=seq)['passed']\n"
              "    print(json.dumps([sum(check_bytes('tiny-qwen2-moe', None, None, 'float32', 2, seq)), "
              "peak_rss_bytes() - base]))\n")
    env = {**__import__("os").environ, "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed blocks leave the RSS
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [__import__("json").loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 2 and rows[1][0] > 4 * rows[0][0], rows  # the long one is the attention's
    assert all(0 < floor <= rise for floor, rise in rows), rows


def test_a_figure_over_tolerance_that_fp64_streams_clear_says_so_on_its_line():
    from revffn.reports.check import format_report

    report = {"model": "m", "model_type": "qwen2_moe", "layers": 4, "dtype": "float32", "batch": 2, "seq": 32,
              "adapter_init": "coordinate", "stream_dtype": "float32", "max_rel_grad_error": 2.1e-4,
              "max_reconstruction_error": 5e-5, "passed": True,
              "fp64_streams": {"max_reconstruction_error": 0.0, "max_rel_grad_error": 1.3e-6}}
    lines = format_report(report).splitlines()
    grad = next(line for line in lines if "max_rel_grad_error" in line and "fp64 streams" not in line)
    assert grad.endswith("(tolerance 1e-05: over by the fp32 streams' rounding, judged in fp64 below)")
    rebuilt = next(line for line in lines if "max_reconstruction_error" in line and "fp64 streams" not in line)
    assert rebuilt.endswith("(tolerance 0.0001)") and lines[-1] == "  PASSED"  # within it: said as before

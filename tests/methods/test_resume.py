"""Adapter methods resume exactly from a checkpoint (adapters, shared factors and AdamW state restored).

HiFT's kill -9 resume is in test_hift.py; here a copy of a finished run resumes from its step-3
checkpoint, in-process, and must reproduce the losses of steps 4..6.
"""

from __future__ import annotations

import shutil

import pytest

from revffn.cli import main
from tests.methods._util import CONFIGS, metrics

COMMON = ["max_steps=6", "save_steps=3", "eval_data=null", "per_device_train_batch_size=4", "max_seq_length=32",
          "dtype=float32", "device=cpu"]


@pytest.mark.parametrize("name,extra", [("lora", ["lora.include_router=true"]), ("dora", []), ("refta", [])])
def test_resume_reproduces_losses(name, extra, tmp_path):
    cfg = str(CONFIGS / f"tiny_{name}.yaml")
    assert main(["train", cfg, *COMMON, *extra, f"output_dir={tmp_path / 'ref'}"]) == 0
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step-3"]
    assert main(["train", cfg, *COMMON, *extra, f"output_dir={tmp_path / 'run'}", "resume=true"]) == 0
    ref = {r["step"]: r["loss"] for r in metrics(tmp_path / "ref")}
    resumed = {r["step"]: r["loss"] for r in metrics(tmp_path / "run")}
    assert sorted(resumed) == list(range(1, 7))
    for s, loss in resumed.items():
        assert abs(loss - ref[s]) <= 1e-6, (s, loss, ref[s])

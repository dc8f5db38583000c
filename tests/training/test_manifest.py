"""Checkpoint manifests: every file hashed, verification names the bad file, and the rule for which config
keys a resume may change (`config.math_config`)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import revffn
from revffn.training.config import RESUME_MAY_CHANGE, load_config, math_config
from revffn.training.manifest import config_sha256, read_manifest, verify_checkpoint
from revffn.training.setup import resolve_resume
from tests.training._util import TINY, flip_byte


def test_manifest_lists_every_file_with_config_and_versions(trained_run):
    ckpt = trained_run / "checkpoints" / "step-1"
    manifest = read_manifest(ckpt)
    assert sorted(manifest["files"]) == ["config.yaml", "model.safetensors", "optimizer.pt", "rng.pt",
                                         "trainer_state.json"]
    assert manifest["config_sha256"] == config_sha256(manifest["config"])
    assert manifest["config"]["method"] == "revffn" and manifest["config"]["revffn.adapter_warmup_steps"] == 1
    assert manifest["versions"] == {"revffn": revffn.__version__, "torch": torch.__version__,
                                    "transformers": __import__("transformers").__version__}
    assert verify_checkpoint(ckpt) is None


@pytest.mark.parametrize("damage,needle", [
    (lambda c: flip_byte(c / "model.safetensors"), "model.safetensors: sha256 mismatch, expected "),
    (lambda c: flip_byte(c / "optimizer.pt", 100), "optimizer.pt: sha256 mismatch"),
    (lambda c: (c / "config.yaml").write_text("model: other\n"), "config.yaml: sha256 mismatch"),
    (lambda c: (c / "rng.pt").unlink(), "rng.pt: missing"),
    (lambda c: (c / "extra.bin").write_bytes(b"x"), "extra.bin: not in manifest.json"),
    (lambda c: (c / "manifest.json").unlink(), "manifest.json missing"),
    (lambda c: (c / "manifest.json").write_text("{"), "manifest.json unreadable"),
], ids=["weights", "optimizer", "config", "missing", "extra", "no-manifest", "bad-manifest"])
def test_verify_names_the_bad_file(trained_run, tmp_path, damage, needle):
    ckpt = shutil.copytree(trained_run / "checkpoints" / "step-1", tmp_path / "step-1")
    damage(ckpt)
    problem = verify_checkpoint(ckpt)
    assert problem is not None and needle in problem, problem


def test_math_config_rule():
    """All keys but RESUME_MAY_CHANGE, the method's options dotted, dtype resolved; the batch by the keys
    that set it."""
    cfg = load_config(None, TINY + ["output_dir=x"])
    got = math_config(cfg, torch.bfloat16)
    assert not set(got) & RESUME_MAY_CHANGE
    assert got["dtype"] == "bfloat16" and got["revffn.adapter_warmup_steps"] == 1
    assert not any(k.startswith("lora.") for k in got)  # another method's options do not apply
    assert got["per_device_train_batch_size"] == 2 and got["global_batch_size"] is None
    fixed = math_config(load_config(None, TINY + ["output_dir=x", "global_batch_size=4"]), torch.float32)
    assert fixed["global_batch_size"] == 4 and "per_device_train_batch_size" not in fixed
    json.dumps(got)  # the manifest holds it as JSON


@pytest.mark.parametrize("over", [["logging_steps=2", "save_steps=5", "save_total_limit=3", "max_steps=9"],
                                  ["eval_steps=1", "eval_data=builtin:reversal_test", "max_restarts=1"],
                                  ["device=auto", "distributed=none", "distributed_timeout=60"],
                                  ["report_to=tensorboard", "stall_timeout_s=60", "memory_growth_window=10",
                                   "memory_growth_tolerance_mib=8"]])
def test_resume_may_change_cadence_and_placement(trained_run, over):
    cfg = load_config(None, TINY + [f"output_dir={trained_run}", "resume=true", *over])
    assert resolve_resume(cfg, trained_run, torch.float32) == (trained_run / "checkpoints" / "step-1", [])

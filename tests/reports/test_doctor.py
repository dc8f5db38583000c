"""`revffn doctor`: one JSON object with every check, exit 0 when healthy, 1 with a fix on each failing line."""

import errno
import json

import pytest
import torch

from revffn import cli
from revffn.reports import doctor

CHECKS = ["versions", "device", "memory", "bf16", "reversible", "output_dir"]


def _doctor(capsys, *args) -> tuple[int, dict]:
    code = cli.main(["doctor", "--json", "--probe-mib", "64", *args])
    return code, json.loads(capsys.readouterr().out)


def _failed(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"] if not c["ok"]}


def test_healthy_machine_exits_0_with_every_check(capsys, tmp_path):
    code, report = _doctor(capsys, "--device", "cpu", "--output-dir", str(tmp_path / "runs"))
    assert code == 0 and report["healthy"] is True and report["device"] == "cpu"
    assert set(report) == {"healthy", "device", "versions", "devices", "checks"}
    assert {"python", "torch", "transformers", "peft", "cuda", "driver"} <= set(report["versions"])
    assert report["versions"]["torch"] == torch.__version__
    assert report["devices"][0]["type"] == "cpu" and report["devices"][0]["cores"] >= 1
    assert [c["name"] for c in report["checks"]] == CHECKS
    assert all({"name", "ok", "detail", "fix"} <= set(c) and c["fix"] is None for c in report["checks"])
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["memory"]["probe_bytes"] == 64 * 2**20 and checks["memory"]["free_bytes"] > 0
    assert checks["reversible"]["max_rel_grad_error"] <= 1e-5
    assert checks["reversible"]["buffered"]["max_reconstruction_error"] == 0  # the default coupling: bitwise
    assert 0 < checks["reversible"]["additive"]["max_reconstruction_error"] <= 1e-5  # float streams: rounding
    assert checks["output_dir"]["checked_at"] == str(tmp_path) and checks["output_dir"]["free_bytes"] > 0
    assert not list(tmp_path.iterdir())  # the write probe cleaned up, and runs/ was not created


def test_output_dir_that_cannot_be_written_fails_with_a_fix(capsys, tmp_path, monkeypatch):
    (tmp_path / "a_file").write_text("")
    code, report = _doctor(capsys, "--device", "cpu", "--output-dir", str(tmp_path / "a_file" / "runs"))
    assert code == 1 and report["healthy"] is False
    assert list(_failed(report)) == ["output_dir"] and "not a directory" in _failed(report)["output_dir"]["detail"]

    def read_only(**kwargs):  # root writes through chmod: refuse the write itself
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(doctor.tempfile, "mkstemp", read_only)
    assert cli.main(["doctor", "--device", "cpu", "--probe-mib", "64", "--output-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "output_dir" in x)
    assert line.lstrip().startswith("FAIL") and "Permission denied" in line
    assert "Fix: choose another --output-dir" in line
    assert "1 check failed: output_dir" in out


def test_a_probe_that_cannot_be_allocated_fails(capsys, tmp_path, monkeypatch):
    real_empty = torch.empty

    def refuse(size, *args, **kwargs):  # the probe's allocation fails (the device's memory is taken)
        if isinstance(size, int) and size == 8 * 2**20:
            raise RuntimeError("out of memory")
        return real_empty(size, *args, **kwargs)

    monkeypatch.setattr(doctor.torch, "empty", refuse)
    code, report = _doctor(capsys, "--device", "cpu", "--output-dir", str(tmp_path), "--probe-mib", "8")
    assert code == 1 and list(_failed(report)) == ["memory"]
    memory = _failed(report)["memory"]
    assert "could not allocate" in memory["detail"] and "--probe-mib" in memory["fix"]


def test_a_probe_larger_than_the_free_memory_exits_2(capsys, tmp_path):
    """On the host, a probe past the free memory was an allocation the kernel's OOM killer ended (or, past what can
    be mapped, a failed check): now exit 2 before it, naming the flag and the free memory."""
    assert cli.main(["doctor", "--device", "cpu", "--output-dir", str(tmp_path), "--probe-mib", str(10**12)]) == 2
    err = capsys.readouterr().err
    assert "--probe-mib 1000000000000: more than the " in err and "MiB free in host memory" in err and "Fix:" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_but_absent_fails_and_skips_the_device_checks(capsys, tmp_path):
    code, report = _doctor(capsys, "--device", "cuda", "--output-dir", str(tmp_path))
    assert code == 1 and report["device"] is None
    assert list(_failed(report)) == ["device", "memory", "bf16", "reversible"]
    assert "--device cpu" in _failed(report)["device"]["fix"]


def test_too_little_room_for_two_checkpoints_fails(capsys, tmp_path, monkeypatch):
    """A save writes the new checkpoint beside the previous one: under 2x the largest checkpoint of the runs there
    the disk check fails (the free bytes faked: a real full disk is not made here)."""
    step = tmp_path / "run" / "checkpoints" / "step-3"
    step.mkdir(parents=True)
    (step / "model.safetensors").write_bytes(b"\0" * 2**20)
    monkeypatch.setattr(doctor, "MIN_FREE_DISK", 0)
    real = doctor.shutil.disk_usage
    for free, ok in ((2**21, True), (2**21 - 1, False)):
        monkeypatch.setattr(doctor.shutil, "disk_usage", lambda p, free=free: real(p)._replace(free=free))
        code, report = _doctor(capsys, "--device", "cpu", "--output-dir", str(tmp_path))
        assert report["checks"][-1]["largest_checkpoint_bytes"] == 2**20 and (code == 0) == ok, free
    assert list(_failed(report)) == ["output_dir"]
    assert "the largest checkpoint there is" in _failed(report)["output_dir"]["detail"]

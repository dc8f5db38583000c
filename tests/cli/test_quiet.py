"""The CLI prints no third-party noise that does not apply: torchao's CUDA kernels failing to load under a CPU
build of torch, torch's Enum deprecation note for what torchao registers; everything else still logs. The
quickstart's own stderr is checked in tests/training/test_quickstart.py."""

import logging
import subprocess
import sys

import pytest
import torch

from revffn.progress import _KnownNoise, quiet_known_noise


def _record(name: str, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, None, None)


def test_the_filter_drops_only_the_known_lines(monkeypatch):
    noise = _KnownNoise()
    kernel = _record("torchao", "Failed to load /site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: x")
    enum = _record("torch.utils._pytree", "<enum 'KernelPreference'> is an Enum subclass and is now natively "
                                          "supported by torch.compile as an opaque value type.")
    monkeypatch.setattr(torch.version, "cuda", None)
    assert not noise.filter(kernel) and not noise.filter(enum)
    assert noise.filter(_record("torchao", "Skipping import of cpp extensions due to incompatible torch version"))
    assert noise.filter(_record("torch.utils._pytree", "something else"))
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a CUDA build: the kernels could apply
    assert noise.filter(kernel)


def test_installing_it_twice_adds_one_filter():
    quiet_known_noise()
    quiet_known_noise()
    assert sum(isinstance(f, _KnownNoise) for f in logging.getLogger("torchao").filters) == 1


@pytest.mark.integration
def test_generate_prints_no_warning(tmp_path):
    cmd = [sys.executable, "-m", "revffn", "generate", "builtin:base", "--prompt", "a b", "--max-new-tokens", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for said in ("Failed to load", "Enum subclass", "warning", "Warning"):
        assert said not in proc.stderr, proc.stderr[-2000:]

"""Least privilege: a run's files are the user's alone (0700/0600 under umask 022), nothing unpickles an
arbitrary object (a static scan of the source, and DCP's loads at run time), training opens no
listening socket."""

from __future__ import annotations

import ast
import io
import os
import pickle
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from revffn.errors import UserError
from revffn.training import checkpoint
from revffn.training.checkpoint import load_checkpoint, save_checkpoint
from revffn.training.config import QUICKSTART
from revffn.training.manifest import read_manifest, verify_checkpoint
from tests.training._util import TINY, train_tiny

REPO = Path(__file__).resolve().parents[2]


def test_run_files_are_private_under_umask_022(trained_run):
    """Every directory the run created is 0700 and every file 0600: config.yaml, metrics.jsonl, the
    report and plots, checkpoints/step-N and all in it, final/ and all in it."""
    seen = {p.relative_to(trained_run).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in trained_run.rglob("*")}
    for must in ("config.yaml", "metrics.jsonl", "report.md", "checkpoints/step-1/model.safetensors",
                 "checkpoints/step-1/manifest.json", "final/model.safetensors"):
        assert must in seen, must
    assert stat.S_IMODE(trained_run.stat().st_mode) == 0o700
    wrong = {rel: oct(mode) for rel, mode in seen.items()
             if mode != (0o700 if (trained_run / rel).is_dir() else 0o600)}
    assert not wrong, wrong


def test_umask_restored_after_a_run(tmp_path):
    before = os.umask(0o022)
    try:
        with pytest.raises(UserError):  # refused before anything is written
            train_tiny(tmp_path / "run", "resume=true")
        assert os.umask(0o022) == 0o022
    finally:
        os.umask(before)


# -- no pickle load accepts arbitrary objects ------------------------------------------------------------

PICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}


def unsafe_loads(source: str) -> list[str]:
    """`file:line what` for each load in `source` that can build an arbitrary object: pickle (and its
    kin) `load`/`loads`/`Unpickler` but an Unpickler subclass that overrides `find_class`, `torch.load`
    without `weights_only=True`, `numpy.load(allow_pickle=True)`, pandas `read_pickle`."""
    tree, found = ast.parse(source), []
    alias = {}  # local name -> module, from `import x as y` and `from x import y`
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            alias.update({a.asname or a.name: a.name for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(node) -> str:
        if isinstance(node, ast.Name):
            return alias.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            return f"{dotted(node.value)}.{node.attr}"
        return ""

    def kw(call, name):
        return next((k.value for k in call.keywords if k.arg == name), None)

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {dotted(b) for b in node.bases}
            overrides = any(isinstance(f, ast.FunctionDef) and f.name == "find_class" for f in node.body)
            if any(b.split(".")[0] in PICKLERS and b.endswith("Unpickler") for b in bases) and not overrides:
                found.append(f"{node.lineno} class {node.name}: an Unpickler without find_class")
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func)
        module, _, attr = name.rpartition(".")
        if module.split(".")[0] in PICKLERS and attr in ("load", "loads", "Unpickler"):
            found.append(f"{node.lineno} {name}")
        elif name == "torch.load" or name.startswith("torch.serialization.load"):
            weights_only = kw(node, "weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(f"{node.lineno} {name} without weights_only=True")
        elif name in ("numpy.load", "np.load"):
            allow = kw(node, "allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append(f"{node.lineno} {name} with allow_pickle")
        elif attr == "read_pickle":
            found.append(f"{node.lineno} {name}")
    return found


@pytest.mark.parametrize("bad", [
    "import pickle\npickle.load(f)", "import pickle as p\np.loads(b)", "from pickle import loads\nloads(b)",
    "import torch\ntorch.load(p)", "import torch\ntorch.load(p, weights_only=False)",
    "from torch import load\nload(p, map_location='cpu')", "import numpy as np\nnp.load(p, allow_pickle=True)",
    "import pickle\nclass U(pickle.Unpickler):\n    pass", "import pandas as pd\npd.read_pickle(p)",
    "import dill\ndill.load(f)",
])
def test_the_scan_finds_unsafe_loads(bad):
    assert unsafe_loads(bad), bad


def test_no_unsafe_load_in_the_source():
    """Every load in revffn/ and scripts/ is safetensors, `torch.load(weights_only=True)`, JSON/YAML,
    or an allow-listed Unpickler (checkpoint._MetadataUnpickler)."""
    found = [f"{path.relative_to(REPO)}:{hit}" for root in ("revffn", "scripts") for path in (REPO / root).rglob("*.py")
             for hit in unsafe_loads(path.read_text())]
    assert not found, found
    assert "torch.load(" in (REPO / "revffn/training/checkpoint.py").read_text()  # the scan sees the loads


@pytest.mark.parametrize("sharded", [False, True], ids=["safetensors", "dcp"])
def test_checkpoint_loads_without_an_unrestricted_unpickle(tmp_path, monkeypatch, sharded):
    """Load a checkpoint (single-file, and DCP's shards in one process) with `pickle.load(s)` made to
    fail and `torch.load` to insist on weights_only=True: torch's own DCP reader and planner would
    fail here (plain pickle.load of `.metadata`, torch.load(weights_only=False) of the optimizer's
    hyperparameters). The manifest lists every file, dcp/ shards included."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path, 1, model, optimizer, {"step": 1}, "", {"model": "m"}, keep=1, sharded=sharded)
    files = set(read_manifest(path)["files"])
    assert files == {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"manifest.json"}
    if sharded:
        assert {"dcp/.metadata", "dcp/__0_0.distcp"} <= files
    assert verify_checkpoint(path) is None

    def refused(*args, **kwargs):
        raise AssertionError("unrestricted pickle load")

    real_load = torch.load

    def weights_only_load(*args, **kwargs):
        assert kwargs.get("weights_only") is True, kwargs
        return real_load(*args, **kwargs)

    monkeypatch.setattr(pickle, "load", refused)
    monkeypatch.setattr(pickle, "loads", refused)
    monkeypatch.setattr(torch, "load", weights_only_load)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load_checkpoint(path, fresh, fresh_opt) == {"step": 1}
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh_opt.state_dict()["param_groups"][0]["lr"] == 1e-2
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])


class _Payload:
    def __reduce__(self):
        return os.getcwd, ()


def test_dcp_metadata_unpickler_refuses_code():
    with pytest.raises(pickle.UnpicklingError, match="getcwd"):
        checkpoint._MetadataUnpickler(io.BytesIO(pickle.dumps(_Payload()))).load()


# -- no listening socket -----------------------------------------------------------------------------------


def listening_sockets(argv: list[str], timeout: float = 300) -> tuple[int, set[str], int]:
    """Run `argv` and poll it (and its children) every 20 ms for listening inet sockets: TCP in LISTEN,
    or UDP bound with no peer. Returns (exit code, the sockets seen, the number of polls)."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    seen, polls, t0 = set(), 0, time.monotonic()
    try:
        while proc.poll() is None and time.monotonic() - t0 < timeout:
            try:
                parent = psutil.Process(proc.pid)
                for p in [parent, *parent.children(recursive=True)]:
                    for c in p.net_connections(kind="inet"):
                        if c.status == psutil.CONN_LISTEN or (c.type == 2 and c.laddr and not c.raddr):  # SOCK_DGRAM
                            seen.add(f"pid {p.pid} {c.laddr} {c.status}")
                polls += 1
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.wait(), seen, polls


@pytest.mark.integration
def test_the_poll_sees_a_listening_socket():
    code = "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); time.sleep(2)"
    rc, seen, _ = listening_sockets([sys.executable, "-c", code])
    assert rc == 0 and seen


@pytest.mark.integration
def test_training_opens_no_listening_socket(tmp_path):
    """`revffn train` (one process, CPU), polled for its whole life, from import to final/."""
    rc, seen, polls = listening_sockets([sys.executable, "-m", "revffn", "train", str(QUICKSTART), *TINY, "max_steps=4",
                                         f"output_dir={tmp_path / 'run'}"])
    assert rc == 0 and (tmp_path / "run" / "final").is_dir()
    assert polls >= 20  # it was watched while it ran
    assert not seen, seen

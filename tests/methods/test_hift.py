"""`hift`: one group per step in the strategy's order, delayed LR, exact resume after kill -9."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from revffn.methods.hift import HiFTMethod
from revffn.training.schedule import lr_at
from tests.methods._util import CONFIGS, ROOT, batch, build, changed, config, metrics, snapshot, step

FAULT_RUN = ROOT / "tests" / "training" / "fault_run.py"  # revffn train with a fault injected
EXPECTED = {"bottom2up": [0, 1, 2, 3], "top2down": [3, 2, 1, 0]}


@pytest.mark.parametrize("alias,strategy", [("down2up", "bottom2up"), ("up2down", "top2down")])
def test_strategy_aliases(alias, strategy, tmp_path):
    method = build(config("hift", tmp_path, f"hift.strategy={alias}")).method
    assert method.strategy == strategy and method.order == EXPECTED[strategy]


@pytest.mark.parametrize("strategy", ["bottom2up", "top2down", "random"])
def test_one_group_per_step_in_strategy_order(strategy, tmp_path):
    run = build(config("hift", tmp_path, f"hift.strategy={strategy}", lr=1e-3))
    method, model = run.method, run.model
    k = method.num_groups
    assert k == 4 and method.group_names == ["embed", "layer0", "layer1", "head"]  # 2 layers
    group_of = {n: g for n, p in model.named_parameters() for g, grp in enumerate(method.groups)
                if any(p is q for q in grp)}
    assert len(group_of) == len(list(model.parameters()))  # every parameter is in exactly one group
    visited = []
    for i in range(2 * k):
        before = snapshot(model)
        step(run, i, batch(seed=i))
        groups = {group_of[n] for n in changed(before, model)}
        assert len(groups) == 1, (i, groups)  # exactly one group moved
        visited.append(groups.pop())
    cycles = [visited[:k], visited[k:]]
    for c in cycles:
        assert sorted(c) == list(range(k))  # every group once per cycle
    if strategy in EXPECTED:
        assert cycles == [EXPECTED[strategy]] * 2
    else:  # random: one seeded permutation, drawn once and kept for every cycle
        assert cycles[0] == cycles[1] == method.order
    assert [method.schedule_position(i) for i in range(2 * k)] == [0] * k + [1] * k
    assert method.schedule_length(10) == math.ceil(10 / k)


def test_group_size_and_state_roundtrip(tmp_path):
    method = build(config("hift", tmp_path, "hift.group_size=3", "hift.strategy=top2down")).method
    assert method.group_names == ["embed+layer0+layer1", "head"] and method.order == [1, 0]
    state = json.loads(json.dumps(method.state_dict()))  # JSON-serialisable (trainer_state.json)
    other = HiFTMethod(config("hift", tmp_path, "hift.group_size=3", "hift.strategy=top2down"))
    other.groups, other.group_names = method.groups, method.group_names
    other.load_state_dict(state)
    assert other.order == method.order and other.position == method.position


def _train(cfg_overrides: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    """`revffn train` in a child process; `fault`: a tests/training/fault_run.py spec injected into it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launch = [str(FAULT_RUN), fault] if fault else ["-m", "revffn", "train"]
    return subprocess.run([sys.executable, *launch, str(CONFIGS / "tiny_hift.yaml"), *cfg_overrides],
                          env=env, capture_output=True, text=True, timeout=600)


COMMON = ["max_steps=10", "save_steps=3", "eval_data=null", "warmup_steps=0", "min_lr_ratio=0.1",
          "per_device_train_batch_size=4", "max_seq_length=48", "hift.strategy=random", "dtype=float32", "device=cpu"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("hift") / "ref"
    proc = _train([*COMMON, f"output_dir={run}"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 11))
    return rows


@pytest.mark.integration
def test_delayed_lr(reference):
    rows, k = reference, 4
    lrs = [r["lr"] for r in rows]
    by_cycle = [lrs[c * k : (c + 1) * k] for c in range(math.ceil(10 / k))]
    assert all(len(set(c)) == 1 for c in by_cycle), lrs  # constant within a cycle
    assert by_cycle[0][0] > by_cycle[1][0] > by_cycle[2][0]  # advances once per cycle ...
    peak = by_cycle[0][0]  # ... over a schedule of ceil(max_steps / k) positions, so it spans the run
    assert lrs == [lr_at((s - 1) // k, math.ceil(10 / k), peak, 0, "cosine", 0.1) for s in range(1, 11)]
    order = [int(r["hift_group"].split(":")[0][1:]) for r in rows]
    assert order[:k] == order[k : 2 * k] and sorted(order[:k]) == list(range(k))  # one random queue, kept
    assert all(r["optimizer_state_bytes_device"] == 0 for r in rows)  # CPU run: nothing on an accelerator
    assert rows[-1]["optimizer_state_bytes_active"] < rows[-1]["optimizer_state_bytes_total"]


@pytest.mark.integration
@pytest.mark.parametrize("fault", ["kill@step:5", "kill@save:6"])
def test_exact_resume_after_kill(reference, fault, tmp_path):
    run = tmp_path / "run"
    first = _train([*COMMON, f"output_dir={run}"], fault=fault)
    assert first.returncode == -9, first.stderr[-2000:]  # SIGKILL
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == ["step-3"]  # mid-cycle (position 3 of 4)
    state = json.loads((run / "checkpoints" / "step-3" / "trainer_state.json").read_text())
    assert state["method_state"]["position"] == 3 and sorted(state["method_state"]["order"]) == [0, 1, 2, 3]
    second = _train([*COMMON, f"output_dir={run}", "resume=true"])
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = metrics(run)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    for a, b in zip(reference, resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["step"], a["loss"], b["loss"])
        assert a["hift_group"] == b["hift_group"] and a["lr"] == b["lr"]
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.gpu
def test_only_active_group_state_on_device(tmp_path):
    """On CUDA, the optimizer state resident on the device is exactly the active group's."""
    import torch

    from revffn.cli import main

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run = tmp_path / "gpu"
    assert main(["train", str(CONFIGS / "tiny_hift.yaml"), "max_steps=8", "eval_data=null", "save_steps=5",
                 f"output_dir={run}", "device=cuda"]) == 0
    rows = metrics(run)
    for r in rows:
        assert r["optimizer_state_bytes_device"] == r["optimizer_state_bytes_active"] > 0, r
    assert rows[-1]["optimizer_state_bytes_total"] > rows[-1]["optimizer_state_bytes_device"]

"""The analytic estimate agrees with what the bench measures, for every registered method, on the tiny presets.

Measured (the bench worker, in-process): static = parameter bytes + gradient bytes + optimizer-state
bytes (the largest over HiFT's groups), activations = bytes autograd holds after the forward
(parameters and revffn's routing records excluded; HiFT: the largest over its groups). Estimated:
the `est_*` fields the bench puts in every row (`revffn.memory.estimate` of the same config).
Tolerance 15%. One test per method in the registry (a method registered elsewhere is checked too);
each prints its errors per geometry and its worst case (`pytest -s`).
"""

import pytest

from revffn.methods import METHODS
from revffn.reports.bench import BenchSpec, estimate_fields, worker_args
from revffn.reports.workers import bench as bench_worker
from tests.conftest import REQUIRED

TOL = 0.15
# preset, layers, hidden, batch, seq, dtype: the four presets in fp32, plus an odd bf16 geometry
CASES = [(name, 2, None, 2, 64, "float32") for name in REQUIRED] + [("tiny-qwen2-moe", 3, 96, 3, 40, "bfloat16")]


def _errors(name, layers, hidden, batch, seq, dtype, method) -> tuple[float, float]:
    """(static, activations) relative errors of the estimate against one bench measurement."""
    steps = layers + 1 if method == "hift" else 1  # hift: every group once (its peaks are over groups)
    label = method  # (revffn: the buffered default, nothing to calibrate)
    spec = BenchSpec(name, [label], layers, hidden, batch, seq, steps, dtype, "cpu")
    args = worker_args(spec, label)
    row = bench_worker.run(args)
    assert row["status"] == "ok", row
    est = estimate_fields(args)
    assert "est_error" not in est, est
    static = row["param_bytes"] + row["grad_bytes"] + row["optimizer_state_bytes"]
    return est["est_static_bytes"] / static - 1, est["est_activation_bytes"] / row["activation_bytes"] - 1


def check_agreement(method: str, cases: list[tuple] = CASES) -> None:
    """Every case within TOL for `method` (also used for a method registered by a test)."""
    bad, worst = [], (0.0, "(exact)")
    for case in cases:
        err_static, err_act = _errors(*case, method)
        print(f"{case[0]:16s} {case[5]:9s} {method:7s} static {err_static:+.2%}  activations {err_act:+.2%}")
        for what, err in (("static", err_static), ("activations", err_act)):
            label = f"{case[0]} {case[5]} {what} {err:+.2%}"
            worst = max(worst, (err, label), key=lambda w: abs(w[0]))
            if abs(err) > TOL:
                bad.append(label)
    print(f"worst {method:7s} {worst[1]}")
    assert not bad, f"{method}: estimate off by more than 15%:\n" + "\n".join(bad)


@pytest.mark.parametrize("method", list(METHODS))
def test_estimate_within_15_percent_of_the_bench(method):
    check_agreement(method)


OPTION_VARIANTS = ["full:optimizer=adafactor", "full:optimizer_in_backward=true",
                   "revffn:optimizer=adafactor:optimizer_in_backward=true", "revffn:revffn.stream_width=full",
                   "revffn:revffn.train_adapters=false", "revffn:revffn.coupling=buffered",
                   pytest.param("revffn:optimizer=adamw8bit:optimizer_in_backward=true", marks=pytest.mark.integration),
                   pytest.param("full:optimizer=adamw4bit", marks=pytest.mark.integration)]


@pytest.mark.parametrize("label", OPTION_VARIANTS)
def test_optimizer_options_within_10_percent(label):
    """Static bytes (params + gradients + optimizer states) and activations of each optimizer option.
    With the in-backward step no gradient survives the backward; the measured gradient term is the
    largest single gradient the hooks saw (what the estimate counts)."""
    pytest.importorskip("torchao") if "bit" in label else None
    spec = BenchSpec("tiny-qwen2-moe", [label], 2, None, 2, 64, 2, "float32", "cpu")
    args = worker_args(spec, label)
    row = bench_worker.run(args)
    assert row["status"] == "ok", row
    est = estimate_fields(args)
    static = row["param_bytes"] + row["grad_bytes"] + row["optimizer_state_bytes"]
    assert row["optimizer_state_bytes"] > 0
    assert abs(est["est_static_bytes"] / static - 1) <= 0.10, (label, est["est_static_bytes"], static)
    assert abs(est["est_activation_bytes"] / row["activation_bytes"] - 1) <= 0.15


@pytest.mark.parametrize("label", ["hf-trainer", "hf-trainer+ckpt"])
def test_peer_trainer_within_10_percent(label):
    """transformers' Trainer (the bench's `--peers`) against `revffn estimate --option loss=hf` of the method it
    trains like: its loss saves the whole batch's fp32 log-softmax, which the estimate adds."""
    from revffn.reports.workers import peer

    spec = BenchSpec("tiny-qwen2-moe", ["full"], 2, None, 2, 64, 1, "float32", "cpu")
    args = worker_args(spec, label)
    row = peer.run(args)
    assert row["status"] == "ok", row
    est = estimate_fields(args)
    static = row["param_bytes"] + row["grad_bytes"] + row["optimizer_state_bytes"]
    assert abs(est["est_static_bytes"] / static - 1) <= 0.10, (label, est["est_static_bytes"], static)
    assert abs(est["est_activation_bytes"] / row["activation_bytes"] - 1) <= 0.10, (
        label, est["est_activation_bytes"], row["activation_bytes"])

"""The analytic estimate agrees with what the bench measures, for every method, on the tiny presets.

Measured (the bench worker, in-process): static = parameter bytes + gradient bytes + optimizer-state
bytes (the largest over HiFT's groups), activations = bytes autograd holds after the forward
(parameters and revffn's routing records excluded; HiFT: the largest over its groups). Estimated:
the `est_*` fields the bench puts in every row (`revffn.memory.estimate` of the same config).
Tolerance 15%; the worst case per method is printed (`pytest -s`).
"""

import pytest

from revffn.memory.estimate import METHODS
from revffn.reports.bench import BenchSpec, estimate_fields, worker_args
from revffn.reports.workers import bench as bench_worker
from tests.conftest import REQUIRED

TOL = 0.15
# preset, layers, hidden, batch, seq, dtype: the four presets in fp32, plus an odd bf16 geometry
CASES = [(name, 2, None, 2, 64, "float32") for name in REQUIRED] + [("tiny-qwen2-moe", 3, 96, 3, 40, "bfloat16")]
WORST: dict[str, tuple[float, str]] = {}


def _measure(name, layers, hidden, batch, seq, dtype, method) -> tuple[float, float, dict]:
    steps = layers + 1 if method == "hift" else 1  # hift: every group once (its peaks are over groups)
    spec = BenchSpec(name, [method], layers, hidden, batch, seq, steps, dtype, "cpu")
    args = worker_args(spec, method)
    row = bench_worker.run(args)
    assert row["status"] == "ok", row
    est = estimate_fields(args)
    static = row["param_bytes"] + row["grad_bytes"] + row["optimizer_state_bytes"]
    err_static = est["est_static_bytes"] / static - 1
    err_act = est["est_activation_bytes"] / row["activation_bytes"] - 1
    return err_static, err_act, row


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[5]}" for c in CASES])
def test_estimate_within_15_percent_of_the_bench(case):
    bad = []
    for method in METHODS:
        err_static, err_act, _ = _measure(*case, method)
        for what, err in (("static", err_static), ("activations", err_act)):
            label = f"{case[0]} {case[5]} {what} {err:+.2%}"
            if abs(err) > abs(WORST.get(method, (0.0, ""))[0]):
                WORST[method] = (err, label)
            if abs(err) > TOL:
                bad.append(f"{method}: {label}")
        print(f"{case[0]:16s} {case[5]:9s} {method:7s} static {err_static:+.2%}  activations {err_act:+.2%}")
    assert not bad, "estimate off by more than 15%:\n" + "\n".join(bad)


def test_worst_case_per_method():
    """Runs after the cases above (file order): the worst relative error of each method."""
    if not WORST:
        pytest.skip("no agreement case ran")
    for method in METHODS:
        err, label = WORST.get(method, (0.0, "(exact)"))
        print(f"worst {method:7s} {label}")
        assert abs(err) <= TOL

"""Calibrated adapter init (`revffn.conversion.calibrate`): it closes most of the conversion gap of the
shipped base, its memory does not grow with the calibration tokens, and parity still holds after it."""

import pytest
import torch

from revffn.conversion.calibrate import RidgeFit, calibrate
from revffn.conversion.convert import convert
from revffn.conversion.teacher import sample_self
from revffn.data.calibration import calibration_rows, file_rows, row_batches
from revffn.data.tokenizer import load_tokenizer
from revffn.errors import UserError
from revffn.models.loading import load_hf, resolve_model_ref
from revffn.models.presets import tiny_model
from revffn.training.evaluate import retention_loss

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model_ref("builtin:base"))


def test_ridge_fit_recovers_a_linear_map_and_reports_its_residual():
    torch.manual_seed(0)
    W = torch.randn(6, 4, dtype=torch.float64)
    fit = RidgeFit(4, 6, torch.device("cpu"))
    for _ in range(5):  # streamed in blocks: the same as one big least-squares problem
        X = torch.randn(100, 4, dtype=torch.float64)
        fit.add(X, X @ W.T + 0.1 * torch.randn(100, 6, dtype=torch.float64))
    weight, rel = fit.solve(1e-6)
    assert torch.allclose(weight, W, atol=0.05)
    assert 0.0 < rel < 0.01  # the noise left: 0.01 / (1 + ...) of the target's energy


def test_ridge_fit_solved_by_rows_equals_the_whole_solve():
    """Under FSDP2 each rank solves only the rows of W its shard holds (`rows`), and its part of the residual is
    summed over the ranks (`reduce`): the rows equal the whole solve's and the parts add up to its residual."""
    torch.manual_seed(0)
    fit = RidgeFit(8, 5, torch.device("cpu"))
    X = torch.randn(200, 8, dtype=torch.float64)
    Y = X @ torch.randn(8, 5, dtype=torch.float64) + torch.randn(200, 5, dtype=torch.float64)
    fit.add(X, Y)
    whole, rel = fit.solve(1e-3)
    assert abs(float(((X @ whole.T - Y) ** 2).sum() / (Y ** 2).sum()) - rel) < 1e-9  # the residual as defined
    parts = []

    def keep(t):  # an "all-reduce" that records each rank's part instead
        parts.append(t.clone())

    pieces = [fit.solve(1e-3, rows, keep)[0] for rows in (slice(0, 3), slice(3, 5), slice(5, 5))]
    torch.testing.assert_close(torch.cat(pieces), whole, rtol=0, atol=1e-12)
    assert pieces[2].shape == (0, 8)  # a rank past the last row solves nothing
    assert abs((float(fit.yy) - float(sum(parts))) / float(fit.yy) - rel) < 1e-12


@pytest.fixture(scope="module")
def calibrated_base(tok):
    """builtin:base calibrated on the same 2048 self-sampled tokens, without and with the skip adapters, and
    with full-width streams (and skips): ({skip or "full": (loss on 16 held-out documents, report)}, the
    coordinate loss)."""
    out, coordinate, rows = {}, None, None
    for skip, width in ((False, "half"), (True, "half"), (True, "full")):
        model = convert(load_hf("builtin:base"), adapter_skip=skip, stream_width=width).eval()
        if width == "half" and not skip:
            coordinate = retention_loss(model, tok, limit=16)  # the skips start at 0: the same model
        if rows is None:  # sampled from the unconverted layers: the same text for every variant
            rows = calibration_rows("self", tok, model, 2048, "revffn.calibration_data")
        report = calibrate(model, row_batches(rows))
        out[skip if width == "half" else "full"] = (retention_loss(model, tok, limit=16), report)
    return out, coordinate


def test_calibrated_beats_coordinate_on_the_shipped_base(calibrated_base):
    """builtin:base: coordinate 4.80 on these 16 held-out documents; a 2048-token self-calibration ~2.9."""
    fits, coordinate = calibrated_base
    calibrated, report = fits[False]
    print({"coordinate": coordinate, "calibrated": calibrated, "worst": max(report["residuals"].values())})
    assert coordinate > 4.5
    assert calibrated < 3.0
    assert len(report["residuals"]) == 4 * 4  # 4 fits per layer
    assert all(0.0 <= r < 1.0 for r in report["residuals"].values())


def test_skip_adapters_close_most_of_what_is_left(calibrated_base):
    """With the skips, P_down_attn's fit (one joint fit with its skip) explains far more of its target in
    every layer above the first, and the held-out loss drops well below the four-adapter fit's."""
    fits, _ = calibrated_base
    (plain, plain_report), (skip, skip_report) = fits[False], fits[True]
    print({"plain": plain, "skip": skip})
    assert skip < plain - 0.2
    for layer in (1, 2, 3):
        key = f"layers.{layer}.p_down_attn"
        assert skip_report["residuals"][key] < 0.7 * plain_report["residuals"][key]


def test_full_width_fits_two_adapters_a_layer_and_keeps_more_than_half_width(calibrated_base):
    """Full-width streams: no P_up to fit, P_down_attn and P_down_moe (each jointly with its d x d skip)
    per layer, and the held-out loss below the half-width fit's on the same calibration text."""
    fits, _ = calibrated_base
    (half, _), (full, report) = fits[True], fits["full"]
    print({"half": half, "full": full})
    assert sorted({k.split(".")[-1] for k in report["residuals"]}) == ["p_down_attn", "p_down_moe"]
    assert len(report["residuals"]) == 2 * 4
    assert full < half


@pytest.mark.parametrize("skip", [False, True])
def test_calibration_memory_does_not_grow_with_tokens(skip):
    """The fp64 accumulators are O(d²), whatever the tokens; keep_states=False holds nothing else and
    gives the same adapters (bitwise: the kept teacher outputs and the advance by G's adapters alone compute what
    running the layers again computes); keep_states=True holds one layer's inputs and teacher outputs."""
    reports, weights = {}, {}
    for n_rows, keep in ((8, True), (16, True), (16, False)):
        model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=3), adapter_skip=skip).eval()
        ids = torch.randint(3, 512, (n_rows, 32), generator=torch.Generator().manual_seed(n_rows))
        reports[n_rows, keep] = calibrate(model, row_batches(ids, 4), keep_states=keep)
        weights[n_rows, keep] = [p.detach().clone() for p in model.adapter_parameters()]
    assert reports[8, True]["accumulator_bytes"] == reports[16, True]["accumulator_bytes"] \
        == reports[16, False]["accumulator_bytes"]
    d = 64
    fit_in = d + d // 2 if skip else d  # the largest fit: P_down (with its skip), fp64
    assert reports[8, True]["accumulator_bytes"] == 8 * (fit_in * fit_in + fit_in * d // 2 + 1)
    assert reports[16, False]["kept_bytes"] == 0
    # h_l and the two d/2 streams, the teacher's A_l and h_l+1, the last pass's Y_1 and MoE output: fp32
    assert reports[16, True]["kept_bytes"] == 16 * 32 * (2 * d + 2 * d + d // 2 + d) * 4
    assert all(torch.equal(a, b) for a, b in zip(weights[16, True], weights[16, False]))


@pytest.mark.parametrize("skip,width", [(False, "half"), (True, "half"), (True, "full")])
def test_parity_holds_after_calibration(skip, width):
    """Calibrated adapters (and skips) are ordinary weights: reversible gradients still equal the plain twin's."""
    model = convert(tiny_model("tiny-qwen2-moe", num_hidden_layers=3), adapter_skip=skip, stream_width=width)
    calibrate(model, row_batches(sample_self(model, 8, 32, 2), 4))
    model.train()
    ids = torch.randint(3, 512, (2, 24))
    grads = {}
    for rev in (True, False):
        model.zero_grad()
        model.reversible = rev
        model(ids, labels=ids).loss.backward()
        grads[rev] = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    if skip:  # fitted, not left at 0, and they get gradients
        assert all(b.p_skip_attn.weight.abs().max() > 0 and b.p_skip_moe.weight.grad is not None for b in model.blocks)
    assert ((grads[True] - grads[False]).norm() / grads[False].norm()) < 1e-5


def test_calibration_text_that_is_empty_or_too_short_names_the_key(tmp_path, tok):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "only a few words"}\n')
    with pytest.raises(UserError, match="revffn.calibration_data.*no examples"):
        file_rows(str(empty), tok, 1024, "revffn.calibration_data")
    with pytest.raises(UserError, match="revffn.calibration_data.*fewer than.*revffn.calibration_tokens=1024.*Fix"):
        file_rows(str(short), tok, 1024, "revffn.calibration_data", budget_key="revffn.calibration_tokens")
    rows = file_rows("builtin:retention_test", tok, 1000, "revffn.calibration_data")
    assert rows.shape == (7, 128)  # rounded down to whole rows

"""RevFFN's stages: stage 1 heals the adapters by KL to the unconverted model; stage 2's optional
distillation term is KL to a frozen copy of the original weights. Checked against plain references:
full (B, T, V) logits of the unconverted HF model and `F.kl_div`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from revffn.cli import main
from revffn.methods import method_class
from revffn.methods.revffn import RECOMPUTE_CHUNK_TOKENS
from revffn.models.loading import load_hf
from revffn.training.config import load_config
from revffn.training.step import build_run, train_step
from tests.methods._util import batch, metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 2, hidden_size: 64, vocab_size: 500}",
        "method=revffn", "dtype=float32", "device=cpu", "revffn.coupling=additive", "revffn.adapter_init=coordinate",
        "revffn.heal_data=self",
        "learning_rate=1e-3",
        "per_device_train_batch_size=2", "max_steps=6"]
BUFFERED = [o for o in TINY if not o.startswith("revffn.")] + ["revffn.coupling=buffered"]  # (no adapter options)


def _run(*overrides: str):
    cfg = load_config(None, [*TINY, *overrides])
    return cfg, build_run(cfg, torch.device("cpu"))


def _kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Summed KL(teacher ‖ student) over `positions` (B, T) from full logits: the reference."""
    t = F.log_softmax(teacher_logits[positions].double(), -1)
    s = F.log_softmax(student_logits[positions].double(), -1)
    return F.kl_div(s, t, log_target=True, reduction="sum")


def _original(cfg) -> torch.nn.Module:
    """The unconverted HF model, rebuilt as the run built it (same seed => same weights)."""
    return load_hf(cfg.model, seed=cfg.seed, **cfg.model_config).eval()


def test_heal_step_is_kl_to_the_unconverted_model_and_trains_only_adapters():
    cfg, run = _run("revffn.adapter_warmup_steps=3")  # heal_data: self (the default)
    model, method = run.model, run.method
    [mb] = method.step_batches(model, 0, [batch(vocab=500)])
    assert mb["input_ids"].shape == (2, 128) and torch.equal(mb["labels"], mb["input_ids"])
    with torch.no_grad():
        ref_teacher = _original(cfg)(input_ids=mb["input_ids"]).logits
        student = model(mb["input_ids"]).logits
    positions = torch.zeros_like(mb["input_ids"], dtype=torch.bool)
    positions[:, :-1] = True  # position t predicts token t + 1
    expected = _kl(ref_teacher, student, positions)
    adapters = {id(p) for p in model.adapter_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    result = train_step(run, 0, [batch(vocab=500)])  # the task batch is replaced by heal text
    assert result.stage == "heal" and result.n_tokens == 2 * 127
    assert float(result.loss_sum) == pytest.approx(float(expected), rel=1e-4)  # fp32 vs fp64 sums
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert moved and all(id(dict(model.named_parameters())[n]) in adapters for n in moved)
    # the same step's rows again (an exact resume): a function of the step alone
    assert torch.equal(method.step_batches(model, 0, [batch()])[0]["input_ids"], mb["input_ids"])
    assert not torch.equal(method.step_batches(model, 1, [batch()])[0]["input_ids"], mb["input_ids"])


def test_frozen_adapters_heal_in_stage_1_and_stay_put_in_stage_2():
    """revffn.train_adapters=false: stage 1 trains the adapters, stage 2 everything else (the routers frozen)
    but not them; with the default (true) stage 2 moves them too."""
    for train in (False, True):
        _, run = _run("revffn.adapter_warmup_steps=1", "revffn.fold_adapters=false",
                      f"revffn.train_adapters={str(train).lower()}")
        model = run.model
        adapters = {n for n, p in model.named_parameters() if id(p) in {id(q) for q in model.adapter_parameters()}}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert train_step(run, 0, [batch(vocab=500)]).stage == "heal"
        healed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
        assert healed and healed <= adapters
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert train_step(run, 1, [batch(vocab=500)]).stage == "joint"
        moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
        assert moved - adapters  # the model trains either way
        assert (moved & adapters == adapters) if train else not moved & adapters


def test_task_warmup_keeps_the_task_batches():
    _, run = _run("revffn.adapter_warmup_steps=2", "revffn.heal_data=task")
    task = [batch(vocab=500)]
    assert run.method.step_batches(run.model, 0, task) is task
    assert train_step(run, 0, task).stage == "warmup"


def test_distill_term_is_kl_to_the_frozen_original():
    cfg, run = _run("revffn.adapter_warmup_steps=0", "revffn.distill_coef=0.5", "learning_rate=1e-2")
    for step in range(3):  # the backbone trains: the model's own HF layers drift from the original
        train_step(run, step, [batch(vocab=500, seed=step)])
    original = _original(cfg)
    mb = batch(vocab=500, seed=7)
    mb["attention_mask"][1, :5] = 0  # padding is left out of the KL
    with torch.no_grad():
        ref_teacher = original(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"]).logits
        out, extra = run.method.forward(run.model, mb, step=3)
        student = run.model(mb["input_ids"], attention_mask=mb["attention_mask"]).logits
    from revffn.conversion.teacher import teacher_logits

    drifted = teacher_logits(run.model, mb["input_ids"], mb["attention_mask"])
    assert (drifted - ref_teacher).abs().max() > 1e-2  # so a teacher that drifted with training would fail
    positions = mb["attention_mask"].bool()
    expected = 0.5 * _kl(ref_teacher, student, positions)  # a sum: train_step divides by the batch's tokens
    assert float(extra.value) == pytest.approx(float(expected), rel=1e-5)
    assert out.loss_sum is not None  # the task's CE is still the main loss


def test_distill_memory_is_one_more_copy_of_the_weights():
    from revffn.memory.estimate import estimate
    from revffn.models.loading import hf_config

    config = hf_config("qwen1.5-moe-a2.7b")
    cls = method_class("revffn")
    plain = estimate(config, cls, batch=1, seq=512, dtype="bfloat16")
    distill = estimate(config, cls, batch=1, seq=512, dtype="bfloat16", distill_coef=0.5)
    assert distill["weights"] - plain["weights"] == plain["total_params"] * 2  # bf16: 2 bytes per parameter
    assert any("teacher copy" in n for n in distill["notes"])


def test_recompute_chunk_tokens_reaches_the_backward_and_the_estimate():
    """revffn.recompute_chunk_tokens: the converted model recomputes its MoE branches by chunks in the
    training step's backward (2 x 24 tokens by 16: 3 chunks per layer); the default, 1024, leaves a batch of fewer
    tokens whole, and 0 never chunks."""
    _, run = _run("revffn.adapter_warmup_steps=0", "revffn.recompute_chunk_tokens=16")
    assert run.model.recompute_chunk_tokens == 16
    train_step(run, 0, [batch(vocab=500)])
    assert run.model.last_stack_stats["recompute_chunks"] == {0: 3, 1: 3}
    for option, chunk in (([], RECOMPUTE_CHUNK_TOKENS), (["revffn.recompute_chunk_tokens=0"], 0)):
        cfg, run = _run("revffn.adapter_warmup_steps=0", *option)
        assert run.model.recompute_chunk_tokens == chunk
        train_step(run, 0, [batch(vocab=500)])
        assert "recompute_chunks" not in run.model.last_stack_stats
        cls = method_class("revffn")
        assert cls.estimate_options(cfg.section("revffn"))["recompute_chunk_tokens"] == chunk


def test_float64_streams_train_as_float32_streams_where_those_are_exact():
    """revffn.stream_dtype=float64 (exact on a deep pretrained model, tests/models/test_smollm2.py): the streams
    are float64, the sub-blocks still compute in the weights' float32, and on the tiny model, where float32
    streams rebuild exactly, two training steps give the same losses and weights (within fp32 rounding)."""
    results = {}
    for dtype in ("float32", "float64"):
        _, run = _run("revffn.adapter_warmup_steps=0", f"revffn.stream_dtype={dtype}")
        assert run.model.stream_dtype == getattr(torch, dtype)
        losses = [float(train_step(run, i, [batch(vocab=500, seed=i)]).loss_sum) for i in range(2)]
        results[dtype] = losses, {n: p.detach().clone() for n, p in run.model.named_parameters()}
        assert all(p.dtype == torch.float32 for p in run.model.parameters())
    (l32, w32), (l64, w64) = results["float32"], results["float64"]
    assert l32 == pytest.approx(l64, rel=1e-6)
    assert max((w32[n] - w64[n]).abs().max().item() for n in w32) <= 1e-6
    cls = method_class("revffn")
    cfg = load_config(None, [*TINY, "revffn.adapter_warmup_steps=0", "revffn.stream_dtype=float64"])
    assert cls.estimate_options(cfg.section("revffn"))["stream_dtype"] == "float64"


def test_stream_dtype_auto_keeps_float32_where_it_rebuilds_and_takes_float64_where_it_drifts(monkeypatch):
    """The default, auto: on the tiny model float32 streams rebuild each layer's input to far below the tolerance
    (measured, not zero), so they stay; a model they drift on (here: the tolerance set to 0) gets float64."""
    from revffn.conversion import convert as convert_module

    _, run = _run("revffn.adapter_warmup_steps=0")
    assert run.method.opts["stream_dtype"] == "auto"
    streams = run.method.streams
    assert streams["stream_dtype"] == "float32" and run.model.stream_dtype == torch.float32
    assert 0 < streams["float32_rebuild_error"] <= streams["tolerance"] / 100
    monkeypatch.setattr(convert_module, "AUTO_REBUILD_TOL", 0.0)
    _, run = _run("revffn.adapter_warmup_steps=0")
    assert run.method.streams["stream_dtype"] == "float64" and run.model.stream_dtype == torch.float64
    assert run.method.state_dict()["streams"] == run.method.streams  # what a resume takes back


@pytest.mark.integration
def test_a_resumed_run_keeps_the_streams_auto_picked(tmp_path, monkeypatch):
    """stream_dtype auto picks once, on the weights the run started from; a resume (whose adapters come from the
    checkpoint, not a calibration) does not measure again and runs, and exports, the first run's streams."""
    import json

    from revffn.conversion import convert as convert_module

    args = [*TINY, "model_config={num_hidden_layers: 2, hidden_size: 64}", "revffn.adapter_warmup_steps=2",
            "data=builtin:reversal_train", "eval_data=null", "max_seq_length=32", "max_steps=4", "save_steps=2"]
    monkeypatch.setattr(convert_module, "AUTO_REBUILD_TOL", 0.0)  # a model float32 streams drift on
    assert main(["train", *args, f"output_dir={tmp_path / 'run'}"]) == 0
    first = json.loads((tmp_path / "run" / "final" / "revffn.json").read_text())
    assert first["stream_dtype"] == "float64" and first["streams"]["stream_dtype"] == "float64"

    def measured(*a, **k):
        raise AssertionError("a resumed run measured the streams again")

    monkeypatch.setattr("revffn.methods.revffn.pick_stream_dtype", measured)
    assert main(["train", *args, f"output_dir={tmp_path / 'resumed'}",
                 f"resume={tmp_path / 'run' / 'checkpoints' / 'step-2'}"]) == 0
    resumed = json.loads((tmp_path / "resumed" / "final" / "revffn.json").read_text())
    assert resumed["stream_dtype"] == "float64" and resumed["streams"] == first["streams"]


@pytest.mark.integration
def test_heal_stage_resumes_exactly(tmp_path):
    """Heal steps 1-4 on `self` text, joint steps 5-6 with distillation; resumed from step 3."""
    args = [*TINY, "model_config={num_hidden_layers: 2, hidden_size: 64}", "revffn.adapter_warmup_steps=4",
            "revffn.distill_coef=0.5", "data=builtin:reversal_train",
            "eval_data=null", "max_seq_length=32", "save_steps=3", "logging_steps=1"]
    assert main(["train", *args, f"output_dir={tmp_path / 'ref'}"]) == 0
    import shutil

    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    assert main(["train", *args, f"output_dir={tmp_path / 'run'}", "resume=true"]) == 0
    ref = {r["step"]: (r["stage"], r["loss"]) for r in metrics(tmp_path / "ref")}
    resumed = {r["step"]: (r["stage"], r["loss"]) for r in metrics(tmp_path / "run")}
    assert [ref[s][0] for s in range(1, 7)] == ["heal"] * 4 + ["joint"] * 2
    for s in range(1, 7):
        assert resumed[s][0] == ref[s][0] and abs(resumed[s][1] - ref[s][1]) <= 1e-6, (s, resumed[s], ref[s])


def test_empty_heal_data_exits_2_and_writes_nothing(tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    run = tmp_path / "run"
    assert main(["train", *TINY, "model_config={num_hidden_layers: 2}", "revffn.adapter_warmup_steps=2",
                 f"revffn.heal_data={empty}",
                 "data=builtin:reversal_train", f"output_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "revffn.heal_data" in err and "Fix:" in err and not run.exists()


@pytest.mark.parametrize("ratio,steps,expected", [(0.33, 60, 20), (0.33, 4, 1), (0.9, 4, 3), (0.0, 10, 1)])
def test_adapter_warmup_ratio_sets_stage_1_and_leaves_a_stage_2(ratio, steps, expected):
    cls = method_class("revffn")
    assert cls.warmup_steps({"adapter_warmup_steps": 50, "adapter_warmup_ratio": ratio}, steps) == expected
    assert cls.warmup_steps({"adapter_warmup_steps": 7, "adapter_warmup_ratio": None}, steps) == 7
    cfg = load_config(None, ["model=tiny-qwen2-moe", "output_dir=/tmp/unused", f"max_steps={steps}",
                             "revffn.coupling=additive", "revffn.adapter_warmup_steps=50",
                             f"revffn.adapter_warmup_ratio={ratio}"])
    cls.validate(cfg)  # adapter_warmup_steps=50 alone would leave no stage-2 step
    assert cls(cfg).opts["adapter_warmup_steps"] == expected


def test_a_resume_does_not_calibrate_and_keeps_the_calibration_report(tmp_path, monkeypatch):
    """The checkpoint holds the calibrated adapters: a resumed run makes no calibration pass, reproduces the
    uninterrupted losses, and its final/ keeps the first run's calibration report."""
    import json
    import shutil

    from revffn.methods import calibration

    calls = []
    real = calibration.calibrate_model
    monkeypatch.setattr(calibration, "calibrate_model", lambda *a, **k: calls.append(1) or real(*a, **k))
    args = [*TINY, "model_config={num_hidden_layers: 2, hidden_size: 64}", "revffn.adapter_init=calibrated",
            "revffn.calibration_data=self", "revffn.calibration_tokens=512", "revffn.adapter_warmup_steps=2",
            "data=builtin:reversal_train",
            "eval_data=null", "max_seq_length=32", "save_steps=3", "logging_steps=1"]
    assert main(["train", *args, f"output_dir={tmp_path / 'ref'}"]) == 0
    assert len(calls) == 1
    shutil.copytree(tmp_path / "ref", tmp_path / "run")
    assert main(["train", *args, f"output_dir={tmp_path / 'run'}", "resume=true"]) == 0
    assert len(calls) == 1  # no second calibration
    ref = {r["step"]: r["loss"] for r in metrics(tmp_path / "ref")}
    resumed = {r["step"]: r["loss"] for r in metrics(tmp_path / "run")}
    assert all(abs(resumed[s] - ref[s]) <= 1e-6 for s in range(1, 7)), (resumed, ref)
    report = json.loads((tmp_path / "run" / "final" / "revffn.json").read_text())["calibration"]
    assert report == json.loads((tmp_path / "ref" / "final" / "revffn.json").read_text())["calibration"]


def test_the_buffered_coupling_trains_every_weight_but_the_routers_from_the_first_step():
    """`revffn.coupling: buffered`: no adapters, no calibration, no stage 1: step 0 is stage 2, and a step moves
    every parameter but the frozen routers'."""
    from revffn.methods.base import non_router_parameters

    cfg = load_config(None, BUFFERED)
    run = build_run(cfg, torch.device("cpu"))
    model, method = run.model, run.method
    assert model.coupling == "buffered" and model.adapter_parameters() == [] and method.calibration is None
    assert method.stage(0) == "joint" and method.steady_state_step() == 0
    trained = {id(p) for p in non_router_parameters(model, True)}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for i in range(2):
        assert train_step(run, i, [batch(vocab=500)]).stage == "joint"
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    named = dict(model.named_parameters())
    assert moved == {n for n in named if id(named[n]) in trained} and len(moved) < len(named)


def test_the_buffered_coupling_refuses_a_bad_buffer_and_a_heal(tmp_path, capsys):
    assert main(["train", *BUFFERED, "revffn.buffer_bits=9", "data=builtin:reversal_train",
                 f"output_dir={tmp_path / 'run'}"]) == 2
    assert "revffn.buffer_bits" in capsys.readouterr().err and not (tmp_path / "run").exists()
    out = tmp_path / "converted"
    assert main(["convert", "builtin:base", "--out", str(out), "--coupling", "buffered", "--heal-steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "--heal-steps" in err and "Fix:" in err and not out.exists()


@pytest.mark.parametrize("extra,says", [
    (["revffn.coupling=buffered", "revffn.stream_width=half"],
     "revffn.stream_width=half: read only with revffn.coupling=additive, and this run has revffn.coupling=buffered"),
    (["revffn.buffer_bits=4"], "revffn.buffer_bits=4: read only with revffn.coupling=buffered"),
    (["revffn.coupling=buffered", "revffn.calibration_tokens=64", "revffn.heal_norms=true"],
     "revffn.calibration_tokens=64: read only with revffn.coupling=additive"),
])
def test_an_option_the_run_would_not_read_is_refused(extra, says, tmp_path, capsys):
    """A value other than the default for the other coupling's option was ignored (an additive config of before stop
    47 trained the buffered coupling): now exit 2 before the run directory, naming it and what reads it."""
    base = BUFFERED if "revffn.coupling=buffered" in extra else TINY
    out = tmp_path / "run"
    assert main(["validate", "", *base, *[e for e in extra if e != "revffn.coupling=buffered"],
                 "data=builtin:reversal_train", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert says in err and "it would change nothing. Fix: drop " in err and not out.exists(), err
    # the same values where they are read, a default value where nothing reads it, and a feature's options beside
    # its switch turned off (no stage 1, no distillation) pass
    assert load_config(None, [*TINY, "revffn.adapter_warmup_steps=0", "revffn.calibration_tokens=64",
                              "revffn.heal_norms=true", "revffn.buffer_bits=6", "revffn.teacher_cache=cache",
                              "data=builtin:reversal_train"])
    assert load_config(None, [*BUFFERED, "revffn.buffer_bits=4", "revffn.stream_width=full"])


@pytest.mark.parametrize("argv,says", [
    (["convert", "builtin:base", "--calibration-tokens", "256"], "--calibration-tokens: read only with --coupling "
     "additive, and this conversion has the buffered coupling"),
    (["convert", "builtin:base", "--no-adapter-skip"], "--no-adapter-skip: read only with --coupling additive"),
    (["convert", "builtin:base", "--coupling", "additive", "--heal-lr", "1e-4"],
     "--heal-lr: read only with --heal-steps N, and this conversion has the additive coupling and no --heal-steps"),
    (["convert", "builtin:base", "--coupling", "additive", "--heal-steps", "2", "--buffer-bits", "4"],
     "--buffer-bits: read only with --coupling buffered"),
    (["check", "--adapter-init", "zero"], "--adapter-init: read only with --coupling additive, and this check has "
     "--coupling buffered (the default)"),
    (["check", "--coupling", "additive", "--buffer-momentum", "negative"],
     "--buffer-momentum: read only with --coupling buffered"),
    (["estimate", "--model", "tiny-qwen2-moe", "--method", "revffn", "--option", "stream_width=half"],
     "--option stream_width=half: read only with coupling=additive, and this estimate has coupling=buffered"),
    (["estimate", "--model", "tiny-qwen2-moe", "--method", "revffn", "--option", "coupling=additive", "--option",
      "buffer_bits=4"], "--option buffer_bits=4: read only with coupling=buffered"),
])
def test_a_flag_the_command_would_not_read_is_refused(argv, says, tmp_path, capsys):
    out = tmp_path / "converted"
    assert main([*argv, *(["--out", str(out)] if argv[0] == "convert" else [])]) == 2
    err = capsys.readouterr().err
    assert says in err and "Fix: drop " in err and not out.exists(), err

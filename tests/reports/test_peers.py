"""`revffn bench --peers`: transformers' own Trainer on the bench's model and batch, measured the same way."""

import json

import pytest
import torch

from revffn import cli
from revffn.conversion.causal_lm import CausalLM
from revffn.models.loading import build_hf
from revffn.reports.bench import BenchSpec, worker_args
from revffn.reports.workers import peer

pytestmark = pytest.mark.integration  # real Trainer runs, subprocess workers

SPEC = BenchSpec("tiny-qwen2-moe", ["full"], 2, None, 2, 32, 2, "float32", "cpu")


def _first_loss_of_revffn_full() -> float:
    """The loss `full` (revffn's CausalLM, with the router's load-balancing term) computes on the bench's batch."""
    args = worker_args(SPEC, "full")
    hf = build_hf(args["model"], torch.float32, 0, torch.device("cpu"), **args["model_config"])
    ids = torch.randint(3, hf.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model = CausalLM(hf).train()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, return_logits=False)
    return float(out.loss_sum / out.n_tokens + model.aux_loss_coef * out.aux_loss)  # as HF's, output_router_logits


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_trainer_really_ran_on_the_same_model_and_batch(checkpointing):
    row = peer.run(worker_args(SPEC, "hf-trainer" + ("+ckpt" if checkpointing else "")))
    assert row["status"] == "ok", row
    assert row["trainer"] == "transformers.Trainer" and row["checkpointing"] is checkpointing
    assert row["global_step"] == SPEC.steps + 1  # one warm-up step, then the timed ones
    losses = [e["loss"] for e in row["log_history"] if "loss" in e]
    assert len(losses) == SPEC.steps + 1 and len(row["step_times_s"]) == SPEC.steps
    # its first step's loss is revffn `full`'s on the same weights and batch: the same training
    assert losses[0] == pytest.approx(_first_loss_of_revffn_full(), abs=1e-5)
    assert row["tokens_per_s"] > 0 and row["activation_bytes"] > 0  # (peak: only in a fresh process, below)
    assert row["grad_bytes"] == row["param_bytes"] and row["optimizer_state_bytes"] == 2 * row["param_bytes"]


def test_bench_with_peers_writes_their_rows_side_by_side(tmp_path):
    assert cli.main(["bench", "--model", "tiny-qwen2-moe", "--methods", "ckpt", "--layers", "2", "--batch", "2",
                     "--seq", "64", "--steps", "1", "--peers", "hf-trainer", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["method"]: r for r in data["results"]}
    assert list(rows) == ["ckpt", "hf-trainer", "hf-trainer+ckpt"]
    assert data["run_info"]["worker_env"] == {"MALLOC_MMAP_THRESHOLD_": "131072"}
    for label in ("hf-trainer", "hf-trainer+ckpt"):
        r = rows[label]
        assert r["status"] == "ok" and r["global_step"] == 2 and r["log_history"] and r["peak_mem_bytes"] > 0, r
        assert r["static_bytes"] == pytest.approx(r["est_static_bytes"], rel=0.1)
    # checkpointing keeps less for backward; the peer's loss keeps the whole fp32 log-softmax, revffn's a chunk
    assert rows["hf-trainer+ckpt"]["activation_bytes"] < rows["hf-trainer"]["activation_bytes"]
    assert rows["ckpt"]["activation_bytes"] < rows["hf-trainer+ckpt"]["activation_bytes"]
    md = (tmp_path / "bench.md").read_text()
    assert "÷ hf-trainer+ckpt" in md and "| hf-trainer+ckpt | ok |" in md and "transformers.Trainer" in md


@pytest.mark.parametrize("argv, says", [(["--peers", "hf-trainr"], "unknown peer"),
                                        (["--peers", "hf-trainer", "--nproc", "2"], "--peers with --nproc")])
def test_bad_peers_exit_2(tmp_path, argv, says, capsys):
    assert cli.main(["bench", "--out", str(tmp_path), "--layers", "1", "--methods", "full", *argv]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "bench.json").exists()


def test_a_peer_with_ckpt_names_only_that_run():
    from revffn.reports.bench import check_peers, peer_labels

    check_peers(["hf-trainer+ckpt"], 1)
    assert peer_labels(["hf-trainer+ckpt", "trl-sft"]) == ["hf-trainer+ckpt", "trl-sft", "trl-sft+ckpt"]


def test_trl_peer_needs_trl(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert cli.main(["bench", "--out", str(tmp_path), "--layers", "1", "--methods", "full", "--peers", "trl-sft"]) == 2
    assert "pip install trl" in capsys.readouterr().err


@pytest.mark.parametrize("checkpointing", [False, True])
def test_trl_sft_trainer_really_ran_on_the_same_model_and_batch(checkpointing):
    """TRL is optional: where it is installed, its SFTTrainer trains the bench's model on the bench's batch."""
    pytest.importorskip("trl")
    row = peer.run(worker_args(SPEC, "trl-sft" + ("+ckpt" if checkpointing else "")))
    assert row["status"] == "ok", row
    assert row["trainer"] == "trl.SFTTrainer" and row["checkpointing"] is checkpointing
    assert row["global_step"] == SPEC.steps + 1
    losses = [e["loss"] for e in row["log_history"] if "loss" in e]
    assert len(losses) == SPEC.steps + 1 and len(row["step_times_s"]) == SPEC.steps
    assert losses[0] == pytest.approx(_first_loss_of_revffn_full(), abs=1e-5)
    assert row["grad_bytes"] == row["param_bytes"] and row["optimizer_state_bytes"] == 2 * row["param_bytes"]

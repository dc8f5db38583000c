"""`report_to`: TensorBoard, wandb (offline) and MLflow (a local file store) receive every metrics.jsonl
line, the same values at the same steps, read back from what each one wrote; on rank 0 only; a resumed
run's TensorBoard matches its metrics.jsonl. wandb and MLflow are skipped where they are not installed."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from revffn.training import loop
from revffn.training.config import load_config

REPO = Path(__file__).resolve().parents[2]
FAULT_RUN = Path(__file__).with_name("fault_run.py")
TINY = ["model=tiny-qwen2-moe", "model_config={num_hidden_layers: 1, hidden_size: 32}", "data=builtin:reversal_train",
        "eval_steps=2", "eval_generate_limit=0", "max_steps=4", "logging_steps=1", "save_steps=0",
        "per_device_train_batch_size=2", "max_seq_length=32", "dtype=float32", "device=cpu",
        "revffn.coupling=additive", "revffn.adapter_warmup_steps=1"]  # stage warmup at step 1, joint after: a text
# field that changes
FLOAT32 = 1e-6  # TensorBoard keeps scalars as float32


def _config(tmp_path: Path, *over: str):
    """TINY writing to tmp_path/run, evaluated (eval_loss at steps 2 and 4) on 4 examples of its own."""
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text("".join(json.dumps({"instruction": f"Reverse: a b {i}", "output": f"{i} b a"}) + "\n"
                                 for i in range(4)))
    return load_config(None, [*TINY, f"eval_data={eval_data}", f"output_dir={tmp_path / 'run'}", *over])


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _series(rows: list[dict]) -> dict[str, list[tuple[int, object]]]:
    """metrics.jsonl by field: name -> [(step, value)] for the steps that logged it."""
    out: dict[str, list] = {}
    for r in rows:
        for k, v in r.items():
            if k != "step":
                out.setdefault(k, []).append((r["step"], v))
    return out


def _numbers(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    return {k: s for k, s in _series(rows).items() if all(isinstance(v, (int, float)) for _, v in s)}


def _tensorboard(log_dir: Path) -> tuple[dict, dict]:
    """(scalars, texts) read back with TensorBoard's own reader, which applies `purge_step`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    texts = {t.removesuffix("/text_summary"): [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)]
             for t in acc.Tags()["tensors"]}
    return scalars, texts


def _assert_scalars_are_metrics(scalars: dict, rows: list[dict]) -> None:
    """Every number of metrics.jsonl is a scalar with the same value at the same step; nothing else is."""
    expected = _numbers(rows)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes"} <= expected.keys()
    assert scalars.keys() == expected.keys()
    for tag, series in expected.items():
        assert [s for s, _ in scalars[tag]] == [s for s, _ in series], tag
        assert [v for _, v in scalars[tag]] == pytest.approx([v for _, v in series], rel=FLOAT32), tag


def _assert_tensorboard_is_metrics(run_dir: Path, resumed_at: int | None = None) -> list[dict]:
    """The scalars are metrics.jsonl's numbers (eval_loss among them); `stage` is text at each step
    where it changes, and at the first line a resumed run logs (`resumed_at`)."""
    rows = _rows(run_dir)
    scalars, texts = _tensorboard(run_dir / "tensorboard")
    assert "eval_loss" in scalars
    _assert_scalars_are_metrics(scalars, rows)
    changes = [(r["step"], r["stage"]) for i, r in enumerate(rows)
               if i == 0 or rows[i - 1]["stage"] != r["stage"] or r["step"] == resumed_at]
    assert texts == {"stage": changes}
    return rows


@pytest.mark.integration
def test_tensorboard_holds_every_metrics_line_across_a_restart(tmp_path):
    """A crash at step 4 restarts from checkpoint step-2 (`max_restarts`): step 3 is logged twice, and
    the second run's `purge_step` drops the first one's, as metrics.jsonl drops its line."""
    # in a fresh interpreter: `max_restarts` runs each attempt in a forked child, and forking this test
    # process, with the threads earlier tests left behind (trackers' writers), can deadlock the child
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path, "report_to=tensorboard", "save_steps=2",
                                             "max_restarts=1").to_dict()))
    r = subprocess.run([sys.executable, str(FAULT_RUN), "raise@step:4", str(config)], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one writer per run
    rows = _assert_tensorboard_is_metrics(run_dir, resumed_at=3)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and [r["step"] for r in rows if "eval_loss" in r] == [2, 4]
    assert [r["stage"] for r in rows] == ["heal", "joint", "joint", "joint"]  # the defaults: a heal first


def _wandb_records(path: Path):
    """The records of a `.wandb` file (wandb's LevelDB-style log: 32 KiB blocks of CRC, length, type
    chunks, after a 7-byte `:W&B` header), as `wandb_internal_pb2.Record` messages."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunks = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if kind == 0:  # a block's zero padding
            pos += room
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, or LAST of FIRST, MIDDLE..., LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            yield record


def _key(item) -> str:
    """A wandb record item's key (kept either as `key` or as a one-part `nested_key`)."""
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_holds_every_metrics_line(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": tmp_path / "wandb_dir", "WANDB_PROJECT": "revffn-test",
           "WANDB_CONFIG_DIR": tmp_path / "wandb_config", "WANDB_CACHE_DIR": tmp_path / "wandb_cache",
           "WANDB_DATA_DIR": tmp_path / "wandb_data", "WANDB_CONSOLE": "off", "WANDB_SILENT": "true"}
    for var, value in env.items():
        monkeypatch.setenv(var, str(value))
    (tmp_path / "wandb_dir").mkdir()
    loop.train(_config(tmp_path, "report_to=wandb"))
    assert not (tmp_path / "run" / "wandb").exists()  # WANDB_DIR wins over output_dir
    [log] = (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, exit_code = [], {}, None
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {_key(i): json.loads(i.value_json) for i in record.history.item}  # and wandb's _step, _runtime
            history.append({"step": record.history.step.num} | {k: v for k, v in items.items() if k[0] != "_"})
        elif kind == "run":  # wandb.init's: the project, the name and the config
            assert record.run.project == "revffn-test" and record.run.display_name == "run"
            config |= {_key(i): json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "exit":
            exit_code = record.exit.exit_code
    assert history == _rows(tmp_path / "run")  # every field, text included, at its step
    config.pop("_wandb")
    assert config == yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())  # the whole resolved config
    assert exit_code == 0


def test_mlflow_local_holds_every_metrics_line(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store without it
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "revffn-test")
    loop.train(_config(tmp_path, "report_to=mlflow"))
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("revffn-test").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    expected = _numbers(_rows(tmp_path / "run"))
    assert run.data.metrics.keys() == expected.keys()  # `stage` (text) is not a metric
    for key, series in expected.items():
        assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)] == series, key
    params = run.data.params
    assert params["learning_rate"] == "0.001" and params["revffn.adapter_warmup_steps"] == "1"
    assert params["model_config.hidden_size"] == "32"


def test_mlflow_run_of_a_failed_training_is_failed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def fault(point: str, step: int, restart: int) -> None:
        if (point, step) == ("step", 2):
            raise RuntimeError("injected fault at step 2")

    with pytest.raises(RuntimeError, match="injected fault"):
        loop.train(_config(tmp_path, "report_to=mlflow"), fault=fault)
    [run] = MlflowClient(uri).search_runs(["0"])
    assert run.info.status == "FAILED" and run.data.metrics["loss"] == _rows(tmp_path / "run")[0]["loss"]


def test_report_to_takes_a_comma_separated_string_or_a_yaml_list():
    assert load_config(None, ["report_to=tensorboard,wandb"]).report_to == "tensorboard,wandb"
    assert load_config(None, ["report_to=[tensorboard, wandb]"]).report_to == "tensorboard,wandb"


@pytest.mark.integration
def test_only_rank_0_reports_under_torchrun(tmp_path):
    """2 ranks (DDP, gloo): one TensorBoard writer, rank 0's, and it holds rank 0's metrics.jsonl."""
    from tests.training.test_distributed import _torchrun

    r = _torchrun(tmp_path, ["method=full", "per_device_train_batch_size=2", "distributed=ddp",
                             "report_to=tensorboard"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    _assert_scalars_are_metrics(_tensorboard(tmp_path / "tensorboard")[0], _rows(tmp_path))

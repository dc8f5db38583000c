"""Experiment trackers (`report_to`): every metrics.jsonl line also goes to TensorBoard, wandb or MLflow.

    revffn train report_to=tensorboard        # then: tensorboard --logdir OUTPUT_DIR/tensorboard
    WANDB_MODE=offline MLFLOW_TRACKING_URI=sqlite:///mlflow.db revffn train report_to=wandb,mlflow

Each tracker receives the very record rank 0 writes to metrics.jsonl, at its `step`, so what a
dashboard shows is what the report plots; other ranks open none. What each one keeps:

- tensorboard: `torch.utils.tensorboard.SummaryWriter` in `output_dir/tensorboard`. Numbers are scalars
  (float32, TensorBoard's precision); text fields (`stage`, method extras such as `hift_group`) are
  text, written at a run's first line and when they change, so a stage boundary shows as one entry.
  A resumed run purges the events after its checkpoint (`purge_step`), as metrics.jsonl drops its
  lines after it.
- wandb: `wandb.init` with project $WANDB_PROJECT (default "revffn"), name $WANDB_NAME (default the
  output_dir's name), dir $WANDB_DIR (default output_dir) and the config; every field, text included.
  wandb's own variables choose the rest, e.g. WANDB_MODE=offline.
- mlflow: a run in $MLFLOW_TRACKING_URI and $MLFLOW_EXPERIMENT_NAME (mlflow's defaults otherwise), the
  config flattened to dotted params, the numbers as metrics; text fields are left out (MLflow metrics
  are numbers).

A resumed or restarted run opens a new wandb / MLflow run unless their variables name the old one
(WANDB_RUN_ID with WANDB_RESUME=allow; MLFLOW_RUN_ID). `check_trackers` runs in `prepare_run`, so
a tracker whose package is missing stops the run before anything is written.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from revffn.errors import UserError
from revffn.schema import list_items


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _TensorBoard:
    def __init__(self, cfg, run_dir: Path, step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a reader drops the events logged at or after it by the run that crashed
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=step + 1 if step else None)
        self.text: dict[str, str] = {}  # text field -> the value last written

    def log(self, rec: dict) -> None:
        for key, value in rec.items():
            if key == "step":
                continue
            if _is_number(value):
                self.writer.add_scalar(key, value, rec["step"])
            elif self.text.get(key) != str(value):
                self.text[key] = str(value)
                self.writer.add_text(key, str(value), rec["step"])
        self.writer.flush()  # as metrics.jsonl: a killed run keeps every line it logged

    def close(self, failed: bool) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, cfg, run_dir: Path, step: int):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "revffn"),
                              name=os.environ.get("WANDB_NAME", run_dir.resolve().name),
                              dir=os.environ.get("WANDB_DIR", str(run_dir)), config=cfg.to_dict())

    def log(self, rec: dict) -> None:
        self.run.log({k: v for k, v in rec.items() if k != "step"}, step=rec["step"])

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _MLflow:
    def __init__(self, cfg, run_dir: Path, step: int):
        import mlflow

        self.mlflow = mlflow
        mlflow.start_run(run_name=run_dir.resolve().name)
        mlflow.log_params(dict(_flatten(cfg.to_dict())))

    def log(self, rec: dict) -> None:
        self.mlflow.log_metrics({k: float(v) for k, v in rec.items() if k != "step" and _is_number(v)},
                                step=rec["step"])

    def close(self, failed: bool) -> None:
        self.mlflow.end_run("FAILED" if failed else "FINISHED")


TRACKERS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _MLflow}
"""`report_to` name -> adapter; the name is also the package it imports and `pip install`s."""


def _flatten(d: dict, prefix: str = ""):
    """(dotted key, value) for every leaf: `{"lora": {"r": 8}}` -> ("lora.r", 8)."""
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def tracker_names(cfg) -> list[str]:
    """The trackers `report_to` names ("none" names none)."""
    return [name for name in list_items(cfg.report_to) if name != "none"]


def check_trackers(cfg) -> None:
    """Raises UserError naming every tracker in `report_to` whose package cannot be imported."""
    missing = []
    for name in tracker_names(cfg):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        names, many = ", ".join(missing), len(missing) > 1
        raise UserError(f"report_to: {cfg.report_to!r} needs the {names} package{'s' * many}, which "
                        f"{'are' if many else 'is'} not installed. Fix: pip install {' '.join(missing)} (every "
                        f"tracker: pip install 'revffn[track]'), or remove {names} from report_to.")


class Trackers:
    """The trackers `report_to` names, open for one run on rank 0: `log` each metrics record, then `close`."""

    def __init__(self, cfg, run_dir: Path, step: int = 0):
        """`step`: the checkpoint step a resumed run starts from (0: a new run)."""
        self.open: list = []
        try:
            for name in tracker_names(cfg):
                self.open.append(TRACKERS[name](cfg, Path(run_dir), step))
        except BaseException:
            self.close(failed=True)
            raise

    def log(self, rec: dict) -> None:
        """One metrics.jsonl record (its `step` is the x axis) to every tracker."""
        for tracker in self.open:
            tracker.log(rec)

    def close(self, failed: bool = False) -> None:
        """Finish every tracker's run (idempotent); `failed` marks the wandb / MLflow run failed."""
        while self.open:
            self.open.pop().close(failed)

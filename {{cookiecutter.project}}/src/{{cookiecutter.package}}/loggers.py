"""Experiment loggers, chosen by the logger config group: where metrics.csv's rows go as well.

    logger=tensorboard   # the default: event files in <run dir>/tensorboard (make tensorboard)
    logger=csv           # nothing beyond metrics.csv and metrics.jsonl, which every run writes
    logger=wandb         # Weights & Biases: pip install '.[wandb]'; offline by default (wandb sync)
    logger=mlflow        # MLflow: pip install '.[mlflow]'; a file store in <run dir>/mlruns by default

Each is imported only when chosen. A resumed run continues the same logger run; rows past the
checkpoint it resumes from are not logged twice where the logger allows it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from {{ cookiecutter.package }} import PROJECT
from {{ cookiecutter.package }}.config import (
    CsvLoggerConfig,
    MlflowLoggerConfig,
    TensorBoardConfig,
    WandbConfig,
)

TAGS = {
    "loss": "train/loss",
    "accuracy": "train/accuracy",  # of the window's last step
    "grad_norm": "train/grad_norm",  # of the window's last step, with trainer.max_grad_norm set
    "lr": "train/lr",
    "samples_per_s": "perf/samples_per_s",
    "step_time_ms": "perf/step_time_ms",
    "comm_share": "perf/comm_share",
}


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row as tagged scalars; the columns left empty (not measured) are left out."""
    return {tag: row[key] for key, tag in TAGS.items() if row[key] is not None}


class Logger(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NoLogger:
    def log(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoard:
    def __init__(self, run_dir: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run starts again after its checkpoint: forget what was logged past it.
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)

    def log(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, global_step=row["step"])
        self.writer.flush()  # a run that dies keeps its events

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=cfg.project or PROJECT, entity=cfg.entity, mode=cfg.mode.value, dir=str(run_dir),
            name=run_dir.name, id=wandb_id(run_dir), resume="allow", config=config, tags=list(cfg.tags),
        )  # fmt: skip

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


def wandb_id(run_dir: Path) -> str:
    """The same W&B run for every launch into one run dir (a resume continues it)."""
    return "".join(c if c.isalnum() else "-" for c in run_dir.name.lower())[-64:]


class Mlflow:
    def __init__(self, cfg: MlflowLoggerConfig, run_dir: Path, config: dict[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        if cfg.tracking_uri is None:  # a file store: MLflow 3 keeps it, behind this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(cfg.tracking_uri or (run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(cfg.experiment or PROJECT)
        saved = run_dir / "mlflow_run_id"  # a resume continues the same MLflow run
        run_id = saved.read_text().strip() if saved.exists() else None
        run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_dir.name)
        saved.write_text(run.info.run_id + "\n")
        if run_id is None:
            mlflow.log_params(flat(config))

    def log(self, row: dict[str, Any]) -> None:
        self.mlflow.log_metrics(scalars(row), step=row["step"])

    def close(self) -> None:
        self.mlflow.end_run()


def flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def build(cfg: Any, run_dir: Path, start_step: int, config: dict[str, Any]) -> Logger:
    if isinstance(cfg, TensorBoardConfig):
        return TensorBoard(run_dir, start_step)
    if isinstance(cfg, WandbConfig):
        return Wandb(cfg, run_dir, config)
    if isinstance(cfg, MlflowLoggerConfig):
        return Mlflow(cfg, run_dir, config)
    assert isinstance(cfg, CsvLoggerConfig)
    return NoLogger()

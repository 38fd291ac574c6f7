"""Experiment loggers, chosen by the logger config group: where metrics.csv's rows go as well.

    logger=tensorboard   # the default: event files in <run dir>/tensorboard (make tensorboard)
    logger=csv           # nothing beyond metrics.csv and metrics.jsonl, which every run writes
    logger=wandb         # Weights & Biases: pip install '.[wandb]'; offline by default (wandb sync)
    logger=mlflow        # MLflow: pip install '.[mlflow]'; files in <run dir>/mlruns by default
    logger=[tensorboard,wandb]   # several at once; each one's keys: logger.wandb.mode=online

Each is imported only when chosen, and started by what registered as its builder
(@builds(its schema): a class or function given the logger's config, the run dir, the step the run
starts from and the whole config as a dict); check (and train, before any process starts) refuses
a logger whose package is missing, or an MLflow server that does not answer. A resumed run
continues the same logger run; rows past the checkpoint it resumes from are not logged twice where
the logger allows it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Protocol

from .. import PROJECT
from ..config.logger_probes import LoggerError
from ..config.loggers import (
    CsvLoggerConfig,
    LoggersConfig,
    MlflowLoggerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from ..config.overrides import dotted
from ..config.registry import builder_of, builds

log = logging.getLogger(__name__)

TAGS = {
    "loss": "train/loss",
    "accuracy": "train/accuracy",  # of the window's last step
    "grad_norm": "train/grad_norm",  # of the window's last step, with trainer.max_grad_norm set
    "lr": "train/lr",
    "samples_per_s": "perf/samples_per_s",
    "step_time_ms": "perf/step_time_ms",
    "comm_share": "perf/comm_share",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "peak_memory_gib": "perf/peak_memory_gib",
    "val_loss": "val/loss",
    "val_accuracy": "val/accuracy",
    "val_loss_ema": "val/loss_ema",  # trainer.ema_decay's weights
    "val_time_s": "perf/val_time_s",
    "checkpoint_s": "perf/checkpoint_s",
}


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row as tagged scalars; the columns left empty (not measured) are left out."""
    return {tag: row[key] for key, tag in TAGS.items() if row.get(key) is not None}


class Logger(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


FLUSH_S = 10


@builds(CsvLoggerConfig)
def metrics_files_only(
    cfg: CsvLoggerConfig, run_dir: Path, start_step: int, config: dict[str, Any]
) -> None:
    """logger=csv starts nothing: every run writes metrics.csv and metrics.jsonl (RunRecord)."""
    return None


@builds(TensorBoardConfig)
class TensorBoard:
    def __init__(
        self, cfg: TensorBoardConfig, run_dir: Path, start_step: int, config: dict[str, Any]
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run starts again after its checkpoint: forget what was logged past it. The
        # writer's thread flushes every FLUSH_S, and close() at the end or a stop: a flush per
        # log line made the step wait for that thread (seen in a GPU trace), and a run that dies
        # loses FLUSH_S of events at most (metrics.csv keeps every row).
        self.writer = SummaryWriter(
            log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1, flush_secs=FLUSH_S
        )

    def log(self, row: dict[str, Any]) -> None:
        for tag, value in scalars(row).items():
            self.writer.add_scalar(tag, value, global_step=row["step"])

    def close(self) -> None:
        self.writer.close()


@builds(WandbConfig)
class Wandb:
    def __init__(
        self, cfg: WandbConfig, run_dir: Path, start_step: int, config: dict[str, Any]
    ) -> None:
        import wandb

        self.run = wandb.init(
            project=cfg.project or PROJECT,
            entity=cfg.entity,
            mode=cfg.mode.value,
            dir=str(run_dir),
            name=run_dir.name,
            id=wandb_id(run_dir),
            resume="allow",
            config=config,
            tags=list(cfg.tags),
        )

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(scalars(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()


def wandb_id(run_dir: Path) -> str:
    """The same W&B run for every launch into one run dir (a resume continues it)."""
    return "".join(c if c.isalnum() else "-" for c in run_dir.name.lower())[-64:]


def bound_mlflow_requests(timeout_s: int) -> None:
    """MLflow retries an unanswered request 7 times, 120 s each: minutes in which the other ranks
    wait in a collective and then blame each other. Bound its retries well inside dist.timeout_s
    (a value set in the environment wins)."""
    per_request = max(1, timeout_s // 8)  # 3 tries and their back-off take under half of it
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(per_request))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2" if timeout_s >= 30 else "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")


@builds(MlflowLoggerConfig)
class Mlflow:
    def __init__(
        self, cfg: MlflowLoggerConfig, run_dir: Path, start_step: int, config: dict[str, Any]
    ) -> None:
        bound_mlflow_requests(config.get("dist", {}).get("timeout_s", 180))
        import mlflow

        self.mlflow, self.uri = mlflow, cfg.tracking_uri
        if cfg.tracking_uri is None:  # a file store: MLflow 3 keeps it, behind this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(cfg.tracking_uri or (run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(cfg.experiment or PROJECT)
        saved = run_dir / "mlflow_run_id"  # a resume continues the same MLflow run
        run_id = saved.read_text().strip() if saved.exists() else None
        run = mlflow.start_run(run_id=run_id, run_name=None if run_id else run_dir.name)
        saved.write_text(run.info.run_id + "\n")
        if run_id is None:
            mlflow.log_params(dotted(config))

    def log(self, row: dict[str, Any]) -> None:
        self.mlflow.log_metrics(scalars(row), step=row["step"])

    def close(self) -> None:
        self.mlflow.end_run()


def cause(err: BaseException) -> str:
    """An error in one line. MLflow's unanswered request: the request and what ended it, without
    urllib3's retry state."""
    text = " ".join(str(err).split())
    ended = re.search(r"\(Caused by (\w+)", text)
    if " with exception " in text and ended:
        tries = int(os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")) + 1
        each = os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "?")
        text = (
            f"{text.split(' with exception ')[0]}: {ended.group(1)} "
            f"({tries} attempt(s), {each} s each)"
        )
    return f"{type(err).__name__}: {text}"


class Loggers:
    """Every chosen logger, each given every row. One that fails while the run goes on is
    dropped with a warning: metrics.csv and metrics.jsonl keep every row regardless."""

    def __init__(self, named: dict[str, Logger]) -> None:
        self.named = named

    def log(self, row: dict[str, Any]) -> None:
        for name, logger in list(self.named.items()):
            try:
                logger.log(row)
            except Exception as err:
                log.warning(
                    "logger.%s: stopped logging at step %d (%s); metrics.csv keeps every row",
                    name,
                    row["step"],
                    cause(err),
                )
                del self.named[name]

    def close(self) -> None:
        for name, logger in self.named.items():
            try:
                logger.close()
            except Exception as err:
                log.warning("logger.%s: did not close cleanly (%s)", name, cause(err))
        self.named = {}


def build(cfg: LoggersConfig, run_dir: Path, start_step: int, config: dict[str, Any]) -> Loggers:
    """The chosen loggers, started. One that cannot start raises LoggerError naming it; the
    ones started before it are closed."""
    started = Loggers({})
    for name in cfg.chosen():
        chosen = getattr(cfg, name)
        start = builder_of(chosen)
        try:
            logger = start(chosen, run_dir, start_step, config)
        except Exception as err:
            started.close()
            where = getattr(chosen, "tracking_uri", None)
            at = f" ({where})" if where else ""
            raise LoggerError(f"logger.{name}: could not start{at}: {cause(err)}") from err
        if logger is not None:
            started.named[name] = logger
    return started

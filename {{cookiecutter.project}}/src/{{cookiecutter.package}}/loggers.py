"""Experiment loggers, chosen by the logger config group: where metrics.csv's rows go as well.

    logger=tensorboard   # the default: event files in <run dir>/tensorboard (make tensorboard)
    logger=csv           # nothing beyond metrics.csv and metrics.jsonl, which every run writes
    logger=wandb         # Weights & Biases: pip install '.[wandb]'; offline by default (wandb sync)
    logger=mlflow        # MLflow: pip install '.[mlflow]'; a file store in <run dir>/mlruns by default
    logger=[tensorboard,wandb]   # several at once; each one's keys: logger.wandb.mode=online

Each is imported only when chosen, and started by what registered as its builder
(@builds(its schema): a class or function given the logger's config, the run dir, the step the run
starts from and the whole config as a dict); check (and train, before any process starts) refuses a logger
whose package is missing, or an MLflow server that does not answer. A resumed run continues the
same logger run; rows past the checkpoint it resumes from are not logged twice where the logger
allows it.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from . import PROJECT
from .config import dotted
from .config_error import ConfigError
from .logger_config import (
    CsvLoggerConfig,
    LoggersConfig,
    MlflowLoggerConfig,
    TensorBoardConfig,
    WandbConfig,
)
from .registry import builder_of, builds, option_of

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
    "val_time_s": "perf/val_time_s",
    "checkpoint_s": "perf/checkpoint_s",
}
PROBE_S = 5  # how long check waits for a tracking server to accept a connection


class LoggerError(ConfigError):
    """A logger that cannot start or log; the message names its key and the cause."""


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row as tagged scalars; the columns left empty (not measured) are left out."""
    return {tag: row[key] for key, tag in TAGS.items() if row[key] is not None}


def missing_packages(cfg: LoggersConfig) -> str | None:
    """One line naming the chosen loggers whose packages are not installed, and the pip command
    that installs them all; None if all are. find_spec looks without importing."""
    chosen = [option_of(type(getattr(cfg, name))) for name in cfg.chosen()]
    missing = [o for o in chosen if o.package and importlib.util.find_spec(o.package[0]) is None]
    if not missing:
        return None
    extras = ",".join(o.package[1] for o in missing)
    keys = ", ".join(f"logger.{o.name}" for o in missing)
    modules = " and ".join(o.package[0] for o in missing)
    needs = (
        f"needs the {modules} package, which is"
        if len(missing) == 1
        else f"need the {modules} packages, which are"
    )
    return (
        f"{keys}: {needs} not installed here; pip install '{PROJECT}[{extras}]' "
        f"(in the project's folder: pip install -e '.[{extras}]')"
    )


def server_address(uri: str) -> tuple[str, int] | None:
    """The host and port of an http(s) tracking URI; None for any other kind (a folder)."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def unreachable(uri: str, timeout_s: float = PROBE_S) -> str | None:
    """Why nothing accepts a connection at an http(s) tracking URI's host and port, or None."""
    address = server_address(uri)
    if address is None:
        return None
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        if isinstance(err, TimeoutError):
            reason = f"no answer within {timeout_s:g} s"
        return (
            f"logger.mlflow.tracking_uri={uri}: no server answers at {address[0]}:{address[1]} "
            f"({reason}); start the MLflow server, or set logger.mlflow.tracking_uri=null for a "
            "file store in the run dir"
        )
    return None


def unwritable(uri: str) -> str | None:
    """Why MLflow could not write a file: tracking URI's folder here, or None. Tried with a
    temporary file in the folder or its nearest existing parent: nothing is left behind."""
    parts = urlsplit(uri)
    if parts.scheme != "file":
        return None
    folder = Path(parts.path)
    while not folder.exists():
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as err:
        return (
            f"logger.mlflow.tracking_uri={uri}: cannot write in {folder} ({err.strerror}); choose "
            "a folder this user can write, or null for a file store in the run dir"
        )
    return None


def check(cfg: LoggersConfig, timeout_s: float = PROBE_S) -> None:
    """What only this machine can tell about the chosen loggers: their packages, and whether
    MLflow's tracking server answers or its folder can be written. ConfigError (one line) on the
    first problem."""
    problem = missing_packages(cfg)
    if problem is None and cfg.mlflow is not None and cfg.mlflow.tracking_uri is not None:
        uri = cfg.mlflow.tracking_uri
        problem = unreachable(uri, timeout_s) or unwritable(uri)
    if problem:
        raise ConfigError(problem)


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
        # log line made the step wait for that thread (an H200 trace), and a run that dies loses
        # FLUSH_S of events at most (metrics.csv keeps every row).
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
        text = f"{text.split(' with exception ')[0]}: {ended.group(1)} ({tries} attempt(s), {each} s each)"
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
                    name, row["step"], cause(err),
                )  # fmt: skip
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

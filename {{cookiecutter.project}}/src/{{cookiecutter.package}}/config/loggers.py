"""The logger group's schemas: one per option of configs/logger/, and LoggersConfig, which has a
key for each, so that several loggers combine (logger=[tensorboard,wandb])."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass
from enum import Enum
from typing import Any, List, Optional
from urllib.parse import urlsplit

from omegaconf import MISSING

from .error import ConfigError, require
from .registry import option, options


@option("logger", "tensorboard")
@dataclass
class TensorBoardConfig:
    """configs/logger/tensorboard.yaml: event files in <run dir>/tensorboard."""


@option("logger", "csv")
@dataclass
class CsvLoggerConfig:
    """configs/logger/csv.yaml: metrics.csv and metrics.jsonl alone."""


class WandbMode(Enum):
    offline = "offline"  # written to <run dir>/wandb; `wandb sync` uploads it later
    online = "online"
    disabled = "disabled"


@option("logger", "wandb", package=("wandb", "wandb"))
@dataclass
class WandbConfig:
    """configs/logger/wandb.yaml: Weights & Biases (pip install '.[wandb]')."""

    project: Optional[str] = MISSING
    entity: Optional[str] = MISSING
    mode: WandbMode = MISSING
    tags: List[str] = MISSING

    def __post_init__(self) -> None:
        # W&B's own limits (wandb_settings), which it reports only once the run starts.
        project = self.project
        require(
            project is None
            or (
                len(project.strip()) > 0
                and len(project) <= 128
                and not set(project) & set("/\\#?%:")
            ),
            "logger.wandb.project",
            repr(project),
            "must be null (this project's name) or a name of 1 to 128 characters "
            "without / \\ # ? % :",
        )
        require(
            self.entity is None or self.entity.strip() != "",
            "logger.wandb.entity",
            repr(self.entity),
            "must be null (your default entity) or a name that is not blank",
        )
        require(
            all(0 < len(tag) <= 64 for tag in self.tags),
            "logger.wandb.tags",
            self.tags,
            "each tag must be 1 to 64 characters",
        )


# The tracking URIs MLflow-skinny can use without a database driver: a server, or a folder.
MLFLOW_SCHEMES = ("http", "https", "file")


@option("logger", "mlflow", package=("mlflow", "mlflow"))
@dataclass
class MlflowLoggerConfig:
    """configs/logger/mlflow.yaml: MLflow (pip install '.[mlflow]')."""

    tracking_uri: Optional[str] = MISSING
    experiment: Optional[str] = MISSING

    def __post_init__(self) -> None:
        if self.tracking_uri is not None:
            problem = mlflow_uri_problem(self.tracking_uri)
            if problem:
                raise ConfigError(f"logger.mlflow.tracking_uri={self.tracking_uri}: {problem}")
        require(
            self.experiment is None or self.experiment.strip() != "",
            "logger.mlflow.experiment",
            repr(self.experiment),
            "must be null (this project's name) or a name that is not blank",
        )


def mlflow_uri_problem(uri: str) -> str | None:
    """Why MLflow could not use this tracking URI, or None."""
    parts = urlsplit(uri)
    if uri == "databricks" or parts.scheme == "databricks":  # a Databricks CLI profile
        return None
    allowed = (
        "use http(s)://host:port for a server, file:/absolute/path for a folder, "
        "or null for a file store in the run dir"
    )
    if parts.scheme not in MLFLOW_SCHEMES:
        return f"{parts.scheme or 'no'} scheme; {allowed}"
    if parts.scheme == "file":
        return None if parts.path.startswith("/") else f"not an absolute path; {allowed}"
    try:
        port = parts.port
    except ValueError as err:  # not a number, or out of range
        return f"{err}; {allowed}"
    if not parts.hostname or port == 0:
        return f"no host and port to reach; {allowed}"
    return None


def chosen_loggers(self: Any) -> list[str]:
    """LoggersConfig.chosen(): the loggers a config uses, in the order they registered."""
    return [f.name for f in fields(self) if getattr(self, f.name) is not None]


# configs/logger/*.yaml: each logger option sets its own key, so that several combine:
# logger=[tensorboard,wandb]; a key left null is a logger not used. A key for each logger option
# registered above, in that order.
LoggersConfig = make_dataclass(
    "LoggersConfig",
    [(o.name, Optional[o.schema], field(default=None)) for o in options("logger")],
    namespace={"chosen": chosen_loggers, "__module__": __name__},
)

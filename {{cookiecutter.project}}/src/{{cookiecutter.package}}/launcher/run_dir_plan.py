"""The run dir as the launcher sees it before any worker starts (the one it will be, where it can
tell), and what a stopped launch that made it removes again."""

from __future__ import annotations

from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig

from ..config.error import ConfigError
from ..core.caches import FOLDER
from ..run import rundir
from ..run.layout import checkpoint_paths


def explicit_run_dir(overrides: list[str]) -> Path | None:
    """hydra.run.dir when given as a plain path, read as Hydra reads it (quotes and escapes
    removed); a default dir is new for every launch. An empty one raises ConfigError."""
    for override in overrides:
        try:
            (parsed,) = OverridesParser.create().parse_overrides([override])
        except Exception:  # the config check has named it already
            continue
        if parsed.key_or_group == "hydra.run.dir" and not parsed.is_delete():
            value = parsed.value()
            problem = rundir.empty(value, "hydra.run.dir")
            if problem:
                raise ConfigError(problem)
            if isinstance(value, (str, int, float)) and "${" not in str(value):
                return Path(str(value))
    return None


def planned_run_dir(composed: DictConfig) -> Path | None:
    """The run dir the workers will use, from the config as the launcher composed it (with its
    hydra node; the launcher named the run), or None where it cannot tell. An empty one raises
    ConfigError."""
    try:
        value = composed.hydra.run.dir
    except Exception:  # an interpolation only a worker can resolve: the workers' guard decides
        return None
    problem = rundir.empty(value, "hydra.run.dir")
    if problem:
        raise ConfigError(problem)
    return Path(value)


def new_part(path: Path) -> Path:
    """The topmost of path and its parents that does not exist yet."""
    while not rundir.present(path.parent) and path.parent != path:
        path = path.parent
    return path


def remove_empty(path: Path, top: Path) -> None:
    """path and its parents up to top, each if empty (this launch made them)."""
    for folder in (path, *path.parents):
        if not folder.is_relative_to(top):
            return
        try:
            folder.rmdir()
        except OSError:  # not empty, gone, or a name that cannot exist
            if rundir.present(folder):
                return


def of_value(run_dir: Path) -> bool:
    """Whether a run dir holds anything a run made: a checkpoint, a metrics row, or a
    logger's files (TensorBoard, W&B, MLflow) written before the first row; not the start-up log."""
    rows = run_dir / "metrics.jsonl"
    if checkpoint_paths(run_dir) or (rows.exists() and rows.stat().st_size > 0):
        return True
    made_at_start = {
        ".hydra",
        ".lock",
        "train.log",
        "metrics.jsonl",
        "metrics.csv",
        "config.yaml",
        "nccl",
        FOLDER,  # the compile cache, where the runs' folder could not hold it
    }
    return any(
        path.name not in made_at_start
        and (any(path.iterdir()) if path.is_dir() else path.stat().st_size > 0)
        for path in run_dir.iterdir()
    )

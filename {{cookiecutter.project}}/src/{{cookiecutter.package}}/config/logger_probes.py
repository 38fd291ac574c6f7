"""The chosen loggers as this machine finds them, before any process starts: each one's package
installed, and MLflow's tracking server answering (or its file store writable). check and train
refuse a logger that could not start, in one line naming its key."""

from __future__ import annotations

import errno
import importlib.util
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from .. import PROJECT
from .error import ConfigError
from .loggers import LoggersConfig
from .registry import option_of

PROBE_S = 5  # how long check waits for a tracking server to accept a connection


class LoggerError(ConfigError):
    """A logger that cannot start or log; the message names its key and the cause."""


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

"""The run dir: one run at a time, a resume that continues the same experiment, and a directory
that can be written. Checked before anything is written there, in one line each.

RunDirGuard runs as a Hydra callback (configs/train.yaml) in every worker, before Hydra creates
the dir; the launcher (`{{ cookiecutter.project }} train`) runs the same checks before torchrun starts.
Global rank 0 holds an exclusive lock on `<run dir>/.lock` for the life of its process: the
kernel drops it when the process ends, however it ends, so a dead run's lock is taken over.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from {{ cookiecutter.package }} import checkpoint
from {{ cookiecutter.package }}.config import ConfigError, TrainConfig, exit_with_error, typed
from {{ cookiecutter.package }}.world import World

LOCK = ".lock"
# A holder on another host (a pod on its way out while its replacement starts) gets this long.
REMOTE_HOLDER_WAIT_S = 120
# Keys that do not change what a run computes: a resume may change them freely.
FREE_ON_RESUME = (
    "trainer.max_steps", "trainer.log_every", "trainer.checkpoint_every", "trainer.keep_checkpoints",
    "trainer.on_nonfinite", "trainer.accept_changes", "data.num_workers", "data.pin_memory",
    "data.on_device", "dist.backend", "dist.timeout_s", "dist.gate_timeout_s",
    "dist.checkpoint_timeout_s", "dist.async_error_handling", "dist.bucket_cap_mb",
    "dist.gradient_as_bucket_view", "dist.static_graph", "dist.time_comm", "nccl.", "deploy.", "logger.",
)  # fmt: skip
_held: dict[Path, int] = {}  # run dir -> the open lock file, for the life of this process


class RunDirError(ConfigError):
    """The run dir cannot be used for this run; the message is the one line to print."""


def unusable(run_dir: Path) -> str | None:
    """Why this process cannot create and write the run dir, or None."""
    if run_dir.exists() and not run_dir.is_dir():
        return f"hydra.run.dir={run_dir}: is a file, not a directory; choose another hydra.run.dir"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"hydra.run.dir={run_dir}: cannot be created ({err.strerror})"
    if not os.access(run_dir, os.W_OK | os.X_OK):
        return f"hydra.run.dir={run_dir}: not writable by this user"
    return None


def holder(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / LOCK).read_text())
    except (OSError, ValueError):
        return {}


def busy_message(run_dir: Path, who: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who.get("since", 0)))
    return (
        f"hydra.run.dir={run_dir}: in use by pid {who.get('pid', '?')} on {who.get('host', '?')} "
        f"since {since}; wait for that run to end, or choose another hydra.run.dir"
    )


def alive_here(who: dict[str, Any]) -> bool:
    return who.get("host") == socket.gethostname() and Path(f"/proc/{who.get('pid')}").exists()


def acquire(run_dir: Path, wait_s: float = REMOTE_HOLDER_WAIT_S) -> None:
    """Hold the run dir's lock until this process ends. A holder on this host is refused at once;
    one on another host is waited for up to wait_s."""
    if run_dir in _held:
        return
    fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            who = holder(run_dir)
            if alive_here(who) or time.monotonic() > deadline:
                os.close(fd)
                raise RunDirError(busy_message(run_dir, who)) from None
            time.sleep(1)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
          "command": " ".join(sys.argv)[:300]}  # fmt: skip
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _held[run_dir] = fd


def refuse_if_busy(run_dir: Path) -> None:
    """For the launcher: a run dir that another process holds is refused before torchrun starts."""
    path = run_dir / LOCK
    if not path.exists():
        return
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirError(busy_message(run_dir, holder(run_dir))) from None
    finally:
        os.close(fd)


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {
            k: v for key, value in tree.items() for k, v in flat(value, f"{prefix}{key}.").items()
        }
    return {prefix[:-1]: tree}


def changes_on_resume(saved: dict[str, Any], config: TrainConfig) -> list[tuple[str, Any, Any]]:
    """Keys that change what the run computes and differ from the checkpoint's config, less
    those that trainer.accept_changes names."""
    now = flat(OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True))
    before = flat(saved)
    accepted = set(config.trainer.accept_changes)
    unknown = sorted(accepted - now.keys())
    if unknown:
        raise RunDirError(
            f"trainer.accept_changes: {', '.join(unknown)} is no key of the config; name keys "
            "such as trainer.lr or data.batch_size"
        )
    return [
        (key, before.get(key, "(absent)"), now.get(key, "(absent)"))
        for key in sorted(before.keys() | now.keys())
        if before.get(key) != now.get(key)
        and not key.startswith(FREE_ON_RESUME)
        and key not in accepted
    ]


def resume_problem(run_dir: Path, config: TrainConfig) -> str | None:
    """A resume whose config would change results, as one line, or None."""
    found = checkpoint.newest_readable(run_dir, mmap=True)
    if found is None:
        return None
    path, state = found
    changes = changes_on_resume(state.get("config", {}), config)
    if not changes:
        return None
    listed = ", ".join(f"{key} {old!r} -> {new!r}" for key, old, new in changes)
    keys = ",".join(key for key, _, _ in changes)
    return (
        f"hydra.run.dir={run_dir} resumes from {path.name}, written with another config: {listed}. "
        f"These change results; to continue anyway add trainer.accept_changes=[{keys}], or choose "
        "another hydra.run.dir"
    )


def problem(run_dir: Path, config: TrainConfig, busy: bool = True) -> str | None:
    """Everything the launcher can tell before torchrun starts; `busy`: the lock too."""
    try:
        if busy:
            refuse_if_busy(run_dir)
        return unusable(run_dir) or resume_problem(run_dir, config)
    except RunDirError as err:
        return str(err)


class RunDirGuard(Callback):
    """Hydra calls this after composing the config, before it creates the run dir."""

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        run_dir = Path(config.hydra.run.dir)
        message = unusable(run_dir)  # every rank: Hydra creates the dir in each
        if message is None and World.from_env().main:
            try:
                acquire(run_dir)
                message = resume_problem(run_dir, typed(config))
            except RunDirError as err:
                message = str(err)
        if message:
            exit_with_error(f"config error: {message}")

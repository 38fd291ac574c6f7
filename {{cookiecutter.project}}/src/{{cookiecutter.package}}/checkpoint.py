"""Lose at most the work since the last checkpoint.

Rank 0 writes `<run dir>/checkpoints/step_<N>.pt` atomically (temp file in the same directory,
fsync, rename) and keeps the newest `trainer.keep_checkpoints`. A relaunch with the same run dir
resumes from the newest one that reads back, skipping truncated or corrupt files. On SIGTERM
(what Kubernetes sends before SIGKILL) every rank agrees to stop at the same step boundary, and
rank 0 writes a checkpoint there.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
NAME = re.compile(r"step_(\d{9})\.pt")
EXIT_PREEMPTED = 143  # 128 + SIGTERM, the code a process stopped by SIGTERM conventionally reports


@dataclass(frozen=True)
class Position:
    """Where training stands: optimiser steps done, and batches of the current epoch consumed."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0


def checkpoint_paths(run_dir: Path) -> list[Path]:
    """Checkpoints in the run dir, oldest first."""
    directory = run_dir / "checkpoints"
    found = (
        [p for p in directory.glob("step_*.pt") if NAME.fullmatch(p.name)]
        if directory.is_dir()
        else []
    )
    return sorted(found)


def write_atomically(state: dict[str, Any], path: Path) -> None:
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".partial-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as out:
            torch.save(state, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # make the rename itself durable
    finally:
        os.close(directory)


def save(run_dir: Path, state: dict[str, Any], keep: int) -> Path:
    """Write the checkpoint of state["step"] and drop all but the newest `keep`."""
    path = run_dir / "checkpoints" / f"step_{state['step']:09d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(state, path)
    for old in checkpoint_paths(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def newest_readable(run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, with a warning for each one skipped."""
    for path in reversed(checkpoint_paths(run_dir)):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # truncated, corrupt, or not a checkpoint at all
            log.warning(
                "skipping unreadable checkpoint %s: %s", path.name, " ".join(str(err).split())[:200]
            )
            continue
        if isinstance(state, dict) and {"step", "model", "optimizer", "data"} <= state.keys():
            return path, state
        log.warning("skipping %s: not a training checkpoint", path.name)
    return None


def rng_state() -> dict[str, Any]:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    random.setstate(state["python"])


def gather_rng_states(group: dist.ProcessGroup | None) -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order (a collective: all ranks call it)."""
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state(), group=group)
    return states


def choose_and_load(run_dir: Path, group: dist.ProcessGroup | None) -> dict[str, Any] | None:
    """Rank 0 picks the newest readable checkpoint; every rank then loads that same file."""
    choice: list[Any] = [None]
    if dist.get_rank() == 0:
        found = newest_readable(run_dir)
        choice[0] = str(found[0]) if found else None
    dist.broadcast_object_list(choice, src=0, group=group)
    if choice[0] is None:
        return None
    return torch.load(choice[0], map_location="cpu", weights_only=True)


class Preemption:
    """SIGTERM asks to stop; agreed() makes every rank stop at the same step boundary."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group  # a CPU (gloo) group: the check costs no GPU synchronisation
        self.requested = False
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.pending: dist.Work | None = None
        signal.signal(signal.SIGTERM, self.request)

    def request(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self) -> bool:
        """Reads the all-reduce of the flag started one step earlier and starts the next, so the
        exchange runs during a step instead of inside it. Every rank calls this once per step and
        so gets the same answer at the same step, one step after the signal."""
        if dist.get_world_size(self.group) == 1:
            return self.requested
        stop = False
        if self.pending is not None:
            self.pending.wait()
            stop = bool(self.flag.item())
        self.pending = None
        if not stop:
            self.flag = torch.tensor([int(self.requested)], dtype=torch.int32)
            self.pending = dist.all_reduce(
                self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True
            )
        return stop

    def close(self) -> None:
        """Finish the exchange in flight before the group is used for anything else."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

"""Lose at most the work since the last checkpoint, and never a good checkpoint.

The Checkpointer decides when to save (every trainer.checkpoint_every steps, at the last step, and
at a step its caller forces: the Trainer's stop, stopping.py), what a checkpoint holds, how to
load one, and which to keep. Rank 0 writes `<run dir>/checkpoints/step_<N>.pt` atomically (temp
file in the same directory, fsync, rename). A relaunch with the same run dir resumes from the
newest one that reads back.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import random
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .exits import Exit
from .failfast import NO_WATCHDOG, Heartbeat
from .world import World

log = logging.getLogger(__name__)
NAME = re.compile(r"step_(\d{9})\.pt")
BEST = "best.pt"  # trainer.keep_best's: not a step_ name, so no resume or keep policy touches it
PARTIAL = ".partial-"  # prefix of a write in progress; one left behind was killed mid-write
REQUIRED = {"step", "model", "optimizer", "data"}


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class Progress:
    """Where training stands: optimizer steps done, and batches of the current epoch consumed."""

    step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0

    def state_dict(self) -> dict[str, int]:
        return asdict(self)

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.step, self.epoch, self.batch_in_epoch = (
            state["step"], state["epoch"], state["batch_in_epoch"]
        )  # fmt: skip


class Incompatible(Exception):
    """A checkpoint that cannot be loaded into this run's model or optimizer; one line."""

    exit = Exit.CONFIG_ERROR


class CheckpointFailed(Exception):
    """Rank 0 could not write a checkpoint (a full disk); every rank raises it, with rank 0's
    cause as one line."""

    exit = Exit.CHECKPOINT_FAILED


class Diverged(RuntimeError):
    """A loss, gradient norm or weights that are inf or nan. The run stops, and nothing is saved
    from that state: the checkpoints on disk are the good ones."""

    exit = Exit.DIVERGED

    def __init__(self, step: int, what: str) -> None:
        super().__init__(f"step {step}: {what} is not finite")
        self.step, self.what = step, what


def causes(err: BaseException) -> Iterator[BaseException]:
    """An exception, then the ones it was raised from or during, innermost last."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def checkpoint_paths(run_dir: Path) -> list[Path]:
    """Files named as checkpoints in the run dir, oldest step first; readable or not."""
    directory = run_dir / "checkpoints"
    found = (
        [p for p in directory.glob("step_*.pt") if NAME.fullmatch(p.name)]
        if directory.is_dir()
        else []
    )
    return sorted(found)


def step_of(path: Path) -> int:
    return int(NAME.fullmatch(path.name).group(1))


def write_atomically(state: dict[str, Any], path: Path) -> None:
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=PARTIAL, suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as out:
            torch.save(state, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
    sync_directory(path.parent)


def sync_directory(path: Path) -> None:
    """Make a rename in it durable."""
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read(path: Path, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's state; raises if the file is not one. mmap=True reads only the structure
    (the tensors stay on disk until touched): a cheap check that a file reads back."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    if not (isinstance(state, dict) and state.keys() >= REQUIRED):
        raise ValueError("not a training checkpoint")
    return state


def newest_readable(run_dir: Path, mmap: bool = False) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that loads, with a warning for each one skipped."""
    for path in reversed(checkpoint_paths(run_dir)):
        try:
            return path, read(path, mmap=mmap)
        except Exception as err:  # truncated, corrupt, or not a checkpoint at all
            reason = " ".join(str(err).split())[:200]
            log.warning("skipping unreadable checkpoint %s: %s", path.name, reason)
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


def all_finite(module: torch.nn.Module) -> bool:
    """One GPU sync: for the rare moments a checkpoint is written."""
    flags = [torch.isfinite(p).all() for p in module.parameters()]
    return bool(torch.stack(flags).all()) if flags else True


class Checkpointer:
    """Owns the checkpoints of one run dir. The loop calls save() once per step; it decides.
    With keep_best, save_best() after each validation keeps the checkpoint of the lowest
    validation loss in best.pt, outside the newest-`keep` rotation; the bar to beat is best.pt's
    own, so a resume goes on from it.

    `states` are the objects a checkpoint holds, by key (model, optimizer, scheduler, scaler,
    data position), each with state_dict() and load_state_dict(); each rank's RNG state and
    the config are added. Every rank calls every method: saving and loading are collectives.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        every: int,
        keep: int,
        keep_best: bool = False,
        world: World,
        group: dist.ProcessGroup | None,
        states: dict[str, Stateful],
        config: dict[str, Any],
        watchdog: Heartbeat = NO_WATCHDOG,
    ) -> None:
        self.directory = run_dir / "checkpoints"
        self.run_dir, self.every, self.keep = run_dir, every, keep
        self.world, self.group, self.states, self.config = world, group, states, config
        self.watchdog = watchdog
        self.readable: dict[tuple[str, int, int], bool] = {}  # (name, size, mtime) -> reads back
        self.warned: set[str] = set()
        self.newest: Path | None = None  # the newest checkpoint loaded or written
        self.keep_best = keep_best
        self.best_loss = math.inf  # best.pt's validation loss: the bar to beat
        if world.main:
            self.remove_partials()

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def remove_partials(self) -> None:
        """Writes that a kill interrupted: never a checkpoint, only disk used."""
        if not self.directory.is_dir():
            return
        for partial in sorted(self.directory.glob(f"{PARTIAL}*")):
            partial.unlink(missing_ok=True)
            log.info("removed %s, left by a write that was killed", partial.name)

    # --- loading --------------------------------------------------------------------------

    def load(self) -> dict[str, Any] | None:
        """Rank 0 picks the newest checkpoint that reads back; every rank loads that one into
        the states, and its own RNG state when the world size is unchanged. Returns the
        checkpoint (None when there is none) for what the caller makes of the rest."""
        choice: list[Any] = [None, math.inf]
        if self.world.main:
            found = newest_readable(self.run_dir)
            choice = [str(found[0]) if found else None, self.best_on_disk()]
        if self.world.size > 1:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        self.best_loss = choice[1]
        if choice[0] is None:
            return None
        self.newest = Path(choice[0])
        state = read(self.newest)
        for key, stateful in self.states.items():
            if state.get(key):  # an empty scaler state: it was disabled (bf16, fp32, CPU)
                try:
                    stateful.load_state_dict(state[key])
                except (RuntimeError, ValueError, KeyError) as err:
                    reason = " ".join(str(err).split())[:300]
                    raise Incompatible(
                        f"{self.newest.name} does not fit this run's {key}: {reason}; resume with "
                        "the config it was written with, or choose another hydra.run.dir"
                    ) from None
        if state["world_size"] == self.world.size:
            set_rng_state(state["rng"][self.world.rank])
        self.watchdog.beat()  # loading a large checkpoint is no stalled collective
        return state

    def best_on_disk(self) -> float:
        """The validation loss of best.pt, the bar a resumed run must beat; inf when there is none
        (or keep_best is off). One that does not read back is no good checkpoint: replaced by the
        next validation, with a warning now."""
        path = self.directory / BEST
        if not (self.keep_best and path.exists()):
            return math.inf
        try:
            return float(read(path, mmap=True)["val_loss"])
        except Exception as err:
            reason = " ".join(str(err).split())[:200]
            log.warning("%s does not read back (%s); the next validation replaces it", path, reason)
            return math.inf

    # --- saving ---------------------------------------------------------------------------

    def due(self, step: int, last_step: bool = False) -> bool:
        """Whether save() writes at this step by the schedule, unless it is forced."""
        return self.enabled and (last_step or step % self.every == 0)

    def save(
        self, step: int, last_step: bool = False, force: bool = False, val_loss: float | None = None
    ) -> bool:
        """Call once per step, after it, with the step's validation loss if it has one. Saves
        every `every` steps, at the last step, and when forced (the step the ranks agreed to stop
        at); never while checkpoints are off. Whether it wrote."""
        written = self.due(step, last_step) or (self.enabled and force)
        if written:
            self.write(step, val_loss)
        return written

    def save_best(self, step: int, val_loss: float, written: bool) -> None:
        """After save() at a validated step (every rank, the same all-reduced loss): best.pt, if
        this loss is the lowest yet. A second name of the step's checkpoint if save() `written`
        it (no second write of the same state), else a write of its own."""
        if not (self.enabled and self.keep_best and val_loss < self.best_loss):
            return
        if not (written and self.link_best(step)):
            self.write(step, val_loss, best=True)
        self.best_loss = val_loss
        if self.world.main:
            log.info("best checkpoint %s: step %d, val_loss %.4f",
                     (self.directory / BEST).relative_to(self.run_dir), step, val_loss)  # fmt: skip

    def link_best(self, step: int) -> bool:
        """best.pt as a hard link to the checkpoint of `step`, renamed into place; False (on
        every rank) where the file system has no hard links."""
        linked = False
        if self.world.main:
            partial = self.directory / f"{PARTIAL}best-{os.getpid()}.pt"
            try:
                os.link(self.directory / f"step_{step:09d}.pt", partial)
                os.replace(partial, self.directory / BEST)
                sync_directory(self.directory)
                linked = True
            except OSError as err:
                partial.unlink(missing_ok=True)
                log.info("best.pt: no hard link here (%s); written in full", err.strerror or err)
        if self.world.size > 1:
            outcome = [linked]
            dist.broadcast_object_list(outcome, src=0, group=self.group)
            linked = outcome[0]
        return linked

    def write(self, step: int, val_loss: float | None = None, best: bool = False) -> None:
        """The checkpoint of `step`, with its validation loss if it has one; best.pt if `best`."""
        model = self.states["model"]
        if not all_finite(model):  # identical on every rank under DDP: all stop together
            raise Diverged(step, "a weight")
        rng = self.gather_rng_states()
        path = self.directory / (BEST if best else f"step_{step:09d}.pt")
        # Disk I/O, not a stalled collective: the others wait for it on the CPU group (whose
        # timeout is dist.checkpoint_timeout_s), with no GPU collective pending meanwhile.
        with self.watchdog.paused():
            failure = None
            if self.world.main:
                try:
                    self.write_here(path, step, rng, val_loss, best)
                except Exception as err:  # the others must hear of it, not of a broken barrier
                    failure = self.failure(path, err)
            if self.world.size > 1:  # rank 0 is done: how it went, in place of a barrier
                outcome = [failure]
                dist.broadcast_object_list(outcome, src=0, group=self.group)
                failure = outcome[0]
        if failure:
            raise CheckpointFailed(failure)

    def write_here(
        self, path: Path, step: int, rng: list[dict[str, Any]], val_loss: float | None, best: bool
    ) -> None:
        state = {key: stateful.state_dict() for key, stateful in self.states.items()}
        state |= {"step": step, "rng": rng, "config": self.config}
        state["world_size"] = self.world.size
        if val_loss is not None:  # best.pt's bar; a step checkpoint's, should it become best.pt
            state["val_loss"] = val_loss
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(state, path)
        if best:
            return

        self.readable[self.identity(path)] = True
        self.newest = path
        log.info("checkpoint %s", path.relative_to(self.run_dir))
        self.purge(written=path)

    def failure(self, path: Path, err: Exception) -> str:
        """Rank 0's failed write as one line: the cause as the OS gave it (torch.save wraps an
        OSError in a RuntimeError of its own), what is kept, what to do."""
        cause = next((e for e in causes(err) if isinstance(e, OSError)), err)
        reason = " ".join(str(cause).split())[:300] or type(cause).__name__
        kept = (
            f"{self.newest.name}, the newest checkpoint before it, is kept"
            if self.newest
            else "no checkpoint was written before it"
        )
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            todo = (
                f"free space there and relaunch with hydra.run.dir={self.run_dir} to resume, or "
                "move the run dir to a file system with room and relaunch with "
                "hydra.run.dir=<its new place>"
            )
        else:
            todo = f"fix that and relaunch with hydra.run.dir={self.run_dir} to resume"
        return f"rank 0 could not write {path}: {reason}; {kept}; {todo}"

    def gather_rng_states(self) -> list[dict[str, Any]]:
        """Every rank's RNG state, in rank order."""
        if self.world.size == 1:
            return [rng_state()]
        states: list[Any] = [None] * self.world.size
        dist.all_gather_object(states, rng_state(), group=self.group)
        return states

    # --- the keep policy ------------------------------------------------------------------

    @staticmethod
    def identity(path: Path) -> tuple[str, int, int]:
        stat = path.stat()
        return path.name, stat.st_size, stat.st_mtime_ns

    def reads_back(self, path: Path) -> bool:
        """Whether a file holds a checkpoint, checked once per version of the file."""
        try:
            identity = self.identity(path)
        except FileNotFoundError:
            return False
        if identity not in self.readable:
            try:
                read(path, mmap=True)
                self.readable[identity] = True
            except Exception:
                self.readable[identity] = False
        return self.readable[identity]

    def purge(self, written: Path) -> None:
        """Keep the newest `keep` checkpoints that read back, always including the one just
        written. Files that do not read back are not ranked and not deleted: a warning names
        them once, for a person to look at."""
        readable, unreadable = [], []
        for path in checkpoint_paths(self.run_dir):
            (readable if self.reads_back(path) else unreadable).append(path)
        new = [path.name for path in unreadable if path.name not in self.warned]
        if new:
            log.warning(
                "%s in %s do not read back as checkpoints; left alone (not counted, not deleted)",
                ", ".join(new), self.directory,
            )  # fmt: skip
            self.warned.update(new)
        kept = set(sorted(readable, key=step_of)[-self.keep :]) | {written}
        for path in readable:
            if path not in kept:
                path.unlink(missing_ok=True)

"""Lose at most the work since the last checkpoint, and never a good checkpoint.

The Checkpointer decides when to save (every trainer.checkpoint_every steps, at the last step, and
at a step its caller forces: the Trainer's stop, stopping.py), what a checkpoint holds, how to
load one, and which to keep. Rank 0 writes `<run dir>/checkpoints/step_<N>.pt` atomically (temp
file in the same directory, fsync, rename), in a thread of its own from a host copy of the state
(Snapshot, Writer), so training waits only for that copy; a checkpoint counts once it reads back.
With trainer.checkpoint_format=dcp every rank writes its share of a `step_<N>.dcp` folder
(checkpoint_dcp.py) the same way: a partial folder, renamed by rank 0 once whole.
A relaunch with the same run dir resumes from the newest one that reads back, in either format.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from copy import deepcopy
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..core import files
from ..core.exits import Exit
from ..core.files import PARTIAL, sync_directory
from ..core.world import World
from ..nccl.failfast import NO_WATCHDOG, Heartbeat
from . import checkpoint_dcp, oom
from .layout import BEST, BEST_DCP, NAME, checkpoint_paths, step_of  # noqa: F401 - theirs too

log = logging.getLogger(__name__)
REQUIRED = {"step", "model", "optimizer", "data"}


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class Progress:
    """Where training stands: optimizer steps done, and the samples of the current epoch's
    permutation taken (by every rank together: the same position on any world size)."""

    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.step, self.epoch = state["step"], state["epoch"]
        self.samples_in_epoch = state["samples_in_epoch"]


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


def write_atomically(state: dict[str, Any], path: Path) -> None:
    """The one write of a checkpoint file, durable (core/files.py; tests replace it here)."""
    files.write_atomically(path, partial(torch.save, state), durable=True, mode=0o600)


def is_dcp(path: Path) -> bool:
    return path.suffix == checkpoint_dcp.SUFFIX


def read(path: Path, mmap: bool = False) -> dict[str, Any]:
    """A checkpoint's state; raises if the file (or DCP folder) is not one. mmap=True reads only
    the structure (the tensors stay on disk until touched), a cheap check that it reads back; of a
    DCP folder, all but its tensors (model, optimizer and ema, if kept, are None)."""
    if is_dcp(path):
        checkpoint_dcp.verify(path)
        state = torch.load(path / checkpoint_dcp.EXTRA, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and mmap:
            state |= dict.fromkeys(checkpoint_dcp.held(path))
        elif isinstance(state, dict):
            state |= checkpoint_dcp.read_all(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    if not (isinstance(state, dict) and state.keys() >= REQUIRED):
        raise ValueError("not a training checkpoint")
    return state


def remove(path: Path) -> None:
    """A file, or a DCP folder and what it holds."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def replace_folder(new: Path, target: Path) -> None:
    """`new` renamed to `target`, a folder that may exist: the old one is renamed aside first
    (a folder cannot be renamed over one that has files), then removed. Killed between the two
    renames, the old one is put back by the next start (Checkpointer.remove_partials)."""
    aside = target.with_name(f"{PARTIAL}old-{target.name}")
    remove(aside)
    if target.exists():
        os.replace(target, aside)
    os.replace(new, target)
    sync_directory(target.parent)
    remove(aside)


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
    """One GPU sync: for the rare moments a checkpoint is written. A sharded model's (fsdp2)
    ranks each see their shards: they agree through an all-reduce, so all stop together."""
    params = list(module.parameters())
    shards = [local(p) for p in params]
    flags = [torch.isfinite(p).all() for p in shards]
    finite = torch.stack(flags).all() if flags else torch.tensor(True)
    if any(isinstance(p, DTensor) for p in params) and dist.get_world_size() > 1:
        finite = finite.float()
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor; a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Snapshot:
    """A host copy of a state, for a write that goes on while training changes the original.
    GPU tensors land in pinned buffers kept from one checkpoint to the next (allocated once: the
    copy then runs at the bus's speed); CPU tensors are cloned. A tensor that two keys share (tied
    weights) is copied once and stays shared in the file."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.reserving: threading.Thread | None = None

    @property
    def bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    @property
    def pinned(self) -> bool:
        return bool(self.buffers)

    def reserve(self, state: Any) -> None:
        """Pin, in the background, the buffers take() will copy `state`'s GPU tensors into:
        pinning them is slow (a second for gpt2_small's), and out of the step it stalls nothing."""
        wanted: dict[tuple[Any, ...], tuple[torch.Size, torch.dtype]] = {}
        seen: set[tuple[Any, ...]] = set()

        def walk(value: Any, where: tuple[Any, ...]) -> None:
            value = local(value)  # a shard (fsdp2): its buffer holds this rank's part
            if isinstance(value, torch.Tensor):
                shared = (
                    value.device.type,
                    value.data_ptr(),
                    value.shape,
                    value.stride(),
                    value.dtype,
                )
                if value.is_cuda and shared not in seen:
                    seen.add(shared)
                    wanted[where] = (value.shape, value.dtype)
            elif isinstance(value, dict):
                for key, item in value.items():
                    walk(item, (*where, key))
            elif type(value) in (list, tuple):
                for i, item in enumerate(value):
                    walk(item, (*where, i))

        def pin() -> None:
            for where, (shape, dtype) in wanted.items():
                self.buffers[where] = torch.empty(shape, dtype=dtype, pin_memory=True)

        walk(state, ())
        if wanted:
            self.reserving = threading.Thread(target=pin, name="checkpoint-buffers", daemon=True)
            self.reserving.start()

    def take(self, state: Any) -> Any:
        if self.reserving is not None:
            self.reserving.join()
            self.reserving = None
        memo: dict[tuple[Any, ...], torch.Tensor] = {}
        copied = self.copy(state, (), memo)
        if any(key[0] == "cuda" for key in memo):
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return copied

    def copy(self, value: Any, where: tuple[Any, ...], memo: dict) -> Any:
        if isinstance(value, DTensor):  # a shard (fsdp2): this rank's part, sharded as it was
            return DTensor.from_local(
                self.copy(value.to_local(), where, memo),
                value.device_mesh,
                value.placements,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        if isinstance(value, torch.Tensor):
            shared = (value.device.type, value.data_ptr(), value.shape, value.stride(), value.dtype)
            if shared not in memo:
                memo[shared] = self.stage(value.detach(), where)
            return memo[shared]
        if isinstance(value, dict):  # a module's state_dict is an OrderedDict with _metadata
            copied = type(value)(
                (key, self.copy(item, (*where, key), memo)) for key, item in value.items()
            )
            if getattr(value, "__dict__", None):  # attributes a plain dict cannot hold
                copied.__dict__.update(deepcopy(value.__dict__))
            return copied
        if type(value) in (list, tuple):
            return type(value)(self.copy(item, (*where, i), memo) for i, item in enumerate(value))
        return deepcopy(value)  # numbers, strings: small

    def stage(self, tensor: torch.Tensor, where: tuple[Any, ...]) -> torch.Tensor:
        if not tensor.is_cuda:
            return tensor.clone()
        buffer = self.buffers.get(where)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.buffers[where] = buffer
        return buffer.copy_(tensor, non_blocking=True)


SNAPSHOT_SHARE = 0.8  # of the host memory still available, the most a snapshot may take


def state_bytes(state: Any) -> int:
    """The bytes of a state's tensors, each storage once (tied weights, views)."""
    seen: dict[tuple[str, int], int] = {}

    def walk(value: Any) -> None:
        value = local(value)
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[(value.device.type, storage.data_ptr())] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif type(value) in (list, tuple):
            for item in value:
                walk(item)

    walk(state)
    return sum(seen.values())


def snapshot_room(
    needed: int, available: tuple[int, str] | None, holders: str = "rank 0"
) -> str | None:
    """Why a background checkpoint's host copy of `needed` bytes does not fit, or None."""
    if available is None or needed <= SNAPSHOT_SHARE * available[0]:
        return None
    return (
        f"checkpoints are written synchronously: their background copy of the state needs "
        f"{needed / 2**30:.2f} GiB of host memory on {holders}, and {available[1]} "
        f"{available[0] / 2**30:.2f} GiB available; give the pod more memory "
        "(deploy.memory_per_gpu) to write them in the background, or set "
        "trainer.async_checkpoint=false to choose this"
    )


class Writer:
    """Rank 0's background write, one at a time: a thread per write, and not a daemon, so that a
    process on its way out finishes the write in progress (a whole file, or a partial one that
    the next start removes, never a half-renamed checkpoint)."""

    def __init__(self, describe: Callable[[Path, Exception], str]) -> None:
        self.describe = describe  # a failure as its one line
        self.thread: threading.Thread | None = None
        self.path: Path | None = None
        self.failure: str | None = None

    def start(self, path: Path, job: Callable[[], None]) -> None:
        self.path, self.failure = path, None
        self.thread = threading.Thread(target=self.run, args=(path, job), name="checkpoint-writer")
        self.thread.start()

    def run(self, path: Path, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as err:  # raised on every rank by the next settle()
            self.failure = self.describe(path, err)

    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def wait(self) -> str | None:
        """Wait for the write in progress; its failure (once), or None."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        failure, self.failure = self.failure, None
        return failure


class Checkpointer:
    """Owns the checkpoints of one run dir. The loop calls save() once per step; it decides.
    With keep_best, save_best() after each validation keeps the checkpoint of the lowest
    validation loss in best.pt, outside the newest-`keep` rotation; the bar to beat is best.pt's
    own, so a resume goes on from it.

    `states` are the objects a checkpoint holds, by key (model, optimizer, scheduler, scaler,
    data position), each with state_dict() and load_state_dict(); each rank's RNG state, the
    config and its `options` (registry.chosen: the model and data options that built it, which its
    values alone may not tell) are added. Every rank calls every method: saving and loading are
    collectives.
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
        options: dict[str, str],
        watchdog: Heartbeat = NO_WATCHDOG,
        asynchronous: bool = True,
        checkpoint_format: str = "file",
        writers: dist.ProcessGroup | None = None,
    ) -> None:
        self.directory = run_dir / "checkpoints"
        self.run_dir, self.every, self.keep = run_dir, every, keep
        self.world, self.group, self.states, self.config = world, group, states, config
        self.options = options
        # the Trainer's figures (global_batch.GlobalBatch): a resume keeps them
        self.global_batch: dict[str, int] | None = None
        self.watchdog = watchdog
        self.readable: dict[tuple[str, int, int], bool] = {}  # (name, size, mtime) -> reads back
        self.warned: set[str] = set()
        self.newest: Path | None = None  # the newest checkpoint loaded or written
        self.keep_best = keep_best
        self.best_loss = math.inf  # best.pt's validation loss: the bar to beat
        self.asynchronous = asynchronous
        self.dcp = checkpoint_format == "dcp"
        self.writers = writers  # the DCP write's own CPU group: it runs beside `group`'s messages
        self.snapshot, self.writer = Snapshot(), Writer(self.failure)
        self.reported_bytes = 0
        self.stalled_s = 0.0  # what training has waited for checkpoints, for goodput's figures
        if world.main:
            self.remove_partials()

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def remove_partials(self) -> None:
        """Writes that a kill interrupted: never a checkpoint, only disk used. A folder that
        replace_folder() had set aside and not yet replaced is put back."""
        if not self.directory.is_dir():
            return
        for left in sorted(self.directory.glob(f"{PARTIAL}old-*")):
            target = self.directory / left.name.removeprefix(f"{PARTIAL}old-")
            if not target.exists():
                os.replace(left, target)
                log.info("put back %s, set aside by a write that was killed", target.name)
        for left in sorted(self.directory.glob(f"{PARTIAL}*")):
            remove(left)
            log.info("removed %s, left by a write that was killed", left.name)

    # --- loading --------------------------------------------------------------------------

    def load(self) -> dict[str, Any] | None:
        """Rank 0 picks the newest checkpoint that reads back; every rank loads that one into
        the states, and its own RNG state when the world size is unchanged. Returns the
        checkpoint (None when there is none) for what the caller makes of the rest."""
        choice: list[Any] = [None, math.inf]
        if self.world.main:  # the structure only: the one read of the tensors is below
            found = newest_readable(self.run_dir, mmap=True)
            choice = [str(found[0]) if found else None, self.best_on_disk()]
        if self.world.size > 1:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        self.best_loss = choice[1]
        if choice[0] is None:
            return None
        self.newest = Path(choice[0])
        # A DCP folder's tensors go straight into the model and optimizer, on any world size.
        dcp_folder = is_dcp(self.newest)
        if not dcp_folder and any(
            isinstance(p, DTensor) for p in self.states["model"].parameters()
        ):
            raise Incompatible(
                f"{self.newest.name} is a file checkpoint, which a model sharded by "
                "dist.strategy=fsdp2 does not load; resume it with dist.strategy=ddp "
                "trainer.checkpoint_format=dcp until it writes a .dcp folder, then switch"
            )
        state = read(self.newest, mmap=dcp_folder)
        if dcp_folder:
            self.load_dcp(self.newest)
        for key, stateful in self.states.items():
            # None: none kept, or a DCP folder's tensors, loaded above (a folder written before
            # the EMA was a share has it here); an empty scaler state: disabled (bf16, fp32, CPU)
            if state.get(key):
                try:
                    stateful.load_state_dict(state[key])
                except (RuntimeError, ValueError, KeyError) as err:
                    raise self.incompatible(key, err) from None
        if state["world_size"] == self.world.size:
            set_rng_state(state["rng"][self.world.rank])
        self.watchdog.beat()  # loading a large checkpoint is no stalled collective
        return state

    def load_dcp(self, path: Path) -> None:
        try:
            checkpoint_dcp.load(
                path,
                self.states["model"],
                self.states["optimizer"],
                self.states.get("ema"),
                self.writers,
                alone=self.world.size == 1,
            )
        except (checkpoint_dcp.ShareFailed, RuntimeError, ValueError, KeyError) as err:
            kept = "model, optimizer and EMA" if "ema" in self.states else "model and optimizer"
            raise self.incompatible(kept, err) from None

    def incompatible(self, key: str, err: BaseException) -> Incompatible:
        reason = " ".join(str(err).split())[:300]
        return Incompatible(
            f"{self.newest.name} does not fit this run's {key}: {reason}; resume with "
            "the config it was written with, or choose another hydra.run.dir"
        )

    @property
    def best_path(self) -> Path:
        return self.directory / (BEST_DCP if self.dcp else BEST)

    def best_on_disk(self) -> float:
        """The validation loss of best.pt, the bar a resumed run must beat; inf when there is none
        (or keep_best is off). One that does not read back is no good checkpoint: replaced by the
        next validation, with a warning now."""
        path = self.best_path
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
        at); never while checkpoints are off. Whether it wrote (or, asynchronously, started to:
        settle() says how it went)."""
        written = self.due(step, last_step) or (self.enabled and force)
        if written:
            best = self.keep_best and val_loss is not None and val_loss < self.best_loss
            self.write(step, val_loss, also_best=best)
        return written

    def save_best(self, step: int, val_loss: float, written: bool) -> None:
        """After save() at a validated step (every rank, the same all-reduced loss): best.pt, if
        this loss is the lowest yet. If save() `written` this step's checkpoint, best.pt is a
        second name of it, made after it reads back (no second write of the same state); else a
        write of its own."""
        if not (self.enabled and self.keep_best and val_loss < self.best_loss):
            return
        if not written:
            self.write(step, val_loss, best=True)
        self.best_loss = val_loss

    def write(
        self, step: int, val_loss: float | None = None, best: bool = False, also_best: bool = False
    ) -> None:
        """The checkpoint of `step`, with its validation loss if it has one; best.pt if `best`,
        and best.pt too if `also_best`. The caller waits for a host copy of the state only:
        rank 0 writes it in the background (asynchronously, the default), and the next write,
        settle() or a log window reports how that went."""
        self.settle(saving=True)  # one write at a time: its snapshot buffers are the next one's
        began = time.perf_counter()
        model = self.states["model"]
        if not all_finite(model):  # identical on every rank under DDP: all stop together
            raise Diverged(step, "a weight")
        rng = self.gather_rng_states()
        if self.dcp:  # every rank stages and writes its share; rank 0 the rest beside it
            path = self.best_path if best else self.directory / f"step_{step:09d}.dcp"
            staged = self.snapshot.take(self.snapshot_state())
            # a copy: rank 0 writes it after the shares, while steps change the states (EMA's)
            extra = self.snapshot.take(self.extra(step, rng, val_loss)) if self.world.main else None
            self.report_snapshot()
            self.writer.start(
                path,
                partial(self.write_dcp_here, path, staged, extra, step, val_loss, best, also_best),
            )
        elif self.world.main:
            path = self.directory / (BEST if best else f"step_{step:09d}.pt")
            state = self.extra(step, rng, val_loss) | self.snapshot_state()
            staged = self.snapshot.take(state)
            self.report_snapshot()
            self.writer.start(
                path, partial(self.write_here, path, staged, step, val_loss, best, also_best)
            )
        self.stalled_s += time.perf_counter() - began
        if not self.asynchronous:
            self.settle()

    def snapshot_state(self) -> dict[str, Any]:
        """The tensors a checkpoint copies: all the states (file), or the model's, optimizer's and
        EMA's by parameter name (DCP; the rest is rank 0's extra)."""
        if self.dcp:
            return checkpoint_dcp.tensors(
                self.states["model"], self.states["optimizer"], self.states.get("ema")
            )
        return {key: stateful.state_dict() for key, stateful in self.states.items()}

    def extra(self, step: int, rng: list[dict[str, Any]], val_loss: float | None) -> dict[str, Any]:
        """What a checkpoint holds beside the snapshot's tensors: small, rank 0's."""
        kept = [key for key in self.states if not (self.dcp and key in checkpoint_dcp.TENSORS)]
        state = {key: self.states[key].state_dict() for key in kept}
        state |= {"step": step, "rng": rng, "config": self.config, "options": self.options}
        state["world_size"] = self.world.size
        if self.global_batch:
            state["global_batch"] = self.global_batch
        if val_loss is not None:  # best.pt's bar; a step checkpoint's, should it become best.pt
            state["val_loss"] = val_loss
        if self.dcp:
            state["format"] = "dcp"
        return state

    def prepare(self) -> None:
        """Every rank, after the first step, when the optimizer's state exists: rank 0 pins its
        snapshot's buffers meanwhile, not during the first checkpoint, if the host has the
        memory for them; else every rank writes synchronously from here on, and rank 0 says
        why (an OOM kill would lose more than the stall)."""
        if not (self.enabled and self.asynchronous):
            return
        room = None
        if self.world.main or self.dcp:  # a DCP write: each rank stages its own copy
            state = self.snapshot_state()
            copies = self.world.local_size if self.dcp else 1  # of one node's memory
            room = snapshot_room(
                state_bytes(state) * copies,
                oom.available_memory(),
                "every rank of a node" if copies > 1 else "rank 0",
            )
            if room is None:
                self.snapshot.reserve(state)
        if self.world.size > 1:  # every rank settles the same way: the first refusal for all
            verdicts: list[Any] = [None] * self.world.size
            dist.all_gather_object(verdicts, room, group=self.group)
            room = next((verdict for verdict in verdicts if verdict), None)
        if room is not None:
            self.asynchronous = False
            if self.world.main:
                log.warning("%s", room)

    def settle(self, saving: bool = False) -> None:
        """Every rank: wait for the write in progress (rank 0's; each rank's share of a DCP
        folder), if any, and raise CheckpointFailed with its cause on every rank if it failed.
        `saving`: for the next write, which says so when it had to wait."""
        began = time.perf_counter()
        # Disk I/O, not a stalled collective: the others wait for it on the CPU group (whose
        # timeout is dist.checkpoint_timeout_s), with no GPU collective pending meanwhile.
        with self.watchdog.paused():
            writing = self.writer.path if self.writer.busy() else None
            failure = self.writer.wait()
            if writing and saving and self.asynchronous and self.world.main:  # before it ended
                log.info(
                    "waited %.1f s for the write of %s to finish",
                    time.perf_counter() - began,
                    writing.relative_to(self.run_dir),
                )
            if self.world.size > 1:  # every rank is done: how it went, in place of a barrier
                outcomes: list[Any] = [None] * self.world.size
                dist.all_gather_object(outcomes, failure, group=self.group)
                failure = next((outcome for outcome in outcomes if outcome), None)
        self.stalled_s += time.perf_counter() - began
        if failure:
            raise CheckpointFailed(failure)

    def failed(self) -> bool:
        """Whether this rank's last background write has ended in a failure settle() will raise.
        (The Trainer tells every rank through the next log window's all-reduce.)"""
        return self.writer.failure is not None

    def drain(self) -> None:
        """This rank alone, on the way out after an error: a write in progress ends (the state
        it holds was good; a DCP share waits for its peers up to dist.checkpoint_timeout_s),
        and a failure of it is logged, not raised; the peers may be gone."""
        failure = self.writer.wait()
        if failure and self.world.main:
            log.error("%s", failure)

    def report_snapshot(self) -> None:
        if self.snapshot.bytes != self.reported_bytes:
            self.reported_bytes = self.snapshot.bytes
            kind = "pinned host memory" if self.snapshot.pinned else "host memory"
            log.info(
                "checkpoints are staged in %.2f GiB of %s on rank 0 and written in the background",
                self.snapshot.bytes / 2**30,
                kind,
            )

    def write_here(
        self,
        path: Path,
        state: dict[str, Any],
        step: int,
        val_loss: float | None,
        best: bool,
        also_best: bool,
    ) -> None:
        """Rank 0, in the writer's thread: the file, then only once it reads back, the rest."""
        self.directory.mkdir(parents=True, exist_ok=True)
        write_atomically(state, path)
        read(path, mmap=True)  # counted only once it reads back: raises if it does not
        self.counted(path, step, val_loss, best, also_best, state)

    def write_dcp_here(
        self,
        path: Path,
        state: dict[str, Any],
        extra: dict[str, Any] | None,
        step: int,
        val_loss: float | None,
        best: bool,
        also_best: bool,
    ) -> None:
        """Every rank, in its writer's thread: its share into a partial folder; rank 0 (`extra`
        given) then adds the rest, renames the folder into place once it reads back, and keeps
        the books as write_here() does."""
        partial_folder = self.directory / f"{PARTIAL}{path.name}"
        try:
            checkpoint_dcp.save(partial_folder, state, self.writers, alone=self.world.size == 1)
            if extra is None:
                return
            write_atomically(extra, partial_folder / checkpoint_dcp.EXTRA)
            read(partial_folder, mmap=True)  # every rank's share is there, whole: raises if not
            sync_directory(partial_folder)
            replace_folder(partial_folder, path)
        except BaseException:
            if extra is not None:  # rank 0; DCP raises only once every rank is done
                remove(partial_folder)
            raise
        self.counted(path, step, val_loss, best, also_best, extra)

    def counted(
        self,
        path: Path,
        step: int,
        val_loss: float | None,
        best: bool,
        also_best: bool,
        state: dict[str, Any],
    ) -> None:
        """Rank 0, once `path` reads back: it is the newest, older ones go, best.pt follows."""
        if best:
            self.report_best(step, val_loss)
            return
        self.readable[self.identity(path)] = True
        self.newest = path
        log.info("checkpoint %s", path.relative_to(self.run_dir))
        self.purge(written=path)
        if also_best:
            self.link_best(path, state)
            self.report_best(step, val_loss)

    def report_best(self, step: int, val_loss: float | None) -> None:
        log.info(
            "best checkpoint %s: step %d, val_loss %.4f",
            self.best_path.relative_to(self.run_dir),
            step,
            val_loss,
        )

    def link_best(self, written: Path, state: dict[str, Any]) -> None:
        """best.pt as a hard link to the checkpoint just written, renamed into place; a copy
        where the file system has no hard links. (best.dcp: a folder of links to its files.)"""
        if is_dcp(written):
            self.link_best_folder(written)
            return
        partial_link = self.directory / f"{PARTIAL}best-{os.getpid()}.pt"
        try:
            os.link(written, partial_link)
            os.replace(partial_link, self.directory / BEST)
            sync_directory(self.directory)
        except OSError as err:
            partial_link.unlink(missing_ok=True)
            log.info("best.pt: no hard link here (%s); written in full", err.strerror or err)
            write_atomically(state, self.directory / BEST)

    def link_best_folder(self, written: Path) -> None:
        partial_folder = self.directory / f"{PARTIAL}{BEST_DCP}"
        remove(partial_folder)
        partial_folder.mkdir()
        try:
            for file in written.iterdir():
                os.link(file, partial_folder / file.name)
        except OSError as err:
            log.info("best.dcp: no hard links here (%s); copied", err.strerror or err)
            remove(partial_folder)
            shutil.copytree(written, partial_folder)
        sync_directory(partial_folder)
        replace_folder(partial_folder, self.best_path)

    def failure(self, path: Path, err: Exception) -> str:
        """A failed write as one line: the cause as the OS gave it (torch.save wraps an OSError
        in a RuntimeError of its own), the rank, what is kept, what to do."""
        rank = getattr(err, "rank", self.world.rank)  # ShareFailed's: the rank that failed
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
        return f"rank {rank} could not write {path}: {reason}; {kept}; {todo}"

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
        """A version of a file, or of a DCP folder: its files' too (one rewritten in place
        leaves the folder's own size and time as they were)."""
        stats = [path.stat()]
        if path.is_dir():
            stats += [file.stat() for file in path.iterdir()]
        return path.name, sum(s.st_size for s in stats), max(s.st_mtime_ns for s in stats)

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
                ", ".join(new),
                self.directory,
            )
            self.warned.update(new)
        kept = set(sorted(readable, key=step_of)[-self.keep :]) | {written}
        for path in readable:
            if path not in kept:
                remove(path)

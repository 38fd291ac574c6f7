"""profile=: a torch.profiler trace and a CUDA memory snapshot over a window of steps, and a memory
snapshot when a GPU runs out of memory, each written into <run dir>/profile/ and named in the log.

The trainer holds a StepProfiler only where profile= asks for something on its rank (for_rank
gives None otherwise): under profile=none the loop's one added cost is a None check. A file that
cannot be written is a warning, never the end of the run: profiling is a look at training.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config.profiling import ProfileConfig
from ..config.schema import TrainConfig
from ..core.files import partial_name

log = logging.getLogger(__name__)
FOLDER = "profile"
VIEWERS = {
    "trace": "open it in https://ui.perfetto.dev or chrome://tracing",
    "memory": "drag it into https://pytorch.org/memory_viz",
}


def for_rank(
    config: ProfileConfig, rank: int, device: torch.device, run_dir: Path
) -> StepProfiler | None:
    """This rank's profiler, or None where profile= asks nothing of it. Rank 0 says where the
    files go (the other ranks' logs show warnings only)."""
    cuda = device.type == "cuda"
    if rank == 0 and config.on:
        say_plan(config, run_dir / FOLDER, cuda)
    if not config.profiles(rank) or not (config.trace or cuda):
        return None  # the memory snapshots are CUDA's: on CPU only a trace has anything to do
    return StepProfiler(config, rank, device, run_dir / FOLDER)


def say_plan(config: ProfileConfig, folder: Path, cuda: bool) -> None:
    ranks = "every rank" if config.ranks is None else f"rank(s) {config.ranks}"
    window = f"steps {config.start_step}-{config.last_step}"
    if config.trace:
        log.info("profile: a torch.profiler trace of %s on %s, into %s/", window, ranks, folder)
    memory = [
        what
        for what, asked in (
            (f"a CUDA memory snapshot of {window}", config.memory),
            ("a CUDA memory snapshot on a GPU out of memory", config.oom_snapshot),
        )
        if asked
    ]
    if memory and cuda:
        log.info("profile: %s on %s, into %s/", " and ".join(memory), ranks, folder)
    elif memory:
        log.info("profile: %s: CUDA's only; this run is on CPU, none is written", memory[0])


class StepProfiler:
    """The window's profiler and memory history on one rank; tick() runs before every step."""

    oom_written: Path | None = None  # the snapshot of a GPU out of memory (one per process)

    def __init__(
        self, config: ProfileConfig, rank: int, device: torch.device, folder: Path
    ) -> None:
        self.config, self.rank, self.folder = config, rank, folder
        self.cuda = device.type == "cuda"
        self.state = "before"  # the window: "before", "running" (from its warm-up step), "done"
        self.profiler: Any = None  # torch.profiler.profile, while the window runs
        self.recording = False  # CUDA's allocation history
        if self.cuda and config.oom_snapshot:
            self.record_history()  # from before the model is built: its weights are in it
            torch._C._cuda_attach_out_of_memory_observer(self.out_of_memory)

    @property
    def span(self) -> str:
        return f"steps{self.config.start_step}-{self.config.last_step}"

    def tick(self, step: int) -> float:
        """Before step `step`'s work: begin, advance or end the window. Returns the seconds spent
        writing files, which the window's step time leaves out."""
        config = self.config
        if self.state == "running":
            if step > config.last_step:
                return self.close()
            if self.profiler is not None:
                self.profiler.step()  # the step's label: ProfilerStep#<step>
        elif self.state == "before" and step >= config.start_step - 1:
            if step == config.start_step - 1:
                self.begin()
                return 0.0
            self.state = "done"  # a launch that resumed past the window's warm-up step
            if step <= config.last_step and self.rank == 0:
                log.info(
                    "profile: this launch starts at step %d, inside the window (steps %d-%d, "
                    "after a warm-up step): nothing is profiled",
                    step,
                    config.start_step,
                    config.last_step,
                )
        return 0.0

    def finish(self) -> float:
        """The loop has ended (its last step, a stop, an error): a window it was inside is
        written as far as it got."""
        return self.close() if self.state == "running" else 0.0

    def begin(self) -> None:
        self.state = "running"
        config = self.config
        if config.trace:
            import torch.profiler as tp

            def window(step: int) -> tp.ProfilerAction:
                if step < config.start_step:
                    return tp.ProfilerAction.WARMUP
                if step < config.last_step:
                    return tp.ProfilerAction.RECORD
                if step == config.last_step:
                    return tp.ProfilerAction.RECORD_AND_SAVE
                return tp.ProfilerAction.NONE

            activities = [tp.ProfilerActivity.CPU]
            activities += [tp.ProfilerActivity.CUDA] if self.cuda else []
            self.profiler = tp.profile(
                activities=activities,
                schedule=window,
                on_trace_ready=self.save_trace,
                record_shapes=config.record_shapes,
                with_stack=config.with_stack,
            )
            # Its steps counted as the run's, so that each label names the training step.
            self.profiler.step_num = config.start_step - 1
            self.profiler.start()
        if self.cuda and config.memory:
            self.record_history()

    def close(self) -> float:
        """End the window where it stands (its last step, or a run that ended inside it): the
        trace and the memory snapshot written. Returns the seconds that took."""
        began = time.perf_counter()
        self.state = "done"
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.__exit__(None, None, None)  # stops it: save_trace writes the trace
        if self.cuda and self.config.memory:
            self.write(
                self.folder / f"rank{self.rank}_{self.span}.memory.pickle", self.dump, "memory"
            )
            if not self.config.oom_snapshot:
                torch.cuda.memory._record_memory_history(enabled=None)
                self.recording = False
        return time.perf_counter() - began

    def record_history(self) -> None:
        if not self.recording:
            torch.cuda.memory._record_memory_history(max_entries=self.config.history_entries)
            self.recording = True

    def save_trace(self, profiler: Any) -> None:
        path = self.folder / f"rank{self.rank}_{self.span}.pt.trace.json"
        self.write(path, lambda partial: profiler.export_chrome_trace(str(partial)), "trace")

    def dump(self, partial: Path) -> None:
        snapshot = torch.cuda.memory._snapshot()
        with open(partial, "wb") as out:
            pickle.dump(snapshot, out)

    def out_of_memory(self, device: int, wanted: int, held: int, free: int) -> None:
        """The CUDA allocator's observer, as it fails an allocation: the history up to it."""
        if self.recording:
            path = self.folder / f"rank{self.rank}_oom.memory.pickle"
            if self.write(path, self.dump, "memory"):
                StepProfiler.oom_written = path

    def write(self, path: Path, writer: Callable[[Path], None], kind: str) -> bool:
        """`writer` fills a temp file that then replaces `path`; a failure is a warning."""
        partial = partial_name(path)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            writer(partial)
            os.replace(partial, path)
        except (OSError, RuntimeError) as err:
            with contextlib.suppress(OSError):  # the folder may be what failed
                partial.unlink(missing_ok=True)
            log.warning("profile: could not write %s (%s); training goes on", path, err)
            return False
        log.info("profile: wrote %s (%s)", path, VIEWERS[kind])
        return True


def out_of_memory_line(err: torch.OutOfMemoryError, rank: int, config: TrainConfig) -> str:
    """A worker's one line for a GPU out of memory: torch's figures, the snapshot of the history
    up to it (profile.oom_snapshot) or how to get one, and a smaller setting to try."""
    said = (str(err).strip().splitlines() or ["CUDA out of memory"])[0]
    # torch's: "CUDA out of memory. Tried to allocate X. GPU 0 has a total capacity of Y of which
    # Z is free. ..." (the rest is its advice on fragmentation)
    line = f"rank {rank}: {'. '.join(said.split('. ')[:3]).rstrip('.')}"
    if StepProfiler.oom_written is not None:
        line += f"; memory snapshot: {StepProfiler.oom_written} ({VIEWERS['memory']})"
    else:
        line += "; profile=memory records a memory snapshot of the next one"
    if config.data.batch_size > 1:
        line += f"; try data.batch_size={config.data.batch_size // 2}"
    return line

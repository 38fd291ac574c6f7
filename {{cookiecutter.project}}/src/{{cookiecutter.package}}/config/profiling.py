"""The profile group's schema: what run/profiling.py records over a window of steps (a
torch.profiler trace, a CUDA memory snapshot) and whether a GPU out of memory leaves a snapshot.
The values live in configs/profile/ (none, trace, memory), each key commented there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from omegaconf import MISSING

from .error import require

MAX_ACTIVE_STEPS = 1000  # a trace grows with every step it holds: beyond this, no viewer opens it
MAX_HISTORY_ENTRIES = 10_000_000  # each holds a stack: at this many, gigabytes of host memory


@dataclass
class ProfileConfig:
    trace: bool = MISSING
    memory: bool = MISSING
    oom_snapshot: bool = MISSING
    start_step: int = MISSING
    active_steps: int = MISSING
    ranks: Optional[List[int]] = MISSING
    record_shapes: bool = MISSING
    with_stack: bool = MISSING
    history_entries: int = MISSING

    def __post_init__(self) -> None:
        require(
            self.start_step >= 2,
            "profile.start_step",
            self.start_step,
            "must be at least 2 (the step before it warms the profiler up)",
        )
        require(
            1 <= self.active_steps <= MAX_ACTIVE_STEPS,
            "profile.active_steps",
            self.active_steps,
            f"must be 1 to {MAX_ACTIVE_STEPS}",
        )
        require(
            self.ranks is None or (len(self.ranks) > 0 and all(r >= 0 for r in self.ranks)),
            "profile.ranks",
            self.ranks,
            "must be null (every rank) or a list of ranks from 0, e.g. [0]",
        )
        require(
            1 <= self.history_entries <= MAX_HISTORY_ENTRIES,
            "profile.history_entries",
            self.history_entries,
            f"must be 1 to {MAX_HISTORY_ENTRIES}",
        )

    @property
    def on(self) -> bool:
        return self.trace or self.memory or self.oom_snapshot

    @property
    def last_step(self) -> int:
        return self.start_step + self.active_steps - 1

    def profiles(self, rank: int) -> bool:
        return self.on and (self.ranks is None or rank in self.ranks)

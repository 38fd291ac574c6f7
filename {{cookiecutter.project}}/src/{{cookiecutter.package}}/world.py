"""Where this process stands in its launch, read from torchrun's environment in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    """torchrun's RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE. Without torchrun (plain
    `python -m`), a group of one."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1
    local_size: int = 1
    launched: bool = False  # by torchrun: a rendezvous exists

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> World:
        return cls(
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            size=int(env.get("WORLD_SIZE", "1")),
            local_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            launched="RANK" in env,
        )

    @property
    def main(self) -> bool:
        """Global rank 0: the one that writes the run's record and checkpoints."""
        return self.rank == 0

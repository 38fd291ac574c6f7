"""Where this process stands in its launch, read from torchrun's environment in one place."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    """torchrun's RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, and the launch's id and restart
    count. Without torchrun (plain `python -m`), a group of one."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1
    local_size: int = 1
    launched: bool = False  # by torchrun: a rendezvous exists
    run_id: str | None = None  # TORCHELASTIC_RUN_ID: the launch (its rendezvous id, on every node)
    restart: int = 0  # TORCHELASTIC_RESTART_COUNT: torchrun's restarts of its workers so far

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> World:
        return cls(
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            size=int(env.get("WORLD_SIZE", "1")),
            local_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            launched="RANK" in env,
            run_id=env.get("TORCHELASTIC_RUN_ID"),
            restart=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )

    @property
    def attempt(self) -> str:
        """This launch and restart, the same in every worker of it ("local-0" without torchrun)."""
        return f"{self.run_id or 'local'}-{self.restart}"

    @property
    def main(self) -> bool:
        """Global rank 0: the one that writes the run's record and checkpoints."""
        return self.rank == 0

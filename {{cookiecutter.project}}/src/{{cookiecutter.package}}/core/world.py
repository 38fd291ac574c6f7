"""Where this process stands in its launch, and the launch's run name, read from torchrun's
environment in one place."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


RUN_NAME_VAR = "DDP_RUN_NAME"  # the launcher names the run for its workers
LAUNCHED_AT_VAR = "DDP_LAUNCHED_AT"  # when the launcher started (time.time()), for goodput


def launched_at(env: Mapping[str, str] = os.environ) -> float:
    """When this launch began: the launcher's start, else this process's, else now. Goodput
    counts from here: a launch's start-up is time the GPU does not train."""
    try:
        return float(env[LAUNCHED_AT_VAR])
    except (KeyError, ValueError):
        return process_started_at()


def process_started_at() -> float:
    """When this process started (Linux's /proc), else now."""
    try:
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + int(after_name[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def run_name_for(started: float, ident: str) -> str:
    """`<local start time>_<6 hex>`: runs sort by when they started."""
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started)) + f"_{ident[:6]}"


def start_time(pid: int) -> float:
    """When a process started, from /proc (the current time where /proc cannot tell)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        stat = Path("/proc/stat").read_text().split()
        boot = float(stat[stat.index("btime") + 1])
    except (OSError, IndexError, ValueError):
        return time.time()
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def run_name() -> str:
    """Resolver: one name per launch, the same in every worker of it. The launcher's
    (RUN_NAME_VAR); under torchrun alone, from torchrun, the workers' parent: its start time and
    run id; across several nodes, where the start times differ, `run-<rendezvous id>`; without
    torchrun, this process's start time."""
    given = os.environ.get(RUN_NAME_VAR)
    if given:
        return given
    world = World.from_env()
    run_id = world.run_id or "none"  # torchrun's own default is "none" too
    if world.size > world.local_size and run_id != "none":
        return f"run-{run_id}"
    parent = os.getppid() if world.launched else os.getpid()
    started = start_time(parent)
    ident = hashlib.sha1(f"{run_id}-{parent}-{started}".encode()).hexdigest()
    return run_name_for(started, ident)


def rank_zero_only(value: Any) -> Any:
    """Resolver: the value on global rank 0, None on the others (set by torchrun)."""
    return value if World.from_env().main else None

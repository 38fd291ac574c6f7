"""Memory as the kernel counts it (cgroup v1/v2, /proc): the workers' resident memory watched while
they run, so that a worker killed for memory is named as such, with the figures."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..config.schema import TrainConfig


def gib(size: float) -> str:
    return f"{size / 2**30:.1f} GiB"


def read_counter(path: Path, name: str) -> int | None:
    """`name N` from a kernel stats file (memory.events, memory.oom_control, /proc/vmstat)."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def cgroup_dirs() -> list[Path]:
    """This process's memory cgroup: v2's unified dir and v1's memory dir, where mounted (inside
    a container the mount is usually the group itself)."""
    found = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    root = Path("/sys/fs/cgroup")
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue  # not a cgroup line: nothing to learn from it
        _, controllers, path = fields
        if controllers == "":  # v2
            found += [root / path.lstrip("/"), root]
        elif "memory" in controllers.split(","):  # v1
            found += [root / "memory" / path.lstrip("/"), root / "memory"]
    return [folder for folder in found if folder.is_dir()]


def oom_kills() -> dict[str, int]:
    """The kernel's counts of processes killed for memory: this cgroup's, or the machine's where
    no cgroup counts them. /proc/vmstat counts every container of a node: on Kubernetes another
    pod's kill would pass for this one's."""
    counts = {}
    for path in [
        folder / file
        for folder in cgroup_dirs()
        for file in ("memory.events", "memory.oom_control")
    ]:
        value = read_counter(path, "oom_kill")
        if value is not None:
            counts[str(path)] = value
    if not counts:
        value = read_counter(Path("/proc/vmstat"), "oom_kill")
        if value is not None:
            counts["/proc/vmstat"] = value
    return counts


def memory_limit() -> tuple[int, str] | None:
    """The memory this launch may use: the machine's, or its cgroup's limit when lower."""
    limits = []
    total = read_counter(Path("/proc/meminfo"), "MemTotal:")
    if total is None:
        try:
            total = int(Path("/proc/meminfo").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            total = None
    if total is not None:
        limits.append((total * 1024, "this machine has"))
    for folder in cgroup_dirs():
        for file in ("memory.max", "memory.limit_in_bytes"):
            try:
                limit = int((folder / file).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # "max": no limit
            if limit < 2**60:
                limits.append((limit, "its cgroup (container) allows"))
    return min(limits) if limits else None


def meminfo_bytes(name: str, path: Path = Path("/proc/meminfo")) -> int | None:
    """`name` in /proc/meminfo (`MemAvailable:   123 kB`), in bytes."""
    try:
        for line in path.read_text().splitlines():
            fields = line.split()
            if fields[:1] == [name]:
                return int(fields[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_memory(folders: list[Path] | None = None) -> tuple[int, str] | None:
    """The memory this process could still take without a kill: the machine's MemAvailable, or
    its cgroup's limit less what the group holds (its inactive file pages, which the kernel
    reclaims first, left out) when lower."""
    found = []
    machine = meminfo_bytes("MemAvailable:")
    if machine is not None:
        found.append((machine, "this machine has"))
    for folder in cgroup_dirs() if folders is None else folders:
        for limit_file, usage_file, reclaimable in (
            ("memory.max", "memory.current", "inactive_file"),  # v2
            ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),  # v1
        ):
            try:
                limit = int((folder / limit_file).read_text().split()[0])
                usage = int((folder / usage_file).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # "max": no limit, or not this version's files
            if limit < 2**60:
                held = usage - (read_counter(folder / "memory.stat", reclaimable) or 0)
                found.append((max(0, limit - held), "its cgroup (container) has"))
    return min(found) if found else None


def resident(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def children(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found.update(int(child) for child in (task / "children").read_text().split())
    except (OSError, ValueError):
        pass
    return found


# A process SIGKILLed while its processes held this share of the limit was killed for memory.
NEAR_LIMIT = 0.9


class MemoryWatch:
    """Samples the workers' resident memory while they run (a thread, twice a second), so that
    a worker the kernel kills for memory can be named as such, with the figures."""

    def __init__(self, config: TrainConfig, local_size: int, interval_s: float = 0.5) -> None:
        self.config, self.local_size, self.interval_s = config, local_size, interval_s
        self.last: dict[int, int] = {}  # pid -> its resident bytes when last seen
        self.total_with: dict[int, int] = {}  # pid -> all workers' bytes when it was last seen
        self.kills_before = oom_kills()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="memory-watch", daemon=True)

    def __enter__(self) -> MemoryWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()

    def sample(self) -> None:
        sizes = {pid: size for pid in children(os.getpid()) if (size := resident(pid))}
        total = sum(sizes.values())
        for pid, size in sizes.items():
            self.last[pid], self.total_with[pid] = size, total

    def watch(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.sample()

    def verdict(self, rank: int, pid: int) -> str | None:
        """The line for a worker killed by SIGKILL, when there is evidence it was for memory."""
        now = oom_kills()
        counted = any(now.get(path, 0) > before for path, before in self.kills_before.items())
        limit = memory_limit()
        held, total = self.last.get(pid), self.total_with.get(pid)
        near = limit is not None and total is not None and total >= NEAR_LIMIT * limit[0]
        evidence = counted or near
        return memory_line(rank, pid, held, total, limit, evidence, self.config, self.local_size)


def memory_line(
    rank: int,
    pid: int,
    held: int | None,
    total: int | None,
    limit: tuple[int, str] | None,
    evidence: bool,
    config: TrainConfig,
    local_size: int,
) -> str | None:
    """`rank R was killed for memory: the figures; try a smaller setting`, or None without
    evidence (a kernel OOM kill counted, or the workers at the limit when last seen)."""
    if not evidence:
        return None
    line = f"rank {rank} (pid {pid}) was killed for memory"
    if held is not None:
        line += f": it held {gib(held)}"
        if total is not None and local_size > 1:
            line += f" (this node's {local_size} processes {gib(total)})"
        if limit is not None:
            line += f" of the {gib(limit[0])} {limit[1]}"
    elif limit is not None:
        line += f": {limit[1]} {gib(limit[0])}"
    tries = []
    if config.data.batch_size > 1:
        tries.append(f"data.batch_size={config.data.batch_size // 2}")
    if local_size > 1:
        tries.append(f"--nproc-per-node {local_size // 2}")
    if rank == 0 and config.trainer.async_checkpoint and config.trainer.checkpoint_every:
        tries.append("trainer.async_checkpoint=false (rank 0 holds a host copy of the state)")
    if tries:
        line += f"; try {' or '.join(tries)}"
    return line

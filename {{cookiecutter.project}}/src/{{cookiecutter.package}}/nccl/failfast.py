"""Fail fast, with a remedy: a gate collective right after init, and one readable block when a
collective times out or fails, instead of minutes of repeated stack traces."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.world import World
from .decision import Decision

GATE_PHASE = "the gate right after init_process_group"  # the first collective: the transport's test
STALL_MARGIN_S = 10  # past dist.timeout_s, when the stall watchdog acts if NCCL has not
NCCL_WORK = re.compile(r"WorkNCCL\(SeqNum=(\d+), OpType=(\w+)")
# A peer's connection closed: gloo's and NCCL's words for a process that ended.
PEER_DIED = re.compile(
    r"connection (closed|reset) by (remote )?peer|broken pipe|remote process exited"
    r"|ncclRemoteError|connection refused",
    re.IGNORECASE,
)
# Messages of c10d, gloo and NCCL; not DataLoader or other timeouts.
COMM_FAILURE = re.compile(
    r"gloo|nccl|processgroup|watchdog caught|collective operation|connection (closed|reset) by peer"
    r"|caused pair closure",  # gloo's timeout, raised inside DDP's backward
    re.IGNORECASE,
)
GATE_BYTES = (
    4 * 2**20
)  # large enough to leave NCCL's small-message path, small enough to be instant


class GateFailed(RuntimeError):
    """The first all-reduce after init did not finish in time, or returned a wrong sum."""


class Cause(Enum):
    transport = "transport"  # NCCL could not move data (the gate itself failed)
    peer_died = "peer_died"  # a peer's connection closed: its process ended
    peer_silent = "peer_silent"  # a peer stopped answering within dist.timeout_s


@dataclass(frozen=True)
class CollectiveFailure:
    collective: str
    sequence: str
    phase: str
    detail: str
    cause: Cause


def gate(device: torch.device, timeout_s: float) -> None:
    """All-reduce a few MiB of rank+1 and check the sum: proves the chosen transport end to end."""
    rank, world = dist.get_rank(), dist.get_world_size()
    values = torch.full((GATE_BYTES // 4,), float(rank + 1), device=device)
    work = dist.all_reduce(values, async_op=True)
    try:
        completed = work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise GateFailed(
            f"the gate all-reduce did not finish within {timeout_s:g} s: {err}"
        ) from err
    if completed is False:
        raise GateFailed(f"the gate all-reduce did not finish within {timeout_s:g} s")
    expected = world * (world + 1) / 2
    wrong = int((values != expected).sum())
    if wrong:
        raise GateFailed(
            f"the gate all-reduce returned {wrong} wrong values (expected {expected:g}): "
            "data corruption"
        )


class Heartbeat:
    """What the loop tells a stall watchdog. This one listens to nothing: for runs without one."""

    def beat(self) -> None:
        pass

    @contextmanager
    def paused(self) -> Iterator[None]:
        yield


NO_WATCHDOG = Heartbeat()


class StallWatchdog(Heartbeat):
    """Calls on_stall(failure) from a daemon thread when beat() has not been called for limit_s.

    A collective on a wedged communicator can neither finish nor raise; this makes sure the
    process still ends, with the remedy, shortly after dist.timeout_s. Work that is no collective
    and may take longer (checkpoint I/O) runs under paused().
    """

    def __init__(self, limit_s: float, on_stall: Callable[[CollectiveFailure], None]) -> None:
        self.limit_s = limit_s
        self.on_stall = on_stall
        self.last_beat = time.monotonic()
        self.pauses = 0
        self.stopped = threading.Event()
        threading.Thread(target=self.watch, name="stall-watchdog", daemon=True).start()

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    @contextmanager
    def paused(self) -> Iterator[None]:
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1
            self.beat()

    def stop(self) -> None:
        self.stopped.set()

    def watch(self) -> None:
        while not self.stopped.wait(timeout=1.0):
            if not self.pauses and time.monotonic() - self.last_beat > self.limit_s:
                self.on_stall(
                    CollectiveFailure(
                        "a collective (most likely DDP's gradient ALLREDUCE)",
                        sequence_number(),
                        f"training: no step finished for {self.limit_s:g} s",
                        "the collective neither finished nor raised an error",
                        Cause.peer_silent,
                    )
                )
                return


class LauncherWatch:
    """Calls on_orphaned() once, from a daemon thread, when the process that started this one
    (torchrun) is gone: its workers must not train on unsupervised."""

    def __init__(self, on_orphaned: Callable[[int], None], interval_s: float = 1.0) -> None:
        self.parent = os.getppid()
        self.on_orphaned, self.interval_s = on_orphaned, interval_s
        self.stopped = threading.Event()
        threading.Thread(target=self.watch, name="launcher-watch", daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()

    def watch(self) -> None:
        while not self.stopped.wait(timeout=self.interval_s):
            if os.getppid() != self.parent:  # reparented: the launcher died
                self.on_orphaned(self.parent)
                return


def sequence_number() -> str:
    try:  # private, but the only way to name the collective for backends that do not say it
        return str(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:
        return "unknown"


def as_collective_failure(err: BaseException, phase: str, backend: str) -> CollectiveFailure | None:
    """A communication failure described for the report; None for any other error."""
    if isinstance(err, GateFailed):
        cause = Cause.transport if backend == "nccl" else Cause.peer_silent
        return CollectiveFailure("ALLREDUCE", sequence_number(), GATE_PHASE, str(err), cause)
    text = str(err)
    communication = isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and COMM_FAILURE.search(text)
    )
    if not communication:
        return None
    detail = text.strip().splitlines()[0][:300]
    if PEER_DIED.search(text):
        cause = Cause.peer_died
    elif backend == "nccl" and phase == GATE_PHASE:
        cause = Cause.transport
    else:
        cause = Cause.peer_silent
    work = NCCL_WORK.search(text)
    if work:
        return CollectiveFailure(work.group(2), work.group(1), phase, detail, cause)
    collective = "ALLREDUCE (most likely DDP's gradient buckets)"
    return CollectiveFailure(collective, sequence_number(), phase, detail, cause)


def claim_report(run_dir: Path, world: World) -> bool:
    """True for the first process of this launch to fail: only it prints the full block."""
    marker = run_dir / "nccl" / f"failure-reported-{world.attempt}"  # one per launch
    marker.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def remedy_block(
    failure: CollectiveFailure,
    *,
    rank: int,
    backend: str,
    timeout_s: float,
    decision: Decision,
    profile: str,
    launch: str,
    package: str,
    trace_prefix: str,
) -> str:
    """What failed, the evidence, and what to do: NCCL transport advice only where the transport
    is in question (NCCL, and the gate itself failed)."""
    rule = "=" * 78
    lines = [
        "",
        rule,
        f"A collective failed on rank {rank} ({backend}): {failure.collective}, sequence number "
        f"{failure.sequence}, during {failure.phase} (dist.timeout_s={timeout_s:g}).",
        f"  {failure.detail}",
        "",
    ]
    if backend == "nccl":
        lines += [f"NCCL environment in force (nccl={profile}):", decision.report(), ""]
    lines += (
        CAUSES[failure.cause]
        .format(timeout_s=f"{timeout_s:g}", launch=launch, package=package)
        .splitlines()
    )
    if backend == "nccl":
        lines.append(f"Flight recorder: {trace_prefix}<rank>, read with torchfrtrace.")
    lines.append(rule)
    return "\n".join(lines)


CAUSES = {
    Cause.transport: """\
The first collective failed: NCCL could not move data between these processes. Likely causes,
most likely first:
  1. GPU peer-to-peer over PCIe is blocked (ACS or IOMMU on the host, or a VM): the first
     ALLREDUCE hangs. NVLink is not affected. Fix the host (disable ACS, iommu=pt) or use P2P off.
  2. /dev/shm is too small for NCCL's shared-memory transport (the container default is 64 MiB):
     mount an emptyDir with medium: Memory at /dev/shm.
  3. An InfiniBand network plugin that ignores NCCL_IB_DISABLE: add nccl.env.NCCL_IBEXT_DISABLE=1.
  4. NCCL picked the wrong network interface: set nccl.socket_ifname (e.g. eth0, or ^lo,docker).

Next:
  python -m {package}.doctor                          # tests each profile on this node
  {launch} nccl=pcie_safe
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET {launch}""",
    Cause.peer_died: """\
Another process of this run ended while this one waited for it: its connection closed. The
transport is not in question, and why it ended is not known here:
torchrun's summary names the process that ended first, with its exit code or signal.
  - An error printed above this block, from that process: that error is the cause.
  - SIGKILL: it was killed from outside: out of memory (dmesg; on Kubernetes, kubectl describe
    pod shows OOMKilled), its pod or node went away, or torchrun ended it 30 s after a SIGTERM.
  - 143 or 130 (SIGTERM, SIGINT): it was asked to stop.

Next:
  kubectl describe pod <pod>; kubectl logs <pod> --previous   # on Kubernetes
  the same command again: the run resumes from its newest checkpoint""",
    Cause.peer_silent: """\
Another process stopped answering: nothing came from it for {timeout_s} s. Likely causes, most
likely first:
  1. It is stuck: a deadlock, slow storage, swapping, a debugger or SIGSTOP.
  2. It is busy with work the others finished long ago (a much longer step, a data loader that
     stalls); raise dist.timeout_s if that work is expected.

Next:
  py-spy dump --pid <pid>        # on each rank: where it waits
  nvidia-smi                     # a GPU at 100% with no progress: a stuck kernel""",
}

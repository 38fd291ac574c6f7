"""Fail fast, with a remedy: a gate collective right after init, and one readable block when a
collective times out or fails, instead of minutes of repeated stack traces."""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from {{ cookiecutter.package }} import probe
from {{ cookiecutter.package }}.nccl import Decision

EXIT_COLLECTIVE_FAILED = 3
STALL_MARGIN_S = 10  # past dist.timeout_s, when the stall watchdog acts if NCCL has not
NCCL_WORK = re.compile(r"WorkNCCL\(SeqNum=(\d+), OpType=(\w+)")
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


@dataclass(frozen=True)
class CollectiveFailure:
    collective: str
    sequence: str
    phase: str
    detail: str


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
            f"the gate all-reduce returned {wrong} wrong values (expected {expected:g}): data corruption"
        )


class StallWatchdog:
    """Calls on_stall(failure) from a daemon thread when beat() has not been called for limit_s.

    A collective on a wedged communicator can neither finish nor raise; this makes sure the
    process still ends, with the remedy, shortly after dist.timeout_s.
    """

    def __init__(self, limit_s: float, on_stall: Callable[[CollectiveFailure], None]) -> None:
        self.limit_s = limit_s
        self.on_stall = on_stall
        self.last_beat = time.monotonic()
        self.stopped = threading.Event()
        threading.Thread(target=self.watch, name="stall-watchdog", daemon=True).start()

    def beat(self) -> None:
        self.last_beat = time.monotonic()

    def stop(self) -> None:
        self.stopped.set()

    def watch(self) -> None:
        while not self.stopped.wait(timeout=1.0):
            if time.monotonic() - self.last_beat > self.limit_s:
                self.on_stall(
                    CollectiveFailure(
                        "a collective (most likely DDP's gradient ALLREDUCE)",
                        sequence_number(),
                        f"training: no step finished for {self.limit_s:g} s",
                        "the collective neither finished nor raised an error",
                    )
                )
                return


def sequence_number() -> str:
    try:  # private, but the only way to name the collective for backends that do not say it
        return str(dist.distributed_c10d._get_default_group()._get_sequence_number_for_group())
    except Exception:
        return "unknown"


def as_collective_failure(err: BaseException, phase: str) -> CollectiveFailure | None:
    """A communication failure described for the report; None for any other error."""
    if isinstance(err, GateFailed):
        return CollectiveFailure(
            "ALLREDUCE", sequence_number(), "gate right after init_process_group", str(err)
        )
    communication = isinstance(err, dist.DistError) or (
        isinstance(err, RuntimeError) and COMM_FAILURE.search(str(err))
    )
    if not communication:
        return None
    detail = str(err).strip().splitlines()[0][:300]
    work = NCCL_WORK.search(str(err))
    if work:
        return CollectiveFailure(work.group(2), work.group(1), phase, detail)
    return CollectiveFailure(
        "ALLREDUCE (most likely DDP's gradient buckets)", sequence_number(), phase, detail
    )


def claim_report(run_dir: Path) -> bool:
    """True for the first process of this launch to fail: only it prints the full block."""
    marker = run_dir / "nccl" / f"failure-reported-{probe.attempt_id()}"  # one per launch
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
    timeout_s: float,
    decision: Decision,
    profile: str,
    package: str,
    nproc: int,
    trace_prefix: str,
) -> str:
    launch = f"torchrun --standalone --nproc-per-node {nproc} -m {package}.train"
    rule = "=" * 78
    return f"""
{rule}
A collective failed on rank {rank}: {failure.collective}, sequence number {failure.sequence},
during {failure.phase} (dist.timeout_s={timeout_s:g}).
  {failure.detail}

NCCL environment in force (nccl={profile}):
{decision.report()}

Likely causes, most likely first:
  1. GPU peer-to-peer over PCIe is blocked (ACS or IOMMU on the host, or a VM): the first
     ALLREDUCE hangs. NVLink is not affected. Fix the host (disable ACS, iommu=pt) or use P2P off.
  2. /dev/shm is too small for NCCL's shared-memory transport (the container default is 64 MiB):
     mount an emptyDir with medium: Memory at /dev/shm.
  3. An InfiniBand network plugin that ignores NCCL_IB_DISABLE: add nccl.env.NCCL_IBEXT_DISABLE=1.
  4. NCCL picked the wrong network interface: set nccl.socket_ifname (e.g. eth0, or ^lo,docker).

Next:
  python -m {package}.doctor                          # tests each profile on this node
  {launch} nccl=pcie_safe
  NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET {launch}
Flight recorder (NCCL only): {trace_prefix}<rank>, read with torchfrtrace.
{rule}"""

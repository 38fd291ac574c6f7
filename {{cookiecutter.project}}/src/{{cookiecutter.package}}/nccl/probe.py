"""Facts about this node for `nccl=auto` and the doctor: GPUs and their links, a real peer copy
between PCIe-only pairs, InfiniBand, /dev/shm, and the node count.

Local rank 0 probes once per node and publishes the result; the other local ranks read it, so
every rank decides from identical facts. Broken PCIe P2P usually hangs rather than fails, so each
peer copy runs in its own process under a hard timeout:

    python -m {{ cookiecutter.package }}.nccl.probe --peer-copy 0 1  # exit 0: data intact
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.exits import Exit
from ..core.files import write_atomically
from ..core.world import World
from .decision import NodeFacts

NVLINK_CELL = re.compile(r"NV\d+")
NVML_P2P_CAPS_INDEX_READ = 0  # literal ints: one nvidia-ml-py release mislabels these constants
NVML_P2P_CAPS_INDEX_NVLINK = 2
NVML_P2P_STATUS_OK = 0
PEER_COPY_TIMEOUT_S = 10.0
PUBLISH_WAIT_S = 180.0


@dataclass(frozen=True)
class Topology:
    nvlink_pairs: frozenset[tuple[int, int]]
    claimed_p2p: dict[tuple[int, int], bool]  # what the driver says, before any copy is tried
    source: str  # "nvml", "nvidia-smi" or "none"


def nvlink_pairs_from_topo(text: str) -> frozenset[tuple[int, int]]:
    """GPU pairs joined by NVLink in `nvidia-smi topo -m` output (cells like NV18)."""
    pairs = set()
    for line in text.splitlines():
        cells = line.split()
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            continue
        i = int(cells[0][3:])
        for j, cell in enumerate(cells[1:]):
            if NVLINK_CELL.fullmatch(cell) and i != j:
                pairs.add((min(i, j), max(i, j)))
    return frozenset(pairs)


def nvidia_smi_topology(timeout_s: float = 10.0) -> str:
    """`nvidia-smi topo -m`, or "" where the tool is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        done = subprocess.run(
            ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def visible_device_ids(gpu_count: int) -> list[str]:
    """NVML identifiers (index or UUID) of CUDA devices 0..gpu_count-1, per CUDA_VISIBLE_DEVICES."""
    spec = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [part.strip() for part in spec.split(",")] if spec else [str(i) for i in range(gpu_count)]
    return ids[:gpu_count]


def nvml_topology(gpu_count: int) -> Topology | None:
    """Links from NVML (nvidia-ml-py); None where the library or the driver is missing."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handles = [
            pynvml.nvmlDeviceGetHandleByIndex(int(ident))
            if ident.isdigit()
            else pynvml.nvmlDeviceGetHandleByUUID(ident)
            for ident in visible_device_ids(gpu_count)
        ]
        nvlink, claimed = set(), {}
        for i in range(len(handles)):
            for j in range(i + 1, len(handles)):
                status = pynvml.nvmlDeviceGetP2PStatus(
                    handles[i], handles[j], NVML_P2P_CAPS_INDEX_NVLINK
                )
                if status == NVML_P2P_STATUS_OK:
                    nvlink.add((i, j))
                read = pynvml.nvmlDeviceGetP2PStatus(
                    handles[i], handles[j], NVML_P2P_CAPS_INDEX_READ
                )
                claimed[(i, j)] = read == NVML_P2P_STATUS_OK
        return Topology(frozenset(nvlink), claimed, "nvml")
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def topology(gpu_count: int) -> Topology:
    if gpu_count < 2:
        return Topology(frozenset(), {}, "none")
    found = nvml_topology(gpu_count)
    if found is not None:
        return found
    # nvidia-smi numbers GPUs physically: right while CUDA_VISIBLE_DEVICES keeps their order.
    text = nvidia_smi_topology()
    return Topology(nvlink_pairs_from_topo(text), {}, "nvidia-smi" if text else "none")


def peer_copy_command(src: int, dst: int) -> list[str]:
    return [sys.executable, "-m", __name__, "--peer-copy", str(src), str(dst)]


@dataclass(frozen=True)
class Outcome:
    status: str  # "ok" (exit 0), "failed" (any other exit) or "hang" (killed at the timeout)
    output: str = ""


def run_with_hard_timeout(
    command: Sequence[str],
    timeout_s: float,
    env: dict[str, str] | None = None,
    capture: bool = False,
) -> Outcome:
    """Run `command` in its own process group; at the timeout, kill the group (a hung CUDA or
    NCCL process may have children of its own)."""
    pipe = subprocess.PIPE if capture else subprocess.DEVNULL
    # A Ctrl-C while Popen waits for the exec would leave the child, in a session of its own, with
    # nothing to kill it: it is held until the child's group is known, then raised below.
    held: list[int] = []
    main = threading.current_thread() is threading.main_thread()  # the one that gets signals
    main = main and signal.getsignal(signal.SIGINT) is not None  # None: not set from Python
    previous = signal.signal(signal.SIGINT, lambda *_: held.append(1)) if main else None
    try:
        process = subprocess.Popen(
            command,
            env=env,
            stdout=pipe,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    try:
        if held:
            signal.raise_signal(signal.SIGINT)  # the caller's handler: KeyboardInterrupt, as a rule
        output, _ = process.communicate(timeout=timeout_s)
        return Outcome("ok" if process.returncode == 0 else "failed", output or "")
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return Outcome("hang", output or "")
    except KeyboardInterrupt:  # its own session got no SIGINT: it would outlive the caller
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise


def peer_copy_tests(
    pairs: Sequence[tuple[int, int]],
    timeout_s: float = PEER_COPY_TIMEOUT_S,
    command: Callable[[int, int], list[str]] = peer_copy_command,
) -> dict[tuple[int, int], str]:
    """A verified copy across each pair, all pairs at once, each in its own process."""
    if not pairs:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(pairs))) as pool:
        results = pool.map(
            lambda pair: run_with_hard_timeout(command(*pair), timeout_s).status, pairs
        )
        return dict(zip(pairs, results, strict=True))


def active_ib_ports(sys_ib: Path = Path("/sys/class/infiniband")) -> int:
    """InfiniBand ports whose state reads `4: ACTIVE`."""
    states = sys_ib.glob("*/ports/*/state")
    return sum(1 for state in states if "ACTIVE" in state.read_text(errors="replace"))


def shm_bytes(path: str = "/dev/shm") -> int | None:
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_frsize * stats.f_blocks


def gpu_count() -> int:
    import torch  # NVML-based count: creates no CUDA context

    return torch.cuda.device_count()


def basic_facts(world: World, count: Callable[[], int] = gpu_count) -> NodeFacts:
    """The cheap facts, for profiles that decide nothing themselves: no link probe, no copies.
    `world`: the launch the decision is for (its size, and its processes on this node)."""
    return NodeFacts(
        gpu_count=count(),
        nvlink_pairs=frozenset(),
        ib_active_ports=active_ib_ports(),
        world_size=world.size,
        local_world_size=world.local_size,
        shm_bytes=shm_bytes(),
    )


def probe_node(
    world: World,
    timeout_s: float = PEER_COPY_TIMEOUT_S,
    command: Callable[[int, int], list[str]] = peer_copy_command,
    count: Callable[[], int] = gpu_count,
) -> NodeFacts:
    """Everything `auto` decides from: links by NVML or nvidia-smi, and a peer copy per
    PCIe pair."""
    started = time.perf_counter()
    facts = basic_facts(world, count)
    gpus = facts.gpu_count
    links = topology(gpus)
    pcie = [
        (i, j) for i in range(gpus) for j in range(i + 1, gpus) if (i, j) not in links.nvlink_pairs
    ]
    tests = peer_copy_tests(pcie, timeout_s, command) if facts.local_world_size > 1 else {}
    return replace(
        facts,
        nvlink_pairs=links.nvlink_pairs,
        p2p_tests=tests,
        probe_s=round(time.perf_counter() - started, 3),
    )


def shared_node_facts(
    run_dir: Path,
    world: World,
    probe: Callable[[], NodeFacts] | None = None,
    wait_s: float = PUBLISH_WAIT_S,
) -> NodeFacts:
    """Local rank 0 probes (probe_node, unless `probe` is given) and publishes atomically; the
    other local ranks wait and read."""
    path = run_dir / "nccl" / f"probe-{socket.gethostname()}-{world.attempt}.json"
    if world.local_rank == 0:
        facts = probe() if probe else probe_node(world)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, facts.to_json())  # readers see the whole file or none
        return facts
    deadline = time.monotonic() + wait_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"local rank 0 published no node probe at {path} within {wait_s:.0f} s"
            )
        time.sleep(0.05)
    return NodeFacts.from_json(path.read_text())


def peer_copy(src: int, dst: int) -> bool:
    """Copy 64 MiB GPU src -> dst -> src (direct peer access where the driver allows it) and
    compare: broken P2P hangs here or corrupts the data."""
    import torch

    original = torch.arange(16 * 2**20, dtype=torch.float32, device=f"cuda:{src}")
    there = original.to(f"cuda:{dst}")
    back = there.to(f"cuda:{src}")
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    return bool(torch.equal(original, back) and torch.equal(there.cpu(), original.cpu()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peer-copy", nargs=2, type=int, metavar=("SRC", "DST"), required=True)
    args = parser.parse_args()
    sys.exit(Exit.OK if peer_copy(*args.peer_copy) else Exit.FAILED)

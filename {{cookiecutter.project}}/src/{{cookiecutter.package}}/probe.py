"""Facts about this node for the `auto` NCCL profile: GPUs, their links, InfiniBand, node count."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from {{ cookiecutter.package }}.nccl import NodeFacts

NVLINK_CELL = re.compile(r"NV\d+")


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


def active_ib_ports(sys_ib: Path = Path("/sys/class/infiniband")) -> int:
    """InfiniBand ports whose state reads `4: ACTIVE`."""
    states = sys_ib.glob("*/ports/*/state")
    return sum(1 for state in states if "ACTIVE" in state.read_text(errors="replace"))


def probe_node() -> NodeFacts:
    gpu_count = torch.cuda.device_count()
    return NodeFacts(
        gpu_count=gpu_count,
        # nvidia-smi numbers GPUs physically; fine while every GPU of the node is visible.
        nvlink_pairs=nvlink_pairs_from_topo(nvidia_smi_topology())
        if gpu_count > 1
        else frozenset(),
        ib_active_ports=active_ib_ports(),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    )

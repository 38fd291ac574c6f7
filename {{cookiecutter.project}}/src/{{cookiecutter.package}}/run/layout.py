"""How a run dir names its checkpoints: what the launcher can list without importing torch, and
the Checkpointer writes (checkpoint.py)."""

from __future__ import annotations

import re
from pathlib import Path

NAME = re.compile(r"step_(\d{9})\.(pt|dcp)")  # a file, or a DCP folder
BEST = "best.pt"  # trainer.keep_best's: not a step_ name, so no resume or keep policy touches it
BEST_DCP = "best.dcp"  # best.pt's in the DCP format


def checkpoint_paths(run_dir: Path) -> list[Path]:
    """Files named as checkpoints in the run dir, oldest step first; readable or not."""
    directory = run_dir / "checkpoints"
    found = (
        [p for p in directory.glob("step_*") if NAME.fullmatch(p.name)]
        if directory.is_dir()
        else []
    )
    return sorted(found, key=lambda path: (step_of(path), path.suffix == ".pt"))


def step_of(path: Path) -> int:
    return int(NAME.fullmatch(path.name).group(1))

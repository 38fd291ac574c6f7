"""torch.compile in this project: where it is used, what it compiles, and a watch on recompiles.

The model is compiled, and the cross-entropy apart from it: inductor then reads the bf16 logits
once for the softmax and once for its gradient, where eager autocast first writes them out in
fp32 (32 x 1024 x 50304 x 4 bytes, 6.6 GB, at gpt2_small's shape). On an H200 that step took
66.6 ms against 74.3 with the eager loss, MFU 0.425 against 0.381; the model and the loss in one
graph took 67.9 (measured on the template's benchmarks).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, MutableMapping
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config.schema import TrainConfig

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def compiles(cfg: TrainConfig, device: torch.device) -> bool:
    """trainer.compile on CUDA only: inductor's CPU code needs a C++ compiler, which an image or
    a CI machine may lack, and the CPU is where this project runs its tests, not its training."""
    return cfg.trainer.compile and device.type == "cuda"


CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"  # inductor's FX graphs and AOTAutograd; Triton's beneath


def keep_caches_in(run_dir: Path, env: MutableMapping[str, str] = os.environ) -> Path | None:
    """torch.compile's caches beside the run dir (`<its parent>/.compile-cache`, the runs' own
    storage), where a relaunched or rescheduled pod, and the next run, find them: /tmp, inductor's
    default, is the node's, so every new pod compiled from nothing (25 s for gpt2_small on an
    H200; 3 s from the cache). Inductor's keys hold the torch version and the GPU, so runs share
    them safely, and it writes them atomically, so ranks and nodes may too. Set before the first
    compile: inductor reads the variable when it first needs the directory. A directory the user
    chose stays theirs (None)."""
    if env.get(CACHE_VAR):
        return None
    path = run_dir.parent / ".compile-cache"
    env[CACHE_VAR] = str(path)
    return path


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean loss over every position: logits (..., classes) against labels (...)."""
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten())


def loss_function(compiled: bool) -> Loss:
    return torch.compile(cross_entropy) if compiled else cross_entropy


def _graphs() -> int:
    from torch._dynamo.utils import counters  # private, so any failure turns the watch off

    return int(counters["stats"].get("unique_graphs", 0))


def _guard_failures() -> dict[object, list[str]]:
    """Dynamo's recompile causes, per compiled code object, oldest first."""
    from torch._dynamo import utils

    return {code: list(reasons) for code, reasons in getattr(utils, "guard_failures", {}).items()}


class Recompiles:
    """The graphs torch.compile makes after the first step. A step whose shapes (or other
    guarded values) differ from every compiled one's compiles again, as long as the first step
    did, and past torch._dynamo.config.recompile_limit the code runs eager, with one warning
    from dynamo; till then nothing says so. news() names them each log window. Each rank
    watches its own; rank 0 says so. The counts are dynamo's private ones: where a torch version
    lacks them, the watch is off and says so once."""

    def __init__(self) -> None:
        self.graphs = 0
        self.seen: dict[object, int] = {}  # causes seen, per code object
        self.total = 0  # since the first step
        self.off: str | None = None  # why the watch is off
        self.said_off = False

    def start(self) -> None:
        """After the first step: what it compiled is the run's own."""
        try:
            self.graphs = _graphs()
            self.seen = {code: len(reasons) for code, reasons in _guard_failures().items()}
        except Exception as err:  # noqa: BLE001 - a diagnostic must not stop a run
            self.off = f"{type(err).__name__}: {err}"

    def news(self) -> str | None:
        """A line if graphs were compiled since the last call, naming dynamo's last cause."""
        graphs, failures = 0, {}
        if self.off is None:
            try:
                graphs, failures = _graphs(), _guard_failures()
            except Exception as err:  # noqa: BLE001
                self.off = f"{type(err).__name__}: {err}"
        if self.off is not None:
            if self.said_off:
                return None
            self.said_off = True
            return f"the watch on recompiles is off: torch._dynamo's counts failed ({self.off})"
        new = graphs - self.graphs
        causes = [r for code, rs in failures.items() for r in rs[self.seen.get(code, 0) :]]
        self.graphs, self.seen = graphs, {code: len(rs) for code, rs in failures.items()}
        if new <= 0:
            return None
        self.total += new
        last = re.sub(r"^\d+/\d+: ", "", causes[-1]) if causes else "not given"
        limit = getattr(torch._dynamo.config, "recompile_limit", 8)
        return (
            f"torch.compile compiled {self.total} new graph(s) since the first step (last "
            f"cause: {last}). Each costs a compile's time, and past "
            f"torch._dynamo.config.recompile_limit ({limit}) that code runs eager: keep the "
            "input shapes fixed (equal-length samples, whole batches), or trainer.compile=false"
        )

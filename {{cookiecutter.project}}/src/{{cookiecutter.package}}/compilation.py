"""torch.compile in this project: where it is used, what it compiles, and a watch on recompiles.

The model is compiled, and the cross-entropy apart from it: inductor then reads the bf16 logits
once for the softmax and once for its gradient, where eager autocast first writes them out in
fp32 (32 x 1024 x 50304 x 4 bytes, 6.6 GB, at gpt2_small's shape). On an H200 that step took
66.6 ms against 74.3 with the eager loss, MFU 0.425 against 0.381; the model and the loss in one
graph took 67.9 (benchmarks/loss/compare.py, BENCHMARKS.md, issue 22).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

from {{ cookiecutter.package }}.config import TrainConfig

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def compiles(cfg: TrainConfig, device: torch.device) -> bool:
    """trainer.compile on CUDA only: inductor's CPU code needs a C++ compiler, which an image or
    a CI machine may lack, and the CPU is where this project runs its tests, not its training."""
    return cfg.trainer.compile and device.type == "cuda"


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean loss over every position: logits (..., classes) against labels (...)."""
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten())


def loss_function(compiled: bool) -> Loss:
    return torch.compile(cross_entropy) if compiled else cross_entropy


def _graphs() -> int:
    from torch._dynamo.utils import counters  # private, so read defensively

    return int(counters["stats"].get("unique_graphs", 0))


def _guard_failures() -> list[str]:
    from torch._dynamo import utils

    failures = getattr(utils, "guard_failures", {})
    return [reason for reasons in list(failures.values()) for reason in reasons]


class Recompiles:
    """The graphs torch.compile makes after the first step. A step whose shapes (or other
    guarded values) differ from every compiled one's compiles again, as long as the first step
    did, and past torch._dynamo.config.recompile_limit the code runs eager, with one warning
    from dynamo; till then nothing says so. news() names them each log window."""

    def __init__(self) -> None:
        self.graphs = self.failures = 0
        self.total = 0  # since the first step

    def start(self) -> None:
        """After the first step: what it compiled is the run's own."""
        self.graphs, self.failures = _graphs(), len(_guard_failures())

    def news(self) -> str | None:
        """A line if graphs were compiled since the last call, naming dynamo's last cause."""
        graphs, failures = _graphs(), _guard_failures()
        new, cause = graphs - self.graphs, failures[self.failures :]
        self.graphs, self.failures = graphs, len(failures)
        if new <= 0:
            return None
        self.total += new
        last = re.sub(r"^\d+/\d+: ", "", cause[-1]) if cause else "not given"
        limit = getattr(torch._dynamo.config, "recompile_limit", 8)
        return (
            f"torch.compile compiled {self.total} new graph(s) since the first step (last "
            f"cause: {last}). Each costs a compile's time, and past "
            f"torch._dynamo.config.recompile_limit ({limit}) that code runs eager: keep the "
            "input shapes fixed (equal-length samples, whole batches), or trainer.compile=false"
        )

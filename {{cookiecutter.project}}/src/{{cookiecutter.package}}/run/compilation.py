"""torch.compile in this project: what it compiles, what the cache gave, and a watch on
recompiles. Where the caches live: core/caches.py.

Each of the model's repeated blocks is compiled (or, without them, the model), and the
cross-entropy apart from it: inductor then reads the bf16 logits once for the softmax and once
for its gradient, where eager autocast first writes them out in fp32 (32 x 1024 x 50304 x 4
bytes, 6.6 GB, at gpt2_small's shape): a faster step, and faster than the model and the loss
in one graph (docs/performance.md).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..config.schema import TrainConfig
from .fsdp import blocks

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def compiles(cfg: TrainConfig, device: torch.device) -> bool:
    """trainer.compile on CUDA only: inductor's CPU code needs a C++ compiler, which an image or
    a CI machine may lack, and the CPU is where this project runs its tests, not its training."""
    return cfg.trainer.compile and device.type == "cuda"


def compiled_forward(model: nn.Module, bare: nn.Module) -> Callable[..., torch.Tensor]:
    """The forward that trains, compiled: `model` is `bare` as wrapped for its strategy (DDP, or
    FSDP2 in place). A model made of repeated blocks (the GPT's) has each block compiled in place,
    which dynamo compiles once and reuses for every block of the same code and shapes: a cold
    first step in half the time, a step as fast within 1% (docs/performance.md). In place, a
    block keeps its parameter names, and DDP's and FSDP2's hooks run around it as in eager
    mode. A model of no repeated blocks (the MLP's layers are bare Linears) is compiled whole,
    where inductor fuses across its layers."""
    regions = repeated_blocks(bare)
    if not regions:
        return torch.compile(model)
    for block in regions:
        block.compile()
    return model


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks (fsdp.blocks) where there are several of one class, each of modules of
    its own; else none."""
    found = blocks(model)
    repeated = len(found) > 1 and len({type(block) for block in found}) == 1
    nested = all(next(block.children(), None) is not None for block in found)
    return found if repeated and nested else []


CACHE_COUNTS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")


def cache_counts() -> dict[str, int]:
    """Inductor's cache counts so far in this process (torch's private ones; empty where they
    are missing): a sweep's jobs share a process, each reports its own difference."""
    try:
        from torch._dynamo.utils import counters

        return {name: int(counters["inductor"][name]) for name in CACHE_COUNTS}
    except Exception:  # noqa: BLE001 - a diagnostic must not stop a run
        return {}


def cache_report(cache: Path | None, before: dict[str, int]) -> str:
    """After the first compile: whether inductor found its graphs in the cache, from its counts
    since `before` (cache_counts()); where torch has none, only where the cache is."""
    now = cache_counts()
    if not now or not before:
        return f"cache {cache}"
    hits, misses, bypassed = (now[name] - before[name] for name in CACHE_COUNTS)
    if hits and not misses:
        return f"cache hit, {cache}"
    if misses and not hits:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        return (
            f"cold: nothing cached for torch {torch.__version__} / {gpu} / this model; "
            f"cached now in {cache}"
        )
    if hits or misses:
        return f"{hits} of {hits + misses} graphs from the cache, {cache}"
    if bypassed:
        return f"the cache unused: inductor bypassed it for {bypassed} graph(s), {cache}"
    return f"no graph compiled by inductor, {cache}"


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

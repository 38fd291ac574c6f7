"""The one place the model is wrapped for dist.strategy: DistributedDataParallel as configured in
configs/dist/ (its knobs, a compressing comm hook, and with dist.time_comm a hook that times the
gradient all-reduces), or FSDP2's sharding (fsdp.py); activation checkpointing under either."""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations as objects.
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config.schema import CommHook, DistConfig, Precision, Strategy
from ..core.world import World
from . import fsdp

log = logging.getLogger(__name__)
COMM_HOOKS = {
    CommHook.default: None,  # DDP's built-in all-reduce, in C++
    CommHook.bf16: default_hooks.bf16_compress_hook,
    CommHook.fp16: default_hooks.fp16_compress_hook,
}


def wrap(
    module: nn.Module,
    cfg: DistConfig,
    device: torch.device,
    world: World,
    precision: Precision = Precision.fp32,
) -> tuple[nn.Module, "CommTimer | None"]:
    """DDP over several processes. One process trains the bare module: DDP's bucket copies and
    hooks would only slow its step. fsdp2 shards `module` in place (on one process too: its
    mixed-precision policy holds there) and returns it."""
    blocks = len(fsdp.blocks(module))  # a model with none: one group, nothing recomputed
    if cfg.activation_checkpointing:
        fsdp.checkpoint_activations(module)
        if world.main:
            log.info("dist.activation_checkpointing: %d block(s) recompute their forward", blocks)
    if cfg.strategy is Strategy.fsdp2:
        if world.main:
            log.info(
                "dist.strategy=fsdp2: %d block(s) and the root sharded over %d process(es)",
                blocks,
                world.size,
            )
        return fsdp.shard(module, device, precision), None
    if world.size == 1:
        return module, None
    model = DDP(
        module,
        device_ids=[device] if device.type == "cuda" else None,
        # Fewer, larger all-reduces: faster at 100 MB than at DDP's 25 (docs/performance.md).
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,  # grads live in the buckets: no copy
        static_graph=cfg.static_graph,  # the same parameters get gradients every step
    )
    hook = COMM_HOOKS[cfg.comm_hook]
    timer = CommTimer(hook, device) if cfg.time_comm else None
    if timer or hook:  # a Python hook runs for every bucket of every step: only when asked
        model.register_comm_hook(None, timer.hook if timer else hook)
    return model, timer


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """A micro-batch that is not the step's last: its gradients add up locally, not reduced."""
    if isinstance(model, DDP):
        with model.no_sync():
            yield
    elif fsdp.sharded(model):
        with fsdp.no_sync(model):
            yield
    else:
        yield


class CommTimer:
    """A DDP comm hook around the chosen one that, on an armed step, notes when each gradient
    bucket's all-reduce starts and ends. share() is the part of that step with an all-reduce in
    flight, first start to last end: overlapped with the backward pass or not."""

    def __init__(self, hook: Any | None, device: torch.device) -> None:
        self.inner = hook or default_hooks.allreduce_hook
        self.cuda = device.type == "cuda"
        self.armed = False
        self.marks: list[Any] = []  # step start, bucket starts and ends, step end

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: for a callback, one that waits for the work
        return event

    def hook(
        self, state: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:  # DDP checks these annotations
        """For DDP.register_comm_hook."""
        if not self.armed:
            return self.inner(state, bucket)
        start = self.mark()
        future = self.inner(state, bucket)

        def finished(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self.marks.append((start, self.mark()))
            return done.value()

        return future.then(finished)

    def arm(self) -> None:
        self.armed, self.marks = True, [self.mark()]

    def share(self) -> float | None:
        """After the armed step: the fraction of it with an all-reduce in flight (None if the
        step was not armed)."""
        if not self.armed:
            return None
        self.armed, marks = False, self.marks
        self.marks = []
        step_start, buckets, step_end = marks[0], marks[1:], self.mark()
        if not buckets:
            return 0.0
        if self.cuda:
            step_end.synchronize()
            elapsed = step_start.elapsed_time
            first, last = min(elapsed(s) for s, _ in buckets), max(elapsed(e) for _, e in buckets)
            return (last - first) / max(elapsed(step_end), 1e-9)
        first, last = min(s for s, _ in buckets), max(e for _, e in buckets)
        return (last - first) / max(step_end - step_start, 1e-9)

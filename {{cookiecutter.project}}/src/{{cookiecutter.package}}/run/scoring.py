"""A model scored on the held-out data: the one code path behind `evaluate` (a checkpoint, on one
or more processes) and the Trainer's validation (every trainer.val_every steps).

Each process scores its shard of the held-out set (in order, no sample on two ranks), or its
shard's first trainer.val_batches batches when validating; the sums of the loss, the correct
predictions and the predictions are all-reduced, so every rank holds the same figures.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from ..config.options import DataConfig
from ..core.world import World
from . import fsdp
from .batches import epoch_batches, ignore_sigterm


@dataclass
class Score:
    loss: float  # mean cross-entropy per prediction
    accuracy: float
    predictions: int  # over every rank
    complete: bool = True  # False: a rank was asked to stop part-way (stop()): partial figures


def held_out_batches(data: Dataset, cfg: DataConfig, world: World) -> DataLoader:
    """This rank's shard of `data` in batches of data.batch_size, the last one short. Its own
    generator: scoring never draws from the RNG that training (and its checkpoints) carry."""
    shard = DistributedSampler(
        data, num_replicas=world.size, rank=world.rank, shuffle=False, drop_last=True
    )
    return DataLoader(
        data,
        sampler=BatchSampler(shard, cfg.batch_size, drop_last=False),
        batch_size=None,  # the sampler yields whole batches
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,  # validation reads it again and again
        worker_init_fn=ignore_sigterm,  # a stop signal is the trainer's to act on
        generator=torch.Generator(),
    )


def score(
    model: torch.nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    autocast: Callable[[], AbstractContextManager],
    world: World,
    limit: int | None = None,
    stop: Callable[[], bool] = lambda: False,
    progress: Callable[[], None] = lambda: None,
) -> Score:
    """The model's loss and accuracy over every rank's batches (the first `limit` of them), in
    eval mode (its mode is put back). stop() is asked before each batch: a rank told to stop
    scores no more, and every rank's figures say they are incomplete (the one all-reduce carries
    it). progress() is called after each batch: scoring a large set is no stalled step. A model
    sharded over the ranks (dist.strategy=fsdp2) gathers its blocks in each forward, every rank
    at once: there the ranks agree on stopping before each batch (one small all-reduce)."""
    # loss x predictions, correct, predictions, ranks stopped part-way: one all-reduce
    sums = torch.zeros(4, device=device, dtype=torch.float64)
    training = model.training
    agree = world.size > 1 and fsdp.sharded(model)
    model.eval()
    try:
        with torch.no_grad(), autocast():
            for inputs, labels in itertools.islice(epoch_batches(batches), limit):
                if agreed_stop(stop(), device) if agree else stop():
                    sums[3] = 1
                    break
                inputs, labels = inputs.to(device), labels.to(device)
                logits = model(inputs).flatten(0, -2)
                labels = labels.flatten()
                sums[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
                sums[1] += (logits.argmax(dim=-1) == labels).sum()
                sums[2] += labels.numel()
                progress()
    finally:
        model.train(training)
    if world.size > 1:
        dist.all_reduce(sums)
    loss_sum, correct, predictions, stopped = sums.tolist()
    return Score(
        loss=loss_sum / max(1, predictions),
        accuracy=correct / max(1, predictions),
        predictions=int(predictions),
        complete=not stopped,
    )


def agreed_stop(asked: bool, device: torch.device) -> bool:
    """Whether any rank was asked to stop."""
    flag = torch.tensor([float(asked)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())

"""The batches of each rank's shard: which samples each micro-batch takes (StepBatches, exact on a
resume at any world size), on the GPU or through a DataLoader, with the stop signals left to the
trainer."""

import signal
from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from ..config.options import DataConfig
from ..core.world import World


class StepBatches(Sampler[list[int]]):
    """This rank's micro-batches, as index lists, such that the samples of each optimizer step do
    not depend on the world size: each epoch is one permutation of the data set (the seed and the
    epoch's, the same on every rank, as DistributedSampler's); each optimizer step takes the next
    global batch of it (processes × batch_size × accumulation), each of its micro-batches the next
    processes × batch_size, and rank r every processes-th of those, from the r-th. A run resumed
    part-way through an epoch, on any world size with the same global batch, takes exactly the
    samples an uninterrupted one would, without loading the skipped ones. Each epoch's tail of
    fewer than a global batch is left out (drop_last)."""

    def __init__(
        self, size: int, batch_size: int, accumulation: int, world: World, seed: int
    ) -> None:
        self.size, self.batch_size, self.world, self.seed = size, batch_size, world, seed
        self.accumulation = accumulation  # set again by a resume that adjusts it
        self.epoch = self.start = 0

    def set_position(self, epoch: int, samples_in_epoch: int = 0) -> None:
        """Where the next step starts: the samples of this epoch's permutation already taken."""
        self.epoch, self.start = epoch, samples_in_epoch

    @property
    def per_micro_step(self) -> int:
        """The samples every rank's next micro-batch takes together."""
        return self.world.size * self.batch_size

    def steps_left(self) -> int:
        return max(0, self.size - self.start) // (self.per_micro_step * self.accumulation)

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.randperm(
            self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        first = self.start + self.world.rank
        for i in range(self.steps_left() * self.accumulation):
            begin = first + i * self.per_micro_step
            yield order[begin : begin + self.per_micro_step : self.world.size].tolist()

    def __len__(self) -> int:
        return self.steps_left() * self.accumulation


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}  # torchrun's and Kubernetes'; Ctrl-C's


def ignore_sigterm(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM and SIGINT (Ctrl-C reaches the whole process group) to
    the trainer, which stops at a step and checkpoints; they end with it."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def epoch_batches(loader: Iterable[tuple[torch.Tensor, ...]]) -> Iterator[tuple[torch.Tensor, ...]]:
    """iter(loader) with SIGTERM and SIGINT blocked while it forks the workers: one between a
    fork and ignore_sigterm would kill the worker, and the trainer with it. A worker keeps the
    signals blocked, then ignored; the trainer gets any that came meanwhile once it unblocks."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class DeviceBatches:
    """Batches of a data set held in GPU memory: each epoch's indices go over in one copy, and
    each batch is a gather on the GPU, with no host work and no synchronisation per batch."""

    def __init__(self, dataset: TensorDataset, batches: StepBatches) -> None:
        self.dataset = dataset
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        order = list(self.batches)
        if order:
            device = self.dataset.tensors[0].device
            for batch in torch.tensor(order, device=device):
                # index_select, not dataset[batch]: advanced indexing costs the host more, and a
                # step of a few ms waits for the host (seen in a GPU trace)
                yield tuple(tensor.index_select(0, batch) for tensor in self.dataset.tensors)

    def __len__(self) -> int:
        return len(self.batches)


def build_loader(
    dataset: Dataset,
    cfg: DataConfig,
    accumulation: int,
    seed: int,
    device: torch.device,
    world: World,
) -> tuple[Iterable[tuple[torch.Tensor, ...]], StepBatches]:
    """Batches of this rank's shard. A TensorDataset takes a whole batch of indices at once, so
    each batch is one gather, not batch_size lookups and a stack (the main process keeps up with
    a GPU step of a few ms). A dataset of single samples: have its __getitem__ take a list of
    indices, or wrap it, and raise data.num_workers."""
    batches = StepBatches(len(dataset), cfg.batch_size, accumulation, world, seed)
    if cfg.on_device:
        # a data set read from disk (data.TokenFile) gives its samples as tensors to be held
        held = dataset.in_memory() if hasattr(dataset, "in_memory") else dataset
        on_device = TensorDataset(*(tensor.to(device) for tensor in held.tensors))
        return DeviceBatches(on_device, batches), batches
    loader = DataLoader(
        dataset,
        sampler=batches,
        batch_size=None,  # the sampler yields whole batches
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,  # no worker start-up at each epoch
        worker_init_fn=ignore_sigterm,  # torchrun signals the whole group; the trainer decides
        pin_memory=cfg.pin_memory
        and device.type == "cuda",  # lets .to(device, non_blocking=True) overlap
    )
    return loader, batches

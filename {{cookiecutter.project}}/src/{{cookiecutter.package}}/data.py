"""Synthetic data sets, made from the seed (no download), and the batches of each rank's shard.

data=synthetic: points labelled by a fixed random teacher, for model=mlp; data=tokens: token
sequences for next-token prediction, for model=gpt. A model visibly learns either in a few
hundred steps.
"""

import itertools
import signal
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from {{ cookiecutter.package }}.config import DataConfig, PointsConfig, TokensConfig
from {{ cookiecutter.package }}.world import World

NOISE = 4  # data=tokens: the values each next token can take given the one before


def points_dataset(cfg: PointsConfig, seed: int) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random two-layer teacher: learnable, not trivial."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(cfg.num_samples, cfg.num_features, generator=gen)
    hidden = torch.randn(cfg.num_features, 4 * cfg.num_classes, generator=gen)
    readout = torch.randn(4 * cfg.num_classes, cfg.num_classes, generator=gen)
    labels = (torch.tanh(inputs @ hidden) @ readout).argmax(dim=1)
    return TensorDataset(inputs, labels)


def tokens_dataset(cfg: TokensConfig, seed: int) -> TensorDataset:
    """Sequences where each token is a fixed affine function of the one before, plus noise of
    NOISE values: a model that learns the rule reaches a loss of log(NOISE). Inputs are the
    tokens, labels the same tokens one position on."""
    gen = torch.Generator().manual_seed(seed)
    scale, shift = (int(v) for v in torch.randint(1, cfg.vocab_size, (2,), generator=gen))
    sequences = torch.empty(cfg.num_samples, cfg.seq_len + 1, dtype=torch.long)
    sequences[:, 0] = torch.randint(cfg.vocab_size, (cfg.num_samples,), generator=gen)
    noise = torch.randint(NOISE, (cfg.num_samples, cfg.seq_len), generator=gen)
    for position in range(cfg.seq_len):
        sequences[:, position + 1] = (
            sequences[:, position] * scale + shift + noise[:, position]
        ) % cfg.vocab_size
    return TensorDataset(sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous())


def build_dataset(cfg: DataConfig, seed: int) -> TensorDataset:
    """Every rank builds the identical set from the seed; the sampler splits it."""
    return tokens_dataset(cfg, seed) if isinstance(cfg, TokensConfig) else points_dataset(cfg, seed)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part-way, so a resumed run sees exactly the
    batches an uninterrupted one would, without loading the skipped ones."""

    def __init__(self, *args: Any, batch_size: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_size = batch_size
        self.start = 0

    def set_position(self, epoch: int, batch_in_epoch: int = 0) -> None:
        self.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        self.start = batch_in_epoch * self.batch_size

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(super().__iter__(), self.start, None)

    def __len__(self) -> int:
        return max(0, super().__len__() - self.start)


def ignore_sigterm(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM to the trainer, which stops at a step and checkpoints;
    they end with it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class DeviceBatches:
    """Batches of a data set held in GPU memory: each epoch's indices go over in one copy, and
    each batch is a gather on the GPU, with no host work and no synchronisation per batch."""

    def __init__(self, dataset: TensorDataset, batches: BatchSampler) -> None:
        self.dataset = dataset
        self.batches = batches

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        order = list(self.batches)
        if order:
            device = self.dataset.tensors[0].device
            for batch in torch.tensor(order, device=device):
                yield self.dataset[batch]

    def __len__(self) -> int:
        return len(self.batches)


def build_loader(
    dataset: TensorDataset, cfg: DataConfig, seed: int, device: torch.device, world: World
) -> tuple[Iterable[tuple[torch.Tensor, ...]], ResumableSampler]:
    """Batches of this rank's shard. A TensorDataset takes a whole batch of indices at once, so
    each batch is one gather, not batch_size lookups and a stack (the main process keeps up with
    a GPU step of a few ms). A dataset of single samples: pass batch_size instead of a
    BatchSampler, and raise data.num_workers."""
    sampler = ResumableSampler(
        dataset, num_replicas=world.size, rank=world.rank, batch_size=cfg.batch_size,
        shuffle=True, seed=seed, drop_last=True,
    )  # fmt: skip
    batches = BatchSampler(sampler, cfg.batch_size, drop_last=True)
    if cfg.on_device:
        on_device = TensorDataset(*(tensor.to(device) for tensor in dataset.tensors))
        return DeviceBatches(on_device, batches), sampler
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
    return loader, sampler

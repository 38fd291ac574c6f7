"""A synthetic classification set: no download, and a model visibly learns it in a few hundred steps."""

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from {{ cookiecutter.package }}.config import DataConfig


def synthetic_dataset(cfg: DataConfig, seed: int) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random two-layer teacher: learnable, not trivial.

    Every rank builds the identical set from the seed; DistributedSampler splits it.
    """
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(cfg.num_samples, cfg.num_features, generator=gen)
    hidden = torch.randn(cfg.num_features, 4 * cfg.num_classes, generator=gen)
    readout = torch.randn(4 * cfg.num_classes, cfg.num_classes, generator=gen)
    labels = (torch.tanh(inputs @ hidden) @ readout).argmax(dim=1)
    return TensorDataset(inputs, labels)


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

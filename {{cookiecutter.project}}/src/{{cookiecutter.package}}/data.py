"""A synthetic classification set: no download, and a model visibly learns it in a few hundred steps."""

import torch
from torch.utils.data import TensorDataset

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

"""The data sets: each data option's builder.

data=synthetic: points labelled by a fixed random teacher, for model=mlp; data=tokens: token
sequences for next-token prediction, for model=gpt, made from the seed or read from a data folder
(data.path) that `python -m {{ cookiecutter.package }}.prepare` made from text. A model visibly
learns either in a few hundred steps. Each has a held-out split that training never sees, for
`python -m {{ cookiecutter.package }}.evaluate`.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from .config.options import HELD_OUT, DataConfig, PointsConfig, TokensConfig
from .config.registry import builder_of, builds
from .config.token_files import read_meta

NOISE = 4  # data=tokens: the values each next token can take given the one before


@builds(PointsConfig)
def points_dataset(cfg: PointsConfig, seed: int, held_out: bool) -> TensorDataset:
    """Gaussian inputs labelled by a fixed random two-layer teacher: learnable, not trivial. The
    held-out points (one in HELD_OUT) are drawn after the training ones, from the same teacher."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randn(cfg.num_samples, cfg.num_features, generator=gen)
    hidden = torch.randn(cfg.num_features, 4 * cfg.num_classes, generator=gen)
    readout = torch.randn(4 * cfg.num_classes, cfg.num_classes, generator=gen)
    if held_out:
        inputs = torch.randn(cfg.num_samples // HELD_OUT, cfg.num_features, generator=gen)
    labels = (torch.tanh(inputs @ hidden) @ readout).argmax(dim=1)
    return TensorDataset(inputs, labels)


def tokens_dataset(cfg: TokensConfig, seed: int, held_out: bool) -> TensorDataset:
    """Sequences where each token is a fixed affine function of the one before, plus noise of
    NOISE values: a model that learns the rule reaches a loss of log(NOISE). Inputs are the
    tokens, labels the same tokens one position on. The held-out sequences follow the training
    ones, under the same rule."""
    gen = torch.Generator().manual_seed(seed)
    scale, shift = (int(v) for v in torch.randint(1, cfg.vocab_size, (2,), generator=gen))

    def draw(count: int) -> torch.Tensor:
        sequences = torch.empty(count, cfg.seq_len + 1, dtype=torch.long)
        sequences[:, 0] = torch.randint(cfg.vocab_size, (count,), generator=gen)
        noise = torch.randint(NOISE, (count, cfg.seq_len), generator=gen)
        for position in range(cfg.seq_len):
            sequences[:, position + 1] = (
                sequences[:, position] * scale + shift + noise[:, position]
            ) % cfg.vocab_size
        return sequences

    sequences = draw(cfg.num_samples)
    if held_out:
        sequences = draw(cfg.num_samples // HELD_OUT)
    return TensorDataset(sequences[:, :-1].contiguous(), sequences[:, 1:].contiguous())


class TokenShards(Dataset):
    """A data folder's train or val shards (data.path): consecutive sequences of seq_len + 1
    tokens in each shard, read from disk as they are needed (memory maps, opened in the process
    that reads them: a DataLoader worker maps the files, never gets a copy)."""

    def __init__(self, cfg: TokensConfig, held_out: bool) -> None:
        folder = Path(cfg.path)
        meta = read_meta(folder)
        self.dtype, self.length = meta["dtype"], cfg.seq_len
        listed = meta["shards"]["val" if held_out else "train"]
        # shards too short for a sequence are left out: np.memmap cannot map an empty file
        self.files = [
            (folder / s["file"], s["tokens"]) for s in listed if s["tokens"] > self.length
        ]
        counts = [(tokens - 1) // self.length for _, tokens in self.files]
        self.ends = np.cumsum(counts, dtype=np.int64)
        self.starts = self.ends - np.asarray(counts, dtype=np.int64)
        self.maps: list[np.memmap] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "maps": None}  # a worker maps the files itself

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch at once, as StepBatches hands it over."""
        if self.maps is None:
            self.maps = [
                np.memmap(path, dtype=self.dtype, mode="r", shape=(tokens,))
                for path, tokens in self.files
            ]
        wanted = np.asarray(indices, dtype=np.int64)
        shards = np.searchsorted(self.ends, wanted, side="right")
        offsets = (wanted - self.starts[shards]) * self.length
        rows = np.stack(
            [self.maps[k][o : o + self.length + 1] for k, o in zip(shards, offsets, strict=True)]
        ).astype(np.int64)
        batch = torch.from_numpy(rows)
        return batch[:, :-1], batch[:, 1:]

    def in_memory(self) -> TensorDataset:
        return TensorDataset(*self[range(len(self))])


@builds(TokensConfig)
def token_sequences(cfg: TokensConfig, seed: int, held_out: bool) -> Dataset:
    """data=tokens: its data folder's shards (data.path), or synthetic sequences from the seed."""
    return tokens_dataset(cfg, seed, held_out) if cfg.path is None else TokenShards(cfg, held_out)


def build_dataset(cfg: DataConfig, seed: int, held_out: bool = False) -> Dataset:
    """The data option's builder. Every rank builds the identical set from the seed (or reads
    the same files); the sampler splits it."""
    return builder_of(cfg)(cfg, seed, held_out)

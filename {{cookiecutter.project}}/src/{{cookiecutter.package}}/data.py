"""The data sets: each data option's builder, and a token file made from text.

data=synthetic: points labelled by a fixed random teacher, for model=mlp; data=tokens: token
sequences for next-token prediction, for model=gpt, made from the seed or read from a token file
(data.path). A model visibly learns either in a few hundred steps. Each has a held-out split
that training never sees, for `python -m {{ cookiecutter.package }}.evaluate`. A text file
becomes a token file, one token per byte:

    python -m {{ cookiecutter.package }}.data data/sample.txt data/sample.bin
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from .config.options import HELD_OUT, DataConfig, PointsConfig, TokensConfig
from .config.registry import builder_of, builds
from .core.exits import Exit
from .core.files import write_atomically

NOISE = 4  # data=tokens: the values each next token can take given the one before
TOKEN_DTYPE = np.uint16  # a token file, as nanoGPT writes them: vocabularies up to 65536


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


class TokenFile(Dataset):
    """A token file (data.path): consecutive sequences of seq_len + 1 tokens, read from disk as
    they are needed (a memory map). The last one in HELD_OUT is held out."""

    def __init__(self, cfg: TokensConfig, held_out: bool) -> None:
        self.tokens = np.memmap(cfg.path, dtype=TOKEN_DTYPE, mode="r")
        self.length = cfg.seq_len
        count = (len(self.tokens) - 1) // self.length
        held = max(1, count // HELD_OUT)
        self.first, self.count = (count - held, held) if held_out else (0, count - held)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch at once, as StepBatches hands it over."""
        starts = (np.asarray(indices) + self.first) * self.length
        rows = np.stack([self.tokens[s : s + self.length + 1] for s in starts]).astype(np.int64)
        batch = torch.from_numpy(rows)
        return batch[:, :-1], batch[:, 1:]

    def in_memory(self) -> TensorDataset:
        return TensorDataset(*self[range(self.count)])


@builds(TokensConfig)
def token_sequences(cfg: TokensConfig, seed: int, held_out: bool) -> Dataset:
    """data=tokens: its token file (data.path), or synthetic sequences from the seed."""
    return tokens_dataset(cfg, seed, held_out) if cfg.path is None else TokenFile(cfg, held_out)


def build_dataset(cfg: DataConfig, seed: int, held_out: bool = False) -> Dataset:
    """The data option's builder. Every rank builds the identical set from the seed (or reads
    the same file); the sampler splits it."""
    return builder_of(cfg)(cfg, seed, held_out)


CHUNK_BYTES = 2**26  # text read 64 MiB at a time: a file of any size converts in bounded memory


def prepare(text: Path, out: Path) -> int:
    """A token file from text: its UTF-8 bytes, one token each (a vocabulary of 256). Swap in a
    real tokenizer for real work (nanoGPT's prepare scripts use tiktoken's GPT-2 encoding).
    Written beside `out` and renamed into place: an interrupted run leaves no partial file that
    a training run would read."""
    count = 0

    def convert(sink: BinaryIO) -> None:
        nonlocal count
        with text.open("rb") as source:
            while chunk := source.read(CHUNK_BYTES):
                np.frombuffer(chunk, dtype=np.uint8).astype(TOKEN_DTYPE).tofile(sink)
                count += len(chunk)

    write_atomically(out, convert)
    return count


def prepare_problem(text: Path, out: Path) -> str | None:
    """Why `python -m ... data TEXT OUT` cannot run, as one line; None if it can."""
    if not text.exists():
        return f"{text}: no such file"
    if not text.is_file():
        return f"{text}: not a file"
    try:
        with text.open("rb") as source:
            if not source.read(1):
                return f"{text}: empty, no tokens to write"
    except OSError as err:
        return f"{text}: cannot be read ({err.strerror or err})"
    if out.is_dir():
        return f"{out}: a directory; name the token file to write, e.g. {out / 'tokens.bin'}"
    if not out.parent.is_dir():
        return f"{out}: no folder {out.parent} to write it in"
    if out.exists() and out.samefile(text):
        return f"{out}: the text file itself; write the tokens to another file"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("text", type=Path, help="a text file")
    parser.add_argument("out", type=Path, help="the token file to write, e.g. data/sample.bin")
    args = parser.parse_args()
    problem = prepare_problem(args.text, args.out)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return Exit.CONFIG_ERROR
    try:
        count = prepare(args.text, args.out)
    except OSError as err:
        print(
            f"error: {err.filename or args.out}: {err.strerror or err}; {args.out} not written",
            file=sys.stderr,
        )
        return Exit.FAILED
    except KeyboardInterrupt:
        print(f"interrupted; {args.out} not written", file=sys.stderr)
        return Exit.INTERRUPTED
    print(f"wrote {count} tokens (bytes; data.vocab_size >= 256) to {args.out}")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())

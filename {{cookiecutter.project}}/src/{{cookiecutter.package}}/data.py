"""Data sets, and the batches of each rank's shard.

data=synthetic: points labelled by a fixed random teacher, for model=mlp; data=tokens: token
sequences for next-token prediction, for model=gpt, made from the seed or read from a token file
(data.path). A model visibly learns either in a few hundred steps. Each has a held-out split
that training never sees, for `python -m {{ cookiecutter.package }}.evaluate`.

    python -m {{ cookiecutter.package }}.data data/sample.txt data/sample.bin     # text -> a token file (bytes as tokens)
"""

import argparse
import signal
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from .config import HELD_OUT, DataConfig, PointsConfig, TokensConfig
from .exits import Exit
from .registry import builder_of, builds
from .world import World

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
                # step of a few ms waits for the host (a trace on an H200, on the template's benchmarks)
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
        held = dataset.in_memory() if isinstance(dataset, TokenFile) else dataset
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


CHUNK_BYTES = 2**26  # text read 64 MiB at a time: a file of any size converts in bounded memory


def prepare(text: Path, out: Path) -> int:
    """A token file from text: its UTF-8 bytes, one token each (a vocabulary of 256). Swap in a
    real tokenizer for real work (nanoGPT's prepare scripts use tiktoken's GPT-2 encoding).
    Written beside `out` and renamed into place: an interrupted run leaves no partial file that
    a training run would read."""
    partial = out.with_name(f".{out.name}.partial")
    count = 0
    try:
        with text.open("rb") as source, partial.open("wb") as sink:
            while chunk := source.read(CHUNK_BYTES):
                np.frombuffer(chunk, dtype=np.uint8).astype(TOKEN_DTYPE).tofile(sink)
                count += len(chunk)
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
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
        print(f"error: {err.filename or args.out}: {err.strerror or err}; {args.out} not written",
              file=sys.stderr)  # fmt: skip
        return Exit.FAILED
    except KeyboardInterrupt:
        print(f"interrupted; {args.out} not written", file=sys.stderr)
        return Exit.INTERRUPTED
    print(f"wrote {count} tokens (bytes; data.vocab_size >= 256) to {args.out}")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())

"""The data sets: each data option's builder, and a data folder made from text.

data=synthetic: points labelled by a fixed random teacher, for model=mlp; data=tokens: token
sequences for next-token prediction, for model=gpt, made from the seed or read from a data folder
(data.path). A model visibly learns either in a few hundred steps. Each has a held-out split
that training never sees, for `python -m {{ cookiecutter.package }}.evaluate`. Text becomes a
data folder: a byte-level BPE tokenizer trained on it (HF tokenizers, offline), and its tokens
in train and val shards:

    python -m {{ cookiecutter.package }}.data data/sample.txt data/sample

data/sample.txt is the opening of tinyshakespeare (Shakespeare's plays, public domain).
"""

import argparse
import json
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

from .config.options import HELD_OUT, DataConfig, PointsConfig, TokensConfig
from .config.registry import builder_of, builds
from .config.token_files import FORMAT, META, TOKENIZER, read_meta, sha256_of
from .core.exits import Exit
from .core.files import partial_name, write_atomically

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


END_OF_TEXT = "<|endoftext|>"  # after each document (file), as GPT-2's
MIN_VOCAB = 257  # every byte (any text encodes) and END_OF_TEXT
MAX_VOCAB = 2**32  # the most ids uint32 shards hold
DEFAULT_VOCAB = 4096  # data/sample.txt's 240 kB make about 71k tokens of it
UINT16_IDS = 2**16  # ids a uint16 shard holds; a larger vocabulary is stored as uint32
SHARD_TOKENS = 10**8  # tokens per shard file: 200 MB of uint16
CHUNK_CHARS = 2**20  # text read and encoded a megabyte at a time: any corpus in bounded memory
SPLITS = ("train", "val")


class CorpusError(Exception):
    """Why the corpus, the vocabulary size or the output folder will not do, as one line."""


def corpus_files(sources: Sequence[Path]) -> list[Path]:
    """The files named, and every file below the folders named (hidden ones left out: .git)."""
    files: dict[Path, None] = {}  # in order, each once
    for source in sources:
        if source.is_dir():
            below = sorted(
                path
                for path in source.rglob("*")
                if path.is_file()
                and not any(part.startswith(".") for part in path.relative_to(source).parts)
            )
            if not below:
                raise CorpusError(f"{source}: a folder with no files in it")
            files.update(dict.fromkeys(below))
        elif source.is_file():
            files[source] = None
        elif source.exists():
            raise CorpusError(f"{source}: not a regular file")
        else:
            raise CorpusError(f"{source}: no such file or folder")
    return list(files)


def pieces(path: Path) -> Iterator[str]:
    """A text file's text, CHUNK_CHARS at a time, each piece cut after a newline where one is."""
    with path.open(encoding="utf-8", newline="") as text:
        rest = ""
        while chunk := text.read(CHUNK_CHARS):
            chunk = rest + chunk
            cut = chunk.rfind("\n") + 1 or len(chunk)
            rest = chunk[cut:]
            yield chunk[:cut]
        if rest:
            yield rest


def survey(files: list[Path]) -> int:
    """The corpus's size in bytes, once every file is read through as UTF-8 text."""
    for path in files:
        try:
            for piece in pieces(path):
                if "\x00" in piece:
                    raise CorpusError(f"{path}: holds NUL bytes, so binary, not text; leave it out")
        except UnicodeDecodeError:
            raise CorpusError(
                f"{path}: not UTF-8 text (binary, or another encoding); leave it out, or convert "
                "it to UTF-8"
            ) from None
        except OSError as err:
            raise CorpusError(f"{path}: cannot be read ({err.strerror or err})") from None
    return sum(path.stat().st_size for path in files)


def output_problem(sources: Sequence[Path], out: Path) -> str | None:
    """Why `out` cannot become the data folder, or None."""
    if (out.is_dir() and any(out.iterdir())) or (out.exists() and not out.is_dir()):
        return f"{out}: exists; remove it, or name a new folder"
    if not out.parent.is_dir():
        return f"{out}: no folder {out.parent} to write it in"
    for source in sources:
        if source.is_dir() and out.resolve().is_relative_to(source.resolve()):
            return (
                f"{out}: inside the corpus folder {source}, whose every file is read as text; "
                "write it elsewhere"
            )
    return None


def vocab_problem(vocab_size: int) -> str | None:
    if vocab_size < MIN_VOCAB:
        return (
            f"--vocab-size {vocab_size}: below {MIN_VOCAB}, the 256 bytes a byte-level BPE "
            f"starts from and {END_OF_TEXT}"
        )
    if vocab_size > MAX_VOCAB:
        return f"--vocab-size {vocab_size}: above {MAX_VOCAB}, the most ids uint32 shards hold"
    return None


class ShardWriter:
    """One split's tokens, appended to shard files of SHARD_TOKENS: <split>-0000.bin, ..."""

    def __init__(self, folder: Path, split: str, dtype: str) -> None:
        self.folder, self.split, self.dtype = folder, split, dtype
        self.listed: list[dict[str, Any]] = []  # meta.json's: each file and its token count
        self.file = None

    def add(self, ids: Sequence[int]) -> None:
        tokens = np.asarray(ids, dtype=self.dtype)
        while len(tokens):
            if self.file is None or self.listed[-1]["tokens"] == SHARD_TOKENS:
                self.next_shard()
            room = SHARD_TOKENS - self.listed[-1]["tokens"]
            tokens[:room].tofile(self.file)
            self.listed[-1]["tokens"] += len(tokens[:room])
            tokens = tokens[room:]

    def next_shard(self) -> None:
        self.close()
        name = f"{self.split}-{len(self.listed):04d}.bin"
        self.file = (self.folder / name).open("wb")
        self.listed.append({"file": name, "tokens": 0})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def train_tokenizer(files: list[Path], vocab_size: int) -> Any:
    """A byte-level BPE (GPT-2's kind) trained on the corpus, offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(
        (piece for path in files for piece in pieces(path)), trainer=trainer
    )
    return tokenizer


def write_folder(files: list[Path], total: int, folder: Path, vocab_size: int) -> dict[str, Any]:
    """The tokenizer, the shards and meta.json, written into `folder`. The last tenth of the
    text's bytes (one in HELD_OUT, at least one byte) is the val split."""
    tokenizer = train_tokenizer(files, vocab_size)
    write_atomically(folder / TOKENIZER, tokenizer.to_str())
    vocab = tokenizer.get_vocab_size()
    dtype = "uint16" if vocab <= UINT16_IDS else "uint32"
    writers = {split: ShardWriter(folder, split, dtype) for split in SPLITS}
    val_from, seen = total - max(1, total // HELD_OUT), 0  # in bytes
    try:
        for path in files:
            for piece in pieces(path):
                size = len(piece.encode())
                if seen + size <= val_from:
                    writers["train"].add(tokenizer.encode(piece).ids)
                elif seen >= val_from:
                    writers["val"].add(tokenizer.encode(piece).ids)
                else:  # the piece the split falls in: cut there (a character cut in two, before)
                    head = piece.encode()[: val_from - seen].decode(errors="ignore")
                    writers["train"].add(tokenizer.encode(head).ids)
                    writers["val"].add(tokenizer.encode(piece[len(head) :]).ids)
                seen += size
            writers["train" if seen <= val_from else "val"].add(
                [tokenizer.token_to_id(END_OF_TEXT)]
            )
    finally:
        for writer in writers.values():
            writer.close()
    meta = {
        "format": FORMAT,
        "dtype": dtype,
        "vocab_size": vocab,
        "asked_vocab_size": vocab_size,
        "end_of_text_id": tokenizer.token_to_id(END_OF_TEXT),
        "tokenizer_sha256": sha256_of(folder / TOKENIZER),
        "tokens": {s: sum(shard["tokens"] for shard in writers[s].listed) for s in SPLITS},
        "shards": {split: writers[split].listed for split in SPLITS},
        "corpus": {"files": len(files), "bytes": total},
    }
    write_atomically(folder / META, json.dumps(meta, indent=2) + "\n")
    return meta


def prepare(sources: Sequence[Path], out: Path, vocab_size: int = DEFAULT_VOCAB) -> dict[str, Any]:
    """A data folder at `out` from the text files and folders `sources`; its meta.json's
    content. Written in a folder beside `out` and renamed into place: Ctrl-C, a full disk or a
    refusal leaves nothing that a training run would read. CorpusError: why it cannot be."""
    problem = vocab_problem(vocab_size) or output_problem(sources, out)
    if problem:
        raise CorpusError(problem)
    files = corpus_files(sources)
    total = survey(files)
    named = " ".join(map(str, sources))
    if total == 0:
        raise CorpusError(f"{named}: no text (every file is empty)")
    if vocab_size > MIN_VOCAB + total:  # a merge takes a pair of bytes at least
        raise CorpusError(
            f"--vocab-size {vocab_size}: {named} holds {total} bytes, which support at most "
            f"{MIN_VOCAB + total} tokens; ask for fewer"
        )
    staging = partial_name(out)
    staging.mkdir()
    try:
        meta = write_folder(files, total, staging, vocab_size)
        os.replace(staging, out)  # an empty folder at `out` is replaced too
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "corpus", type=Path, nargs="+", help="text files (UTF-8), or folders of them"
    )
    parser.add_argument("out", type=Path, help="the data folder to write (data.path=OUT)")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB,
        help=f"the tokenizer's ids, at most (default {DEFAULT_VOCAB})",
    )
    args = parser.parse_args(argv)
    try:
        meta = prepare(args.corpus, args.out, args.vocab_size)
    except CorpusError as err:
        print(f"error: {err}", file=sys.stderr)
        return Exit.CONFIG_ERROR
    except OSError as err:
        print(
            f"error: {err.filename or args.out}: {err.strerror or err}; {args.out} not written",
            file=sys.stderr,
        )
        return Exit.FAILED
    except KeyboardInterrupt:
        print(f"interrupted; {args.out} not written", file=sys.stderr)
        return Exit.INTERRUPTED
    vocab, asked = meta["vocab_size"], meta["asked_vocab_size"]
    short = f" (the text makes {vocab} of the {asked} asked)" if vocab < asked else ""
    print(
        f"wrote {meta['tokens']['train']} train and {meta['tokens']['val']} val tokens "
        f"({meta['dtype']}) and a tokenizer of {vocab} ids{short} to {args.out}: train with "
        f"data.path={args.out}"
    )
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())

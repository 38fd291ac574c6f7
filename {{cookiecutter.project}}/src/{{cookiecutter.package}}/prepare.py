"""Text made into a data folder (data.path=OUT): a byte-level BPE tokenizer trained on the corpus
(HF tokenizers, offline, GPT-2's kind), and the corpus's tokens in train and val shards, with a
meta.json that data=tokens checks before any process starts:

    python -m {{ cookiecutter.package }}.prepare data/sample.txt data/sample

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

from .config.options import HELD_OUT
from .config.token_files import FORMAT, META, TOKENIZER, sha256_of
from .core.exits import Exit
from .core.files import partial_name, write_atomically

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

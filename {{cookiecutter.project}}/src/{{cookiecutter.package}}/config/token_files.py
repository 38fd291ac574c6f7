"""A data folder that data.path names (`python -m <package>.prepare CORPUS OUT` writes one): its
meta.json read (read_meta), checked with its shards and tokenizer (data_folder_problem), its
sequences counted, and its largest token id, scanned once per launch.

The config check (config.options.TokensConfig) runs them before any process starts, so that a
missing, truncated or unreadable shard is one line, not an error at the first batch; the workers
the launcher starts find the scan's result in their environment.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Protocol

from .. import PACKAGE

META = "meta.json"  # what the folder holds: dtype, vocabulary, shards, the tokenizer's sha256
TOKENIZER = "tokenizer.json"  # HF tokenizers' file; generate reads it, the run dir keeps a copy
SPLITS = ("train", "val")  # val: the held-out shards, which training never reads
DTYPE_BYTES = {"uint16": 2, "uint32": 4}  # uint16 while the vocabulary fits 65536 ids
FORMAT = 1  # meta.json's layout; a folder of another is prepared again
CHUNK_TOKENS = 2**24  # a shard scanned 16M tokens at a time: any size in bounded memory
SCANNED_VAR = "DDP_TOKEN_FILE_SCAN"  # a scan's result, for the processes this one starts
MAKE = f"make one with python -m {PACKAGE}.prepare CORPUS OUT"
AGAIN = f"prepare it again with python -m {PACKAGE}.prepare"


class TokenData(Protocol):
    """What the checks read of a data=tokens config (config.options.TokensConfig)."""

    path: str | None
    seq_len: int


class FolderProblem(Exception):
    """What is wrong with a data folder, as the line after `data.path=...: `."""


def read_meta(folder: Path) -> dict[str, Any]:
    """meta.json, its shape checked: the fields the loaders and checks read are all there."""
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        raise FolderProblem(f"no {META}, so no data folder; {MAKE}") from None
    except OSError as err:
        raise FolderProblem(f"{META} cannot be read ({err.strerror or err})") from None
    except ValueError:  # not JSON, or not UTF-8
        raise FolderProblem(f"{META} is not JSON; {AGAIN}") from None
    try:
        usable = (
            meta["format"] == FORMAT
            and meta["dtype"] in DTYPE_BYTES
            and isinstance(meta["vocab_size"], int)
            and isinstance(meta["tokenizer_sha256"], str)
            and all(
                isinstance(shard["file"], str)
                and "/" not in shard["file"]
                and isinstance(shard["tokens"], int)
                and shard["tokens"] >= 0
                for split in SPLITS
                for shard in meta["shards"][split]
            )
        )
    except (KeyError, TypeError):
        usable = False
    if not usable:
        raise FolderProblem(f"{META} is not one this version writes; {AGAIN}")
    return meta


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(2**20):
            digest.update(block)
    return digest.hexdigest()


def split_sequences(meta: dict[str, Any], split: str, seq_len: int) -> int:
    """Sequences of seq_len + 1 tokens (consecutive ones share a token) in a split's shards;
    none crosses from one shard into the next."""
    return sum(max(0, shard["tokens"] - 1) // seq_len for shard in meta["shards"][split])


def largest_token(folder: Path, meta: dict[str, Any]) -> tuple[int, str, int]:
    """The largest id in the folder's shards, the shard and where in it, read a chunk at a time.
    The result is kept in the environment, keyed by the shards' identities: the launcher reads
    them once, and the workers it starts (heirs of its environment) do not read them again."""
    import numpy as np  # here, so that rendering k8s/ needs no numpy

    shards = [folder / shard["file"] for split in SPLITS for shard in meta["shards"][split]]
    identity = []
    for path in shards:
        stat = path.stat()
        identity.append(f"{path.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}")
    try:
        known = json.loads(os.environ.get(SCANNED_VAR, "{}"))
        if known.get("files") == identity:
            return int(known["max"]), str(known["shard"]), int(known["at"])
    except (ValueError, KeyError, TypeError, AttributeError):
        pass  # not ours, or garbled: read the shards
    top, where, at = -1, "", 0
    for path in shards:
        if path.stat().st_size == 0:
            continue  # no tokens: nothing to map
        tokens = np.memmap(path, dtype=meta["dtype"], mode="r")
        for start in range(0, len(tokens), CHUNK_TOKENS):
            chunk = tokens[start : start + CHUNK_TOKENS]
            index = int(chunk.argmax())
            if int(chunk[index]) > top:
                top, where, at = int(chunk[index]), path.name, start + index
        del tokens
    found = {"files": identity, "max": top, "shard": where, "at": at}
    os.environ[SCANNED_VAR] = json.dumps(found)
    return top, where, at


def data_folder_problem(data: TokenData) -> str | None:
    """Why data.path is no usable data folder for this config, or None."""
    try:
        check_folder(data)
    except FolderProblem as problem:
        return str(problem)
    return None


def check_folder(data: TokenData) -> dict[str, Any]:
    """The folder's meta.json, once the folder, its tokenizer and every shard are checked."""
    if not data.path:
        raise FolderProblem(f"an empty path; give a data folder ({MAKE}), or null for synthetic")
    folder = Path(data.path)
    if not folder.exists():
        raise FolderProblem(f"no such folder here ({Path.cwd()}); {MAKE}")
    if not folder.is_dir():
        raise FolderProblem(f"a file, not a data folder; {MAKE}")
    meta = read_meta(folder)
    try:
        if sha256_of(folder / TOKENIZER) != meta["tokenizer_sha256"]:
            raise FolderProblem(f"{TOKENIZER} is not the one {META} records (sha256); {AGAIN}")
    except FileNotFoundError:
        raise FolderProblem(f"no {TOKENIZER}; {AGAIN}") from None
    except OSError as err:
        raise FolderProblem(f"{TOKENIZER} cannot be read ({err.strerror or err})") from None
    width = DTYPE_BYTES[meta["dtype"]]
    for split in SPLITS:
        for shard in meta["shards"][split]:
            check_shard(folder / shard["file"], shard["tokens"] * width, meta["dtype"])
    for split in SPLITS:
        if split_sequences(meta, split, data.seq_len) < 1:
            tokens = sum(shard["tokens"] for shard in meta["shards"][split])
            raise FolderProblem(
                f"its {split} shards hold {tokens} tokens, not one sequence of data.seq_len="
                f"{data.seq_len} + 1; lower data.seq_len, or prepare it from more text"
            )
    top, shard, at = largest_token(folder, meta)
    if top >= meta["vocab_size"]:
        raise FolderProblem(
            f"{shard} holds token id {top} (token {at}), not below the tokenizer's "
            f"{meta['vocab_size']}: the shard is corrupt; {AGAIN}"
        )
    return meta


def check_shard(path: Path, size: int, dtype: str) -> None:
    """A shard meta.json lists is a readable regular file of the size it records."""
    try:
        found = path.stat().st_size
        if not path.is_file():  # a FIFO or a device: opening one may wait forever
            raise FolderProblem(f"{path.name} is not a regular file; {AGAIN}")
        with path.open("rb"):
            pass
    except FileNotFoundError:
        raise FolderProblem(f"{path.name}, which {META} lists, is missing; {AGAIN}") from None
    except OSError as err:
        raise FolderProblem(f"{path.name} cannot be read ({err.strerror or err})") from None
    if found != size:
        raise FolderProblem(
            f"{path.name} holds {found} bytes, not the {size} ({dtype} tokens) {META} records: "
            f"cut short or changed; {AGAIN}"
        )


def tokenizer_sha256(data: TokenData) -> str | None:
    """The sha256 of the tokenizer the data folder's tokens were made with (recorded in its
    meta.json and checked against the file), or None for data with no tokenizer."""
    if not data.path:
        return None
    try:
        return str(read_meta(Path(data.path))["tokenizer_sha256"])
    except FolderProblem:
        return None  # the config check says what is wrong with it

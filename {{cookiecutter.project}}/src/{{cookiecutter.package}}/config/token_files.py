"""A token file that data.path names, checked: what is wrong with it (token_file_problem), how
many sequences it holds, and its largest id, scanned once per launch.

The config check (config.options.TokensConfig) runs them before any process starts; the workers
the launcher starts find the scan's result in their environment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from .. import PACKAGE

TOKEN_BYTES = 2  # a token file holds uint16 ids, as nanoGPT writes them (data.TOKEN_DTYPE)
CHUNK_TOKENS = 2**24  # read 32 MiB of a token file at a time: any size scans in bounded memory
SCANNED_VAR = "DDP_TOKEN_FILE_SCAN"  # a scan's result, for the processes this one starts


class TokenData(Protocol):
    """What the checks read of a data=tokens config (config.options.TokensConfig)."""

    path: str | None
    seq_len: int
    vocab_size: int


def largest_token(path: Path) -> tuple[int, int]:
    """The largest id in a token file and where it is, read a chunk at a time. The result is
    kept in the environment, keyed by the file's identity: the launcher reads the file once, and
    the workers it starts (heirs of its environment) do not read it again."""
    import numpy as np  # here, so that rendering k8s/ needs no numpy

    stat = path.stat()
    file = f"{path.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        known = json.loads(os.environ.get(SCANNED_VAR, "{}"))
        if known.get("file") == file:
            return int(known["max"]), int(known["at"])
    except (ValueError, KeyError, TypeError, AttributeError):
        pass  # not ours, or garbled: read the file
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    top, at = -1, 0
    for start in range(0, len(tokens), CHUNK_TOKENS):
        chunk = tokens[start : start + CHUNK_TOKENS]
        index = int(chunk.argmax())
        if int(chunk[index]) > top:
            top, at = int(chunk[index]), start + index
    del tokens
    os.environ[SCANNED_VAR] = json.dumps({"file": file, "max": top, "at": at})
    return top, at


def token_file_problem(data: TokenData) -> str | None:
    """Why data.path is no token file for this config, or None. Checked when the config is, so
    that a bad file is one line before any process starts, not an error at the first batch."""
    make = f"make one with python -m {PACKAGE}.data TEXT OUT"
    if not data.path:
        return "an empty path; give a token file, or null for synthetic tokens"
    path = Path(data.path)
    try:
        size = path.stat().st_size
        if path.is_dir():
            return f"a directory, not a token file; {make}"
        if not path.is_file():  # a FIFO or a device: opening one may wait forever
            return f"not a regular file; {make}"
        with path.open("rb"):
            pass
    except FileNotFoundError:
        return f"no such file here ({Path.cwd()}); {make}"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if size % TOKEN_BYTES:
        return f"holds {size} bytes, an odd count: not a file of 2-byte (uint16) tokens; {make}"
    sequences = file_sequences(data)
    if sequences < 2:
        return (
            f"holds {sequences} sequence(s) of data.seq_len={data.seq_len} tokens "
            f"({size // TOKEN_BYTES} tokens); need at least 2"
        )
    top, at = largest_token(path)
    if top >= data.vocab_size:
        return (
            f"holds token id {top} (token {at} of the file), not below data.vocab_size="
            f"{data.vocab_size}; raise data.vocab_size to {top + 1}, or check that the file "
            f"holds uint16 tokens ({make})"
        )
    return None


def file_sequences(data: TokenData) -> int:
    """How many sequences of seq_len + 1 tokens (consecutive ones share a token) the file holds."""
    tokens = Path(data.path).stat().st_size // TOKEN_BYTES
    return max(0, tokens - 1) // data.seq_len

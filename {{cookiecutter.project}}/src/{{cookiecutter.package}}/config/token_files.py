"""The scan of a token file that data.path names: its largest id, read once per launch.

The config check (config.TokensConfig) runs it before any process starts; the workers the launcher
starts find its result in their environment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TOKEN_BYTES = 2  # a token file holds uint16 ids, as nanoGPT writes them (data.TOKEN_DTYPE)
CHUNK_TOKENS = 2**24  # read 32 MiB of a token file at a time: any size scans in bounded memory
SCANNED_VAR = "DDP_TOKEN_FILE_SCAN"  # a scan's result, for the processes this one starts


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

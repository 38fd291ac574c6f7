"""A file written whole or not at all: the one way this project replaces a file.

The new content goes to a temp file beside the target, `.partial-<random>-<name>` (the same folder,
so the rename cannot cross file systems), which is then renamed over the target: a reader finds the
old file or the new one, never half of either. On any failure, Ctrl-C included, the temp file is
removed and the target left as it was. durable=True also fsyncs the file before the rename and the
folder after it (checkpoints: a power cut keeps the new file or the old one). The standard library
only: the template's hook imports k8s/, which writes with this.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import IO

PARTIAL = ".partial-"  # prefix of a write in progress; one left behind was killed mid-write

Content = bytes | str | Callable[[IO[bytes]], object]


def partial_name(path: Path) -> Path:
    """A fresh temp name beside `path`: two writers of one file never share one."""
    return path.with_name(f"{PARTIAL}{secrets.token_hex(4)}-{path.name}")


def stage(path: Path, content: Content, durable: bool = False, mode: int = 0o666) -> Path:
    """`content` written whole to a new temp file beside `path`, which it returns; on a failure the
    temp file is gone and the exception raised. A str is written as UTF-8; a callable is handed the
    open binary file to write. mode: the new file's, less the umask, as open() makes it."""
    while True:
        partial = partial_name(path)
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as out:
            if callable(content):
                content(out)
            else:
                out.write(content.encode() if isinstance(content, str) else content)
            if durable:
                out.flush()
                os.fsync(out.fileno())
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return partial


def write_atomically(
    path: Path, content: Content, durable: bool = False, mode: int = 0o666
) -> None:
    """`path` replaced by `content` whole, or left as it was (see the module's docstring)."""
    partial = stage(path, content, durable=durable, mode=mode)
    try:
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    if durable:
        sync_directory(path.parent)


def sync_directory(path: Path) -> None:
    """Make a rename in it durable."""
    directory = os.open(path, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)

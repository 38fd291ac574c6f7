"""Where torch.compile's caches live: beside the runs, unless the user chose a place.

/tmp, inductor's default, belongs to the node, so a relaunched or rescheduled pod would compile
from nothing; `<runs>/.compile-cache` is on the runs' own storage, where the next pod and the next
run find it. Inductor's cache keys hold the torch version, the GPU and the graph, so runs share it
safely, and it writes entries atomically, so ranks and nodes may too. Triton's kernels go under
it unless TRITON_CACHE_DIR says otherwise. PyTorch's portable cache (one blob, saved with
torch.compiler.save_cache_artifacts and loaded before the first compile) gave the first step no
sooner from the same storage (docs/performance.md) and would need saving and loading besides.

The user's choice is read once, when the launch's first process starts, before torch is
imported: inductor writes its own default into TORCHINDUCTOR_CACHE_DIR the first time anything
asks it for the directory (importing dynamo does), and a later look at the variable would take
that for the user's. The first process records what it found in CHOICE_VAR; its workers inherit
the record, not torch's default. The standard library only: the launcher reads it first thing.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"  # inductor's FX graphs and AOTAutograd; Triton's beneath
TRITON_VAR = "TRITON_CACHE_DIR"
# The user's TORCHINDUCTOR_CACHE_DIR as the launch found it ("" for none), for its workers.
CHOICE_VAR = "DDP_USERS_COMPILE_CACHE"
FOLDER = ".compile-cache"


def record_users_choice(env: MutableMapping[str, str] = os.environ) -> None:
    """At a command's entry, before torch is imported: whether the user set the cache's place.
    A worker keeps its launcher's record."""
    env.setdefault(CHOICE_VAR, env.get(CACHE_VAR, ""))


def keep_caches_in(run_dir: Path, env: MutableMapping[str, str] = os.environ) -> Path:
    """Point inductor at the compile cache for a run in `run_dir`, before anything compiles, and
    return it: the user's choice, else `<the runs' folder>/.compile-cache`, else, where this
    user cannot write that, `<run dir>/.compile-cache` (the run's own relaunches still find it;
    inductor would fail at the first step instead)."""
    record_users_choice(env)  # a process that was not started by a command that recorded it
    users = env[CHOICE_VAR]
    if users:
        path = Path(users)
    else:
        beside = Path(os.path.abspath(run_dir.parent / FOLDER))
        path = beside if writable(beside) else Path(os.path.abspath(run_dir / FOLDER))
    env[CACHE_VAR] = str(path)  # over the default inductor may have written meanwhile
    return path


def writable(folder: Path) -> bool:
    """Whether this user can write in `folder`, or make it (inductor makes its parents too):
    nothing is made to find out."""
    existing = folder
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    return existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)

"""Where torch.compile's caches live: beside the runs, unless the user chose a place.

/tmp, inductor's default, belongs to the node, so a relaunched or rescheduled pod would compile
from nothing; `<runs>/.compile-cache` is on the runs' own storage, where the next pod and the next
run find it. Inductor's cache keys hold the torch version, the GPU and the graph, so runs share it
safely, and it writes entries atomically, so ranks and nodes may too. Triton's kernels go under
it unless TRITON_CACHE_DIR says otherwise. PyTorch's portable cache (one blob, saved with
torch.compiler.save_cache_artifacts and loaded before the first compile) gave the first step no
sooner from the same storage (docs/performance.md) and would need saving and loading besides.

Inductor writes its own default into TORCHINDUCTOR_CACHE_DIR the first time anything asks it for
the directory (importing dynamo does, as building an optimizer does), and every process started
after that inherits it: the launcher's workers, a bench's, a notebook's. That value is inductor's,
not the user's, wherever it comes from, so it is told apart by what it is. The standard library
only: the launcher's checks import no inductor.
"""

from __future__ import annotations

import getpass
import os
import re
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path

CACHE_VAR = "TORCHINDUCTOR_CACHE_DIR"  # inductor's FX graphs and AOTAutograd; Triton's beneath
FOLDER = ".compile-cache"


def inductors_default() -> str:
    """The directory inductor picks when the variable is unset, as its cache_dir_utils names it:
    /tmp/torchinductor_<user>."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)
    )


def users_choice(env: Mapping[str, str] = os.environ) -> str | None:
    """TORCHINDUCTOR_CACHE_DIR where the user set it; None where it is unset, empty, or the
    default inductor wrote into it itself."""
    value = env.get(CACHE_VAR, "")
    if not value or os.path.abspath(value) == inductors_default():
        return None
    return value


def keep_caches_in(run_dir: Path, env: MutableMapping[str, str] = os.environ) -> Path:
    """Point inductor at the compile cache for a run in `run_dir`, before anything compiles, and
    return it: the user's choice, else `<the runs' folder>/.compile-cache`, else, where this
    user cannot write that, `<run dir>/.compile-cache` (the run's own relaunches still find it;
    inductor would fail at the first step instead)."""
    users = users_choice(env)
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

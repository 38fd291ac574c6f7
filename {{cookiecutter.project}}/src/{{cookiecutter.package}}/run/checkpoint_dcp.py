"""The DCP checkpoint (trainer.checkpoint_format=dcp): PyTorch's distributed checkpoint, a folder
`step_<N>.dcp/` that every rank writes a share of (DDP's replicated tensors are dealt out among the
ranks), that loads on any world size, and that a sharded strategy (FSDP2) reads as it is.

Its tensors (the model's and the optimizer's, keyed by parameter name through
torch.distributed.checkpoint.state_dict, and trainer.ema_decay's averages, keyed as the model's)
are DCP's; the rest (position, RNG, config: small) is rank 0's `extra.pt` beside them. The
Checkpointer decides when and where; this module only moves tensors between the ranks and the
folder.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

# A world of one saves and loads with no_dist=True (no collectives from the writer's thread on the
# default group), which DCP answers with a warning each time that it assumes just that.
warnings.filterwarnings(
    "ignore",
    message="torch.distributed is disabled, unavailable or uninitialized",
    category=UserWarning,
)

SUFFIX = ".dcp"
EXTRA = "extra.pt"  # rank 0's part: everything but the tensors below
TENSORS = ("model", "optimizer", "ema")  # "ema" only where the run keeps one
REQUIRED = ("model", "optimizer")


class ShareFailed(Exception):
    """A rank's share could not be written or read: the lowest failed rank's cause, raised from
    it. (DCP's own CheckpointException is a BaseException, which `except Exception` misses.)"""

    def __init__(self, rank: int, cause: BaseException) -> None:
        super().__init__(str(cause) or type(cause).__name__)
        self.rank, self.cause = rank, cause


@contextmanager
def one_cause() -> Iterator[None]:
    try:
        yield
    except CheckpointException as err:
        rank, wrapped = min(err.failures.items(), key=lambda item: item[0])
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        raise ShareFailed(rank, cause) from cause


def tensors(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, ema: Any = None
) -> dict[str, Any]:
    """The model's and optimizer's state keyed by parameter name, as DCP saves and loads it, and
    the EMA's if there is one (its averages are sharded as the parameters are: DCP writes each
    rank's share). The optimizer's state is made if no step has made it yet (a load needs
    tensors to fill)."""
    model_state, optimizer_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if ema is not None:
        state["ema"] = ema.state_dict()
    return state


def held(path: Path) -> set[str]:
    """The states a folder holds tensors of: model, optimizer, and ema if it was kept."""
    return states_of(dcp.FileSystemReader(path).read_metadata())


def states_of(metadata: Any) -> set[str]:
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


def save(path: Path, state: dict[str, Any], group: dist.ProcessGroup | None, alone: bool) -> None:
    """Every rank: its share of `state` into the folder `path`, each file synced; returns once
    every rank's share is written and rank 0 has written the metadata. A failure on any rank is
    raised on every rank, as ShareFailed. `alone`: a world of one, no collectives."""
    writer = dcp.FileSystemWriter(path, sync_files=True)
    with one_cause():
        dcp.save(state, storage_writer=writer, process_group=group, no_dist=alone)


def verify(path: Path) -> None:
    """Raise unless the folder reads back: its metadata loads, it holds a model and an optimizer,
    and every file the metadata points into is there and long enough (a share lost or cut
    short, as on a run dir that is not one file system for every node)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    states = states_of(metadata)
    if not states >= set(REQUIRED):
        raise ValueError(
            f"not a training checkpoint: it holds {', '.join(sorted(states)) or 'nothing'}"
        )
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size  # FileNotFoundError names a lost share
        if size < end:
            raise ValueError(f"{name} holds {size} bytes of {end}: cut short")


def load(
    path: Path,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ema: Any,
    group: dist.ProcessGroup | None,
    alone: bool,
) -> None:
    """Every rank: the model's and optimizer's state from the folder, whatever world size wrote
    it, and the EMA's averages (in place) when both the run and the folder keep one. Raises
    ShareFailed with the cause if it does not fit."""
    state = tensors(module, optimizer, ema if ema is not None and "ema" in held(path) else None)
    with one_cause():
        reader = dcp.FileSystemReader(path)
        dcp.load(state, storage_reader=reader, process_group=group, no_dist=alone)
    set_state_dict(
        module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def read_all(path: Path) -> dict[str, Any]:
    """One process, no process group: the folder's tensors as saved (`model` a plain state dict
    by parameter name), without a model to load them into: for evaluate and conversions."""
    # torch's own dcp_to_torch_save reads a folder this way
    from torch.distributed.checkpoint.format_utils import (
        _EmptyStateDictLoadPlanner,
        _load_state_dict,
    )

    state: dict[str, Any] = {}
    with one_cause():
        _load_state_dict(
            state,
            storage_reader=dcp.FileSystemReader(path),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
    return state

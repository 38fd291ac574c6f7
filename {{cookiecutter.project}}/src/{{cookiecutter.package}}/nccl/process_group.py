"""The process group of train, evaluate, bench and allreduce: the device each process uses, the
default group on it, the CPU group for control messages, and the end every rank meets at.

The NCCL environment is the caller's to write first: NCCL reads it once, when the first
communicator is made, which is in initialized() (device_id makes it there and then).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from ..core.world import World


def select_device(cuda: bool, world: World) -> torch.device:
    """This process's GPU (by local rank) when it uses CUDA, else the CPU."""
    if not cuda:
        return torch.device("cpu")
    device = torch.device("cuda", world.local_rank)
    torch.cuda.set_device(device)
    return device


@contextmanager
def initialized(
    world: World,
    device: torch.device,
    timeout_s: float | None = None,
    destroy_on_error: bool = True,
) -> Iterator[None]:
    """The default group over the world, NCCL on a GPU and gloo on the CPU, destroyed on the way
    out. timeout_s bounds every collective (None: torch's default). destroy_on_error=False leaves
    the group as it is when an exception ends the block: destroying a communicator that a failed
    collective left behind can hang for good (the doctor's all-reduce, the bench)."""
    # Without torchrun (plain `python -m`) there is no rendezvous: a group of one.
    standalone = {} if world.launched else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    cuda = device.type == "cuda"
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
        device_id=device if cuda else None,  # make the NCCL communicator now
        **standalone,
    )
    try:
        yield
    except BaseException:
        if destroy_on_error:
            dist.destroy_process_group()
        raise
    dist.destroy_process_group()


def control_group(world: World, timeout_s: float) -> dist.ProcessGroup | None:
    """Control messages (stop? which checkpoint? done writing?) go over the CPU, with time for
    rank 0 to write a checkpoint while the others wait (timeout_s)."""
    if world.size == 1:
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def finish_together() -> None:
    """Every rank waits for the others before the group is destroyed: gloo can abort at exit if
    a peer is still tearing down. First the garbage: DDP's reducer and DataLoader workers that
    reference cycles still hold."""
    gc.collect()
    dist.barrier()

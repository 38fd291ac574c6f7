"""process_group.initialized: the one setup of train, evaluate, bench and allreduce."""

import pytest
import torch
import torch.distributed as dist

from ddp_project.core.world import World
from ddp_project.nccl import process_group


class CollectiveFailed(Exception):
    pass


def test_the_group_is_destroyed_on_the_way_out_and_on_an_error_by_default():
    with process_group.initialized(World(), torch.device("cpu")):
        assert dist.get_world_size() == 1  # without torchrun: a group of one
    assert not dist.is_initialized()
    with pytest.raises(CollectiveFailed), process_group.initialized(World(), torch.device("cpu")):
        raise CollectiveFailed
    assert not dist.is_initialized()


def test_a_group_a_failure_left_behind_is_not_destroyed_where_that_could_hang():
    """The doctor's all-reduce and the bench: a failed collective's communicator stays as it is."""
    try:
        with (
            pytest.raises(CollectiveFailed),
            process_group.initialized(World(), torch.device("cpu"), destroy_on_error=False),
        ):
            raise CollectiveFailed
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

"""dist.strategy=fsdp2: each block's parameters sharded over the processes with FSDP2's
fully_shard, and activation checkpointing per block (dist.activation_checkpointing, either
strategy).

A block is a child of the model's outermost nn.Sequential or nn.ModuleList: the GPT's transformer
blocks, the MLP's layers. A block is all-gathered just before its forward (and again before its
backward) and freed after; the root's own parameters (embeddings, final norm, head) form one more
group. fully_shard works in place: parameter names stay those of the bare model, so checkpoints
(through torch.distributed.checkpoint.state_dict) and `evaluate` read them as DDP's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ..config.schema import Precision

CONTAINERS = (nn.Sequential, nn.ModuleList)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The children, with parameters, of the outermost containers on each path from the root."""
    if isinstance(model, CONTAINERS):
        return [child for child in model.children() if next(child.parameters(), None) is not None]
    return [block for child in model.children() for block in blocks(child)]


def checkpoint_activations(model: nn.Module) -> None:
    """Each block keeps only its input for the backward pass and runs its forward again there.
    The block's own forward is wrapped (no wrapper module): its parameters keep their names."""
    for block in blocks(model):
        block.forward = checkpointed(block.forward)


def checkpointed(forward: Any) -> Any:
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return recomputed


def shard(model: nn.Module, device: torch.device, precision: Precision) -> nn.Module:
    """fully_shard on each block, then on the root (its remaining parameters). On a GPU under
    trainer.precision=bf16, the gathered parameters are bf16 and the gradients reduced in fp32."""
    policy = precision_policy(device, precision)
    for block in blocks(model):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def precision_policy(device: torch.device, precision: Precision) -> MixedPrecisionPolicy:
    """As autocast (trainer.autocast_for): bf16 on a GPU only; fp16 is refused with fsdp2."""
    if device.type == "cuda" and precision is Precision.bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """A micro-batch whose gradients add up unreduced (not the step's last): no reduce-scatter."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def drop_gathered(model: nn.Module) -> None:
    """Free every gathered copy of the weights, so that the next forward gathers them from the
    shards again. FSDP2 keeps the root's gathered after a forward (a backward would gather them
    again at once): weights changed in place in their shards meanwhile (the EMA swapped in for a
    validation, and back) would not reach that forward. No-op on a model that is not sharded."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a sharded one (a gradient norm over the shards), as DDP's would be."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

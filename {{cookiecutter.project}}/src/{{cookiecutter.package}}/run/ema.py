"""trainer.ema_decay: an exponential moving average of the weights, in the checkpoint, so that a
resume continues it exactly.

It keeps an fp32 copy of each tensor module.parameters() holds, on its device (a DTensor
shard under a sharded strategy stays one), and moves it toward the weights after every optimizer
step that updated them: ema = decay * ema + (1 - decay) * weights. Its checkpoint state ("ema")
is keyed as the model's ("model"): the averaged parameters, and the model's own buffers, so that
whatever loads a model state (generate, export) loads it as well.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from . import fsdp


class EMA:
    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.module, self.decay = module, decay
        self.parameters = list(module.parameters())
        self.averages = [p.detach().to(torch.float32, copy=True) for p in self.parameters]

    @torch.no_grad()
    def start_from_weights(self) -> None:
        """Start the average over from the weights as they are (a resume that turns EMA on)."""
        for average, parameter in zip(self.averages, self.parameters, strict=True):
            average.copy_(parameter.detach())

    @torch.no_grad()
    def update(self, skipped: torch.Tensor | None = None) -> None:
        """After an optimizer step. `skipped`: a 0-d tensor, nonzero when the step did not update
        the weights (fp16's grad scaler found an inf): the average stays, with no GPU sync."""
        weights = [p.detach().float() for p in self.parameters]  # fp32 ones are themselves
        if skipped is None:
            torch._foreach_lerp_(self.averages, weights, 1.0 - self.decay)
        else:
            torch._foreach_lerp_(self.averages, weights, (skipped == 0) * (1.0 - self.decay))

    def named(self) -> dict[int, int]:
        """Each parameter's place in self.parameters, by id, under every name it has."""
        return {id(p): i for i, p in enumerate(self.parameters)}

    def state_dict(self) -> dict[str, Any]:
        """The model's state_dict with the averages in place of its parameters; a tensor under
        two names (tied weights) is one average under both."""
        places = self.named()
        state = {}
        for name, value in self.module.state_dict(keep_vars=True).items():
            place = places.get(id(value))
            state[name] = self.averages[place] if place is not None else value.detach()
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The averages of a checkpoint's "ema"; KeyError or RuntimeError if it does not fit."""
        places = self.named()
        own = self.module.state_dict(keep_vars=True)
        unexpected = state.keys() - own.keys()
        if unexpected:
            raise KeyError(f"unexpected keys in the EMA state: {sorted(unexpected)[:5]}")
        for name, value in own.items():
            place = places.get(id(value))
            if place is not None:
                self.averages[place].copy_(state[name])

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averages in the model's parameters for the block (validation scores them), the
        weights back after it, bit for bit. fp32 parameters trade places with their averages, a
        tensor at a time (no second copy of the model); others are kept aside meanwhile. Under
        fsdp2 the swaps are in the shards, and the gathered weights are dropped after each, so
        that neither the block nor the next step's forward reads the other's."""
        kept: dict[int, torch.Tensor] = {}
        pairs = list(zip(self.parameters, self.averages, strict=True))
        with torch.no_grad():
            for i, (parameter, average) in enumerate(pairs):
                if parameter.dtype == average.dtype:
                    swap(parameter, average)
                else:
                    kept[i] = parameter.detach().clone()
                    parameter.copy_(average)
        fsdp.drop_gathered(self.module)
        try:
            yield
        finally:
            with torch.no_grad():
                for i, (parameter, average) in enumerate(pairs):
                    if i in kept:
                        parameter.copy_(kept[i])
                    else:
                        swap(parameter, average)
            fsdp.drop_gathered(self.module)


def swap(a: torch.Tensor, b: torch.Tensor) -> None:
    held = a.detach().clone()
    a.copy_(b)
    b.copy_(held)

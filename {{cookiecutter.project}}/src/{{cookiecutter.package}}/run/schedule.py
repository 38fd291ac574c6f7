"""The learning rate of each optimizer step: lr * step / warmup_steps during the warm-up, then, with
p the share of the steps from there to max_steps done: constant lr, linear min_lr + (lr - min_lr)
* (1 - p), or cosine min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2; min_lr at step max_steps.
min_lr null is a tenth of lr, so that an lr given alone brings its floor with it.

A function of the step and the config alone, no state: a resumed run takes the same rate at each
step as a run that was never stopped, so resume stays bit-exact.
"""

from __future__ import annotations

import math

from ..config.schema import Schedule, TrainerConfig


def learning_rate(trainer: TrainerConfig, step: int) -> float:
    """The rate of optimizer step `step`, counted from 1 (the step being taken)."""
    if step <= trainer.warmup_steps:
        return trainer.lr * (step / trainer.warmup_steps)
    decay_steps = max(1, trainer.max_steps - trainer.warmup_steps)
    progress = min(1.0, (step - trainer.warmup_steps) / decay_steps)
    low = floor(trainer)
    span = trainer.lr - low  # added to the floor, so that the last step has it exactly
    if trainer.schedule is Schedule.linear:
        return low + span * (1 - progress)
    if trainer.schedule is Schedule.cosine:
        return low + span * 0.5 * (1 + math.cos(math.pi * progress))
    return trainer.lr


def floor(trainer: TrainerConfig) -> float:
    """trainer.min_lr, or a tenth of trainer.lr when it is null."""
    return trainer.lr / 10 if trainer.min_lr is None else trainer.min_lr

"""The learning rate of each optimizer step: lr * step / warmup_steps during the warm-up, then, with
p the share of the steps from there to max_steps done: constant lr, linear min_lr + (lr - min_lr)
* (1 - p), or cosine min_lr + (lr - min_lr) * (1 + cos(pi p)) / 2; min_lr at step max_steps.

A function of the step and the config alone, no state: a resumed run takes the same rate at each
step as a run that was never stopped, so resume stays bit-exact.
"""

from __future__ import annotations

import math

from .config import Schedule, TrainerConfig


def learning_rate(trainer: TrainerConfig, step: int) -> float:
    """The rate of optimizer step `step`, counted from 1 (the step being taken)."""
    if step <= trainer.warmup_steps:
        return trainer.lr * (step / trainer.warmup_steps)
    decay_steps = max(1, trainer.max_steps - trainer.warmup_steps)
    progress = min(1.0, (step - trainer.warmup_steps) / decay_steps)
    span = trainer.lr - trainer.min_lr  # added to min_lr, so that the last step has it exactly
    if trainer.schedule is Schedule.linear:
        return trainer.min_lr + span * (1 - progress)
    if trainer.schedule is Schedule.cosine:
        return trainer.min_lr + span * 0.5 * (1 + math.cos(math.pi * progress))
    return trainer.lr

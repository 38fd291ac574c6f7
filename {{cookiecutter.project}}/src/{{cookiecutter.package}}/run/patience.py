"""trainer.patience: early stopping on val_loss. Its count goes in the checkpoint ("patience"), so
a resume stops at the validation an uninterrupted run would."""

from __future__ import annotations

import math
from typing import Any


class EarlyStopping:
    """trainer.patience: validations without a new lowest val_loss before the run stops. The
    count is kept whatever the patience (a resume may set one, and counts from where it is)."""

    def __init__(self, patience: int | None) -> None:
        self.patience = patience
        self.best = math.inf
        self.since_best = 0  # validations since the one that set self.best

    def observe(self, val_loss: float) -> None:
        if val_loss < self.best:
            self.best, self.since_best = val_loss, 0
        else:
            self.since_best += 1

    @property
    def due(self) -> bool:
        return self.patience is not None and self.since_best >= self.patience

    def line(self, step: int) -> str:
        return (
            f"early stopping at step {step}: {self.since_best} validations without a val_loss "
            f"below {self.best:.4f} (trainer.patience={self.patience})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "since_best": self.since_best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.since_best = float(state["best"]), int(state["since_best"])

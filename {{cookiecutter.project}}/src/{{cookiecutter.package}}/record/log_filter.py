"""Logging that keeps rank 0 in charge: used by configs/hydra/job_logging/rank_zero.yaml."""

import logging

from ..core.world import World


class RankFilter(logging.Filter):
    """Pass every record on global rank 0; elsewhere only those at `others_min_level` or above.

    `others_min_level: null` silences the other ranks entirely.
    """

    def __init__(self, others_min_level: str | None = "WARNING") -> None:
        super().__init__()
        # Hydra's logging config makes this filter, before any of ours runs: an entry point of
        # its own, it reads torchrun's environment itself.
        self.rank = World.from_env().rank
        # getLevelName maps a level name to its number (getLevelNamesMapping needs 3.11).
        self.others_min_level = logging.getLevelName(others_min_level) if others_min_level else None

    def filter(self, record: logging.LogRecord) -> bool:
        if self.rank == 0:
            return True
        return self.others_min_level is not None and record.levelno >= self.others_min_level

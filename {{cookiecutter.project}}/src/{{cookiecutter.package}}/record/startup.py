"""Where a launch's seconds go before its first step. Each mark ends a phase: the launcher's
(launch.main sets DDP_LAUNCHED_AT, and DDP_TORCHRUN_AT as it starts torchrun), then the
worker's own; the first step's log line lists them, so a slow start names its cause.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from ..core.world import LAUNCHED_AT_VAR, launched_at, process_started_at

TORCHRUN_AT_VAR = "DDP_TORCHRUN_AT"  # when the launcher handed over to torchrun (time.time())
# When the launcher's imports were done (torch's, for torchrun, and Hydra's): what it costs before
# any check of its own.
LAUNCHER_IMPORTED_VAR = "DDP_LAUNCHER_IMPORTED_AT"


class Timeline:
    """Phases of this process's start, each the time from the mark before it."""

    def __init__(self, imported_at: float, env: Mapping[str, str] = os.environ) -> None:
        """`imported_at`: when the worker's imports were done."""
        self.marks: list[tuple[str, float]] = []
        self.start = launched_at(env)
        handed_over = env.get(TORCHRUN_AT_VAR, "")
        if LAUNCHED_AT_VAR in env and handed_over.replace(".", "", 1).isdigit():
            imported = env.get(LAUNCHER_IMPORTED_VAR, "")
            if imported.replace(".", "", 1).isdigit():
                self.mark("launcher imports", float(imported))
            self.mark("launcher", float(handed_over))  # its checks, the config's and the run dir's
            self.mark("torchrun", process_started_at())  # to this worker's start
        self.mark("imports", imported_at)  # the interpreter, torch and Hydra

    def mark(self, phase: str, at: float | None = None) -> None:
        """`phase` ended now (or `at`)."""
        self.marks.append((phase, time.time() if at is None else at))

    def phases(self) -> list[tuple[str, float]]:
        """(phase, seconds), in order."""
        before, spans = self.start, []
        for phase, at in self.marks:
            spans.append((phase, max(0.0, at - before)))
            before = max(before, at)
        return spans

    def line(self) -> str:
        """`start-up 19.1 s: launcher 3.0 s, torchrun 1.2 s, ...`, from the launch to the last
        mark."""
        spans = self.phases()
        total = sum(seconds for _, seconds in spans)
        listed = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in spans)
        return f"start-up {total:.1f} s: {listed}"

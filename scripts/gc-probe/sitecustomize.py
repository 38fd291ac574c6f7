"""Python's garbage collections as they happen, for the GPU scripts (GC_PROBE=1 makes
scripts/gpu-setup.sh put this folder on PYTHONPATH, so every Python process of a launch loads it,
in place of any other sitecustomize): one stderr line per full (generation 2) collection and per
collection of 10 ms or more, in the run's log between the loop's own lines, so a slow step window
can be matched to what the collector did inside it."""

import gc
import os
import sys
import time

_started = [0.0]


def _report(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    took_ms = (time.perf_counter() - _started[0]) * 1e3
    if info["generation"] == 2 or took_ms >= 10:
        print(
            f"gc-probe: generation {info['generation']} took {took_ms:.1f} ms, collected "
            f"{info['collected']}, pid {os.getpid()}, frozen {gc.get_freeze_count()}",
            file=sys.stderr,
            flush=True,
        )


gc.callbacks.append(_report)

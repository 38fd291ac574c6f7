"""The start-up line: where a launch's seconds went before its first step."""

import re
import subprocess
import sys

from conftest import PACKAGE

from ddp_project.core.world import LAUNCHED_AT_VAR
from ddp_project.record.startup import (
    LAUNCHER_IMPORTED_VAR,
    TORCHRUN_AT_VAR,
    Timeline,
)


def test_each_phase_is_the_time_from_the_mark_before_it():
    env = {LAUNCHED_AT_VAR: "100.0", LAUNCHER_IMPORTED_VAR: "102.0", TORCHRUN_AT_VAR: "103.0"}
    timeline = Timeline(imported_at=108.0, env=env)
    timeline.marks[2] = ("torchrun", 104.0)  # this process's start, from /proc: fixed here
    timeline.mark("config", at=109.5)
    timeline.mark("model", at=112.0)
    assert timeline.phases() == [
        ("launcher imports", 2.0),
        ("launcher", 1.0),
        ("torchrun", 1.0),
        ("imports", 4.0),
        ("config", 1.5),
        ("model", 2.5),
    ]
    assert timeline.line() == (
        "start-up 12.0 s: launcher imports 2.0 s, launcher 1.0 s, torchrun 1.0 s, imports 4.0 s, "
        "config 1.5 s, model 2.5 s"
    )


def test_without_the_launcher_the_line_starts_at_this_process():
    """python -m or torchrun alone: no launcher's marks; a bad one is no phase either."""
    timeline = Timeline(imported_at=0.0, env={TORCHRUN_AT_VAR: "1.0"})
    assert [phase for phase, _ in timeline.phases()] == ["imports"]
    odd = Timeline(imported_at=0.0, env={LAUNCHED_AT_VAR: "5.0", TORCHRUN_AT_VAR: "soon"})
    assert [phase for phase, _ in odd.phases()] == ["imports"]


def test_a_clock_that_steps_back_gives_no_negative_phase():
    timeline = Timeline(imported_at=50.0, env={LAUNCHED_AT_VAR: "40.0"})
    timeline.mark("config", at=45.0)  # before the mark ahead of it: time.time() was set back
    timeline.mark("model", at=52.0)
    assert timeline.phases() == [("imports", 10.0), ("config", 0.0), ("model", 2.0)]


def test_the_launchers_run_logs_where_its_start_up_went(tmp_path):
    """What a user runs: every phase named, in order, once."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            f"{PACKAGE}.launch",
            "train",
            "--nproc-per-node",
            "1",
            "trainer.max_steps=1",
            "hydra.run.dir=run",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [
        line for line in done.stdout.splitlines() if "start-up " in line and ": launcher" in line
    ]
    phases = [p.rsplit(" ", 2)[0] for p in line.split(" s: ", 1)[1].split(", ")]
    assert phases == [
        "launcher imports",
        "launcher",
        "torchrun",
        "imports",
        "config",
        "environment",
        "process group",
        "data",
        "model",
        "optimizer and held-out data",
        "resume",
        "the loop's set-up",
    ]
    # The goodput line says when the first step was done: after the start-up, from the launch.
    start_up = float(re.search(r"start-up ([\d.]+) s:", line)[1])
    done_at = re.search(
        r"goodput .*; the first step done ([\d.]+) s after launch$", done.stdout, re.M
    )
    assert done_at and float(done_at[1]) >= start_up, done.stdout[-3000:]

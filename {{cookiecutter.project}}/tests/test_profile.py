"""profile=: a trace of a window of steps, memory snapshots on CUDA, nothing at all when off."""

import json
import logging
import re
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from ddp_project.config.error import ConfigError
from ddp_project.config.validate import check_composed, from_saved
from ddp_project.core.world import World
from ddp_project.run import profiling
from ddp_project.run.profiling import StepProfiler

PACKAGE = "ddp_project"
SMOKE = ["experiment=smoke", "trainer.val_every=0", "trainer.log_every=100"]


def train(tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", *SMOKE, *overrides],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )


def steps_in(trace):
    events = json.loads(trace.read_text())["traceEvents"]
    names = {event.get("name", "") for event in events}
    return sorted(int(name.split("#")[1]) for name in names if name.startswith("ProfilerStep#"))


def test_a_trace_holds_the_windows_steps_and_the_log_says_where(tmp_path):
    # The window's last step is the run's: the loop's end writes the trace.
    done = train(tmp_path, "profile=trace", "trainer.max_steps=12", "hydra.run.dir=run")
    assert done.returncode == 0, done.stderr
    trace = tmp_path / "run" / "profile" / "rank0_steps10-12.pt.trace.json"
    assert steps_in(trace) == [10, 11, 12]  # Chrome trace JSON, labelled with the run's steps
    assert f"profile: wrote {trace}" in done.stdout
    assert [p.name for p in trace.parent.iterdir()] == [trace.name]  # no temp file left


def test_profile_none_adds_nothing(tmp_path):
    done = train(tmp_path, "trainer.max_steps=12", "hydra.run.dir=run")
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "run" / "profile").exists()
    assert "profile:" not in done.stdout + done.stderr  # no line of run/profiling.py


def profile_config(compose_train, *overrides):
    return check_composed(compose_train(*overrides), World()).profile


def test_off_is_no_profiler_and_memory_on_a_cpu_says_it_does_not_apply(
    compose_train, tmp_path, caplog
):
    cpu = torch.device("cpu")
    assert profiling.for_rank(profile_config(compose_train), 0, cpu, tmp_path) is None
    with caplog.at_level(logging.INFO):
        memory = profile_config(compose_train, "profile=memory")
        assert profiling.for_rank(memory, 0, cpu, tmp_path) is None
    (line,) = caplog.messages
    assert line.endswith("CUDA's only; this run is on CPU, none is written")
    assert list(tmp_path.iterdir()) == []


def run_window(profiler, steps):
    """The trainer's calls: tick before each step's work, finish when the loop ends."""
    for step in steps:
        profiler.tick(step)
        torch.ones(8).sum()
    profiler.finish()


def test_a_run_that_ends_inside_the_window_keeps_what_it_traced(compose_train, tmp_path):
    config = profile_config(compose_train, "profile=trace")
    run_window(StepProfiler(config, 0, torch.device("cpu"), tmp_path), range(1, 12))
    assert steps_in(tmp_path / "rank0_steps10-12.pt.trace.json") == [10, 11]


def test_a_launch_that_resumes_inside_the_window_profiles_nothing_and_says_so(
    compose_train, tmp_path, caplog
):
    config = profile_config(compose_train, "profile=trace")
    with caplog.at_level(logging.INFO):
        run_window(StepProfiler(config, 0, torch.device("cpu"), tmp_path), range(10, 15))
    assert "this launch starts at step 10, inside the window" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_trace_that_cannot_be_written_is_a_warning_and_training_goes_on(
    compose_train, tmp_path, caplog
):
    (tmp_path / "profile").write_text("a file where the folder goes")
    config = profile_config(compose_train, "profile=trace")
    run_window(StepProfiler(config, 0, torch.device("cpu"), tmp_path / "profile"), range(1, 15))
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("profile: could not write") and "training goes on" in warning


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("profile.start_step=1", "profile.start_step=1: must be at least 2"),
        ("profile.active_steps=0", "profile.active_steps=0: must be 1 to 1000"),
        ("profile.active_steps=1001", "profile.active_steps=1001: must be 1 to 1000"),
        ("profile.ranks=[]", r"profile.ranks=\[\]: must be null \(every rank\) or a list"),
        ("profile.ranks=[-1]", r"profile.ranks=\[-1\]: must be null"),
        ("profile.history_entries=0", "profile.history_entries=0: must be 1 to 10000000"),
        ("profile.ranks=[1]", r"profile.ranks=\[1\]: rank\(s\) \[1\] are not in this launch"),
    ],
)
def test_a_bad_profile_value_is_refused_in_one_line_naming_the_key(
    compose_train, override, message
):
    with pytest.raises(ConfigError, match=f"^{message}"):
        check_composed(compose_train("profile=trace", override), World())


def test_a_rank_beyond_the_launch_is_fine_while_profiling_is_off(compose_train):
    assert check_composed(compose_train("profile.ranks=[5]"), World()).profile.ranks == [5]


def test_a_checkpoint_from_before_the_profile_group_reads_as_profile_none(compose_train):
    config = check_composed(compose_train(), World())
    saved = OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True)
    del saved["profile"]
    assert not from_saved(saved, [], World(), held_out=True).profile.on


def test_the_out_of_memory_line_names_the_snapshot_or_how_to_get_one(
    compose_train, tmp_path, monkeypatch
):
    config = check_composed(compose_train("data.batch_size=64"), World())
    err = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
        "of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78 GiB in use."
    )
    line = profiling.out_of_memory_line(err, 1, config)
    assert line == (
        "rank 1: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.19 GiB of which 1.02 GiB is free; profile=memory records a memory snapshot of the "
        "next one; try data.batch_size=32"
    )
    snapshot = tmp_path / "rank1_oom.memory.pickle"
    monkeypatch.setattr(StepProfiler, "oom_written", snapshot)
    line = profiling.out_of_memory_line(err, 1, config)
    assert re.search(f"; memory snapshot: {snapshot} \\(drag it into .*memory_viz\\);", line)

"""Lose nothing: checkpoints, resume (bit for bit), SIGTERM from Kubernetes, a rank SIGKILLed."""

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    PACKAGE,
    RUN_NAME,
    launch_command,
    shared_folder,
    torchrun,
    train_command,
    worker_pid,
    worker_pids,
)
from tolerance import max_abs_diff, reordered

from ddp_project.run import checkpoint


def final_model(run_dir, step):
    return torch.load(run_dir / "checkpoints" / f"step_{step:09d}.pt")["model"]


def static_rendezvous_command(*overrides: str, nproc: int) -> list[str]:
    """torchrun without --standalone: a static rendezvous on a free port, the run id "none"."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--master-port",
        str(port),
        "-m",
        f"{PACKAGE}.train",
        *overrides,
    ]


@pytest.fixture(scope="module")
def kept(request) -> Path:
    """A 2-process run of 80 steps, a checkpoint every 10, the newest 3 kept: tests copy it. 64
    steps make an epoch here: its step 80 is in epoch 1, its step 60 before the edge. Launched
    with a static rendezvous and no hydra.run.dir: its run dir is the one under outputs/."""
    folder = shared_folder(request)
    command = static_rendezvous_command(
        "trainer.max_steps=80", "trainer.checkpoint_every=10", "trainer.keep_checkpoints=3", nproc=2
    )
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (folder / "outputs").iterdir()
    return run


def test_checkpoints_hold_what_a_resume_needs_and_only_the_newest_are_kept(kept):
    paths = checkpoint.checkpoint_paths(kept)
    assert [p.name for p in paths] == [f"step_{step:09d}.pt" for step in (60, 70, 80)]
    assert not list((kept / "checkpoints").glob(".partial-*"))
    state = torch.load(paths[-1])  # plain torch.load, safe (weights_only) by default
    assert state["step"] == 80
    assert state["data"] == {"step": 80, "epoch": 1, "samples_in_epoch": 16 * 256}
    assert state["global_batch"] == {"processes": 2, "batch_size": 128, "accumulation": 1}
    assert {"model", "optimizer", "scaler", "rng", "config"} <= state.keys()
    assert len(state["rng"]) == 2 and not any(k.startswith("module.") for k in state["model"])
    assert state["config"]["trainer"]["max_steps"] == 80


def test_separate_static_rendezvous_launches_get_separate_run_dirs(kept):
    """torchrun without --standalone names every run "none"; each launch still gets its own dir:
    kept's launch and this one, from the same directory."""
    command = static_rendezvous_command("trainer.max_steps=3", nproc=1)
    done = subprocess.run(command, cwd=kept.parents[1], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(p.name for p in (kept.parents[1] / "outputs").iterdir())
    assert len(runs) == 2 and all(RUN_NAME.fullmatch(name) for name in runs), runs


@pytest.mark.slow
def test_a_corrupt_newest_checkpoint_is_skipped_and_another_world_size_keeps_the_global_batch(
    kept, tmp_path
):
    """kept's newest checkpoint truncated, as by a node dying mid-write: the one before it
    (step 70, epoch 1, 6 steps in) is resumed by 1 process where 2 wrote it. It accumulates 2
    micro-batches per step and takes the same samples, so its step 80 is kept's uninterrupted
    one, but for the order of the sums."""
    shutil.copytree(kept, tmp_path / "run")
    newest = tmp_path / "run" / "checkpoints" / "step_000000080.pt"
    uninterrupted = torch.load(newest)["model"]
    newest.write_bytes(newest.read_bytes()[:1000])
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", "trainer.max_steps=80", "hydra.run.dir=run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipping unreadable checkpoint step_000000080.pt" in done.stdout + done.stderr
    assert (
        "the checkpoint was written by 2 process(es), this run has 1: trainer.grad_accumulation "
        "1 -> 2 keeps its global batch of 256 samples" in done.stdout
    )
    assert "resumed from the checkpoint of step 70 (epoch 1, sample 1536 of it)" in done.stdout
    resumed = torch.load(newest)
    assert resumed["global_batch"] == {"processes": 1, "batch_size": 128, "accumulation": 2}
    assert resumed["config"]["trainer"]["grad_accumulation"] == 1  # the config as given
    assert max_abs_diff(resumed["model"], uninterrupted) <= reordered(terms=256, steps=10)


def test_a_world_size_that_cannot_keep_the_global_batch_is_refused_before_any_step(kept, tmp_path):
    """3 processes cannot make kept's 256 samples per step from data.batch_size 128: the
    workers' first line says so (the launcher reads no checkpoint), naming the figures and the
    world sizes that can, and the run dir stays as it was."""
    shutil.copytree(kept, tmp_path / "run")
    done = subprocess.run(
        launch_command("--nproc-per-node", "3", "hydra.run.dir=run", "dist.backend=gloo"),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        "config error: hydra.run.dir=run resumes from step_000000080.pt: the checkpoint's global "
        "batch is 256 samples (2 process(es) × data.batch_size 128 × trainer.grad_accumulation "
        "1); 3 process(es) cannot make 256 from data.batch_size 128: resume on 1, 2 process(es) "
        "to keep it, or add trainer.accept_changes=[data.batch_size] to train on with another "
        "global batch, or choose another hydra.run.dir"
    ]
    files = {p.relative_to(kept): p.read_bytes() for p in kept.rglob("*") if p.is_file()}
    run = tmp_path / "run"
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == files


def test_batch_figures_that_keep_the_global_batch_are_no_change_of_results(kept):
    """On 4 processes data.batch_size=64 makes kept's 256: the resume check lets it through;
    on 2 it would halve the global batch: a change of results, refused unless accepted."""
    from ddp_project.config.compose import compose_and_check
    from ddp_project.core.world import World
    from ddp_project.run import rundir

    four, two = World(size=4), World(size=2)
    resumed = compose_and_check(["data.batch_size=64"], world=four)
    assert rundir.resume_problem(kept, resumed, four) is None
    resumed = compose_and_check(["data.batch_size=64"], world=two)
    refused = rundir.resume_problem(kept, resumed, two)
    assert "written with another config: data.batch_size 128 -> 64" in refused
    accepted = compose_and_check(
        ["data.batch_size=64", "trainer.accept_changes=[data.batch_size]"], world=two
    )
    assert rundir.resume_problem(kept, accepted, two) is None


# Installed as sitecustomize in the workers: each rank's exit code (os._exit: the ways a stop ends)
# lands in STOP_RECORDS/exit<rank>, and the CPU seconds it had used then in cpu<rank>. With
# SLOW_RANK_1_INIT, rank 1 sleeps before init_process_group while rank 0 waits for it there, in C;
# with SLOW_RANK_1_RESUME, after loading the checkpoint, while rank 0 waits in the exchange before
# the first step; with SLOW_FIRST_STEP, every rank's first step takes 60 s, as torch.compile's may.
# Each marks waiting<rank> on the way. With FAIL_SECOND_WRITE, rank 0's second checkpoint write
# fails as on a full disk; with SLOW_SAVE_S, every torch.save takes that many seconds more; with
# HOLD_WRITES_UNTIL_STOP, each waits until a stop's save has begun (saving marks the first). With
# PAUSE_RANK_1_AFTER_STEP, rank 1 marks paused1 once that step's checkpoint is written and sleeps.
STOP_HOOK = """
import errno, os, pathlib, time
if "RANK" in os.environ:
    _records = pathlib.Path(os.environ["STOP_RECORDS"])
    _exit, _trainer = os._exit, os.getpid()

    def _recording_exit(code):
        if os.getpid() == _trainer:  # not a DataLoader worker, forked from it
            used = os.times()
            (_records / f"cpu{os.environ['RANK']}").write_text(str(used.user + used.system))
            (_records / f"exit{os.environ['RANK']}").write_text(str(code))
        _exit(code)

    os._exit = _recording_exit
    if os.environ.get("SLOW_RANK_1_INIT"):
        import torch.distributed as dist
        _init = dist.init_process_group

        def _slow_init(*args, **kwargs):
            (_records / f"waiting{os.environ['RANK']}").touch()
            if os.environ["RANK"] == "1":
                time.sleep(60)
            return _init(*args, **kwargs)

        dist.init_process_group = _slow_init
    if os.environ.get("SLOW_RANK_1_RESUME"):
        from PACKAGE.run.trainer import Trainer
        _resume = Trainer.resume

        def _slow_resume(self):
            _resume(self)
            (_records / f"waiting{os.environ['RANK']}").touch()
            if os.environ["RANK"] == "1":
                time.sleep(60)

        Trainer.resume = _slow_resume
    if os.environ.get("FAIL_SECOND_WRITE"):
        from PACKAGE.run import checkpoint
        _write, _calls = checkpoint.write_atomically, []

        def _write_until_full(state, path):
            _calls.append(path)
            if len(_calls) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return _write(state, path)

        checkpoint.write_atomically = _write_until_full
    if os.environ.get("SLOW_SAVE_S"):
        import torch
        _save = torch.save

        def _slow_save(*args, **kwargs):
            (_records / "saving").touch()
            time.sleep(float(os.environ["SLOW_SAVE_S"]))
            return _save(*args, **kwargs)

        torch.save = _slow_save
    if os.environ.get("HOLD_WRITES_UNTIL_STOP"):
        import io
        import threading

        import torch
        from PACKAGE.run.checkpoint import Checkpointer
        _save, _stop_save_began, _held = torch.save, threading.Event(), []
        _checkpoint_save = Checkpointer.save

        def _held_save(obj, f, *args, **kwargs):
            # Files only: torch's object collectives (broadcast_object_list) torch.save to memory.
            # The first write only (a DCP share is a torch.save per tensor).
            if not isinstance(f, io.BytesIO) and not _held:
                _held.append(True)
                (_records / "saving").touch()
                _stop_save_began.wait(timeout=60)  # so a stop comes while this write is in flight
                time.sleep(1)
            return _save(obj, f, *args, **kwargs)

        def _stop_save(self, step, **kwargs):
            if kwargs.get("force"):
                _stop_save_began.set()
            return _checkpoint_save(self, step, **kwargs)

        torch.save, Checkpointer.save = _held_save, _stop_save
    if os.environ.get("PAUSE_RANK_1_AFTER_STEP") and os.environ["RANK"] == "1":
        from PACKAGE.run.checkpoint import Checkpointer
        _checkpoint_save = Checkpointer.save

        def _pausing_save(self, step, **kwargs):
            _checkpoint_save(self, step, **kwargs)
            if step == int(os.environ["PAUSE_RANK_1_AFTER_STEP"]):
                (_records / "paused1").touch()
                time.sleep(60)

        Checkpointer.save = _pausing_save
    if os.environ.get("SLOW_FIRST_STEP"):
        from PACKAGE.run.trainer import Trainer
        _step, _stepped = Trainer.step, []

        def _compiling_step(self, *args, **kwargs):
            if not _stepped:
                _stepped.append(True)
                (_records / f"waiting{os.environ['RANK']}").touch()
                time.sleep(60)
            return _step(self, *args, **kwargs)

        Trainer.step = _compiling_step
""".replace("PACKAGE", PACKAGE)
STEP_LINE = re.compile(r"step (\d+)/\d+ ")


@pytest.fixture
def stop_hook(tmp_path) -> tuple[dict, Path]:
    hook, records = tmp_path / "hook", tmp_path / "records"
    hook.mkdir()
    records.mkdir()
    (hook / "sitecustomize.py").write_text(STOP_HOOK)
    env = {"PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}", "STOP_RECORDS": str(records)}
    return env, records


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has used (all its threads), as os.times() tells the process itself."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class Stop:
    """What a stop cost each rank of a launch, from the moment of the signal: CPU seconds (its
    own clock, which a loaded machine does not stretch; training on for seconds, as the old pace
    did after a resume, does), and seconds of wall time, bounded at 25 (a stop that waits on
    something; the figure, around a second, is reported). A rank that did not end on its own
    within torchrun's 30 s grace is SIGKILLed and leaves no exit record."""

    def __init__(self, launcher: subprocess.Popen, records: Path) -> None:
        self.records = records
        self.cpu_at_signal = {
            rank: cpu_seconds(pid) for rank, pid in worker_pids(launcher.pid).items()
        }
        self.signalled = time.monotonic()

    def cpu_after(self) -> dict[int, float]:
        return {
            rank: float((self.records / f"cpu{rank}").read_text()) - before
            for rank, before in self.cpu_at_signal.items()
        }

    def check(self, figure, code: int, output: str, wall_s: float) -> None:
        assert sorted(self.cpu_at_signal) == [0, 1], output[-3000:]
        assert [(self.records / f"exit{rank}").read_text() for rank in (0, 1)] == [str(code)] * 2
        cpu = self.cpu_after()
        figure(
            f"{wall_s:.1f} s from the signal to the end; CPU after it, per rank: "
            + ", ".join(f"{seconds:.2f} s" for _, seconds in sorted(cpu.items()))
        )
        assert max(cpu.values()) < 3, (cpu, output[-3000:])
        assert wall_s < 25, output[-3000:]


def signal_at_a_step_line(tmp_path, env, signum, after: str, *overrides) -> tuple[str, float, Stop]:
    """Train in run/ until the first step line after a line holding `after`, send `signum` to
    the launch's process group (as Ctrl-C does; torchrun forwards it too), and wait for the end.
    Returns the output, the seconds from the signal to its last line, and the stop's costs."""
    command = train_command(
        "hydra.run.dir=run",
        "trainer.log_every=5",
        "trainer.max_steps=100000000",
        "trainer.checkpoint_every=100000",
        *overrides,
    )
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines, seen, stop = [], False, None
    try:
        for line in process.stdout:
            lines.append(line)
            last = time.monotonic()
            seen = seen or after in line
            if stop is None and seen and STEP_LINE.search(line):
                stop = Stop(process, env_records(env))
                os.killpg(process.pid, signum)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(lines)
    assert stop is not None, output[-3000:]
    return output, last - stop.signalled, stop


def env_records(env: dict) -> Path:
    return Path(env["STOP_RECORDS"])


def assert_stopped(output: str, seconds: float, stop: Stop, figure, name: str, code: int) -> int:
    """Every rank stopped with `code` on its own, spending little CPU after the signal, after
    one line; the step it names."""
    stop.check(figure, code, output, seconds)
    stopped = re.findall(rf"{name}: stopped at step (\d+) with a checkpoint", output)
    assert len(stopped) == 1, output[-3000:]
    assert "KeyboardInterrupt" not in output and output.count("Traceback") <= 1  # torchrun's
    assert "A collective failed" not in output and "failed too" not in output
    return int(stopped[0])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stop_signal_stops_every_rank_at_one_step_after_0_1_and_2_resumes(
    tmp_path, stop_hook, figure
):
    """SIGTERM (Kubernetes; torchrun forwards it) on a fresh run, after a resume, and Ctrl-C
    after a second one: each at once (under 3 CPU-seconds after the signal), one line, a
    checkpoint at the step named there, every rank exiting 128 + the signal. The old pace counted
    the steps a checkpoint brought in as just run: after a resume the stop came 5 to 30 s of
    training late, or torchrun's SIGKILL came first. DataLoader workers, in the process group
    too, ignore both signals."""
    env, records = stop_hook
    run = tmp_path / "run"
    stops = []
    for resumes, (signum, overrides) in enumerate(
        [
            (signal.SIGTERM, ["data.num_workers=2"]),
            (signal.SIGTERM, []),
            (signal.SIGINT, ["data.num_workers=2"]),
        ]
    ):
        for record in records.iterdir():
            record.unlink()
        after = f"resumed from the checkpoint of step {stops[-1]} " if stops else ""
        output, seconds, stop = signal_at_a_step_line(tmp_path, env, signum, after, *overrides)
        stops.append(assert_stopped(output, seconds, stop, figure, signum.name, 128 + signum))
        assert checkpoint.newest_readable(run)[1]["step"] == stops[-1], (resumes, output[-3000:])
    assert [p.name for p in checkpoint.checkpoint_paths(run)] == [f"step_{s:09d}.pt" for s in stops]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("slow", ["SLOW_RANK_1_INIT", "SLOW_RANK_1_RESUME", "SLOW_FIRST_STEP"])
def test_a_stop_signal_before_the_first_step_ends_every_rank_at_once(
    tmp_path, stop_hook, slow, figure
):
    """SIGTERM while rank 0 waits for rank 1 in C (Python runs no handler there): in
    init_process_group, or in the exchange before the first step, which fails as rank 1 ends;
    or while every rank runs its first step, as long as a compile of the model takes.
    Nothing to save: every rank ends at once (on its own, the 60 s waits cut short, under 3
    CPU-seconds after the signal) with 143, one line, and no remedy block."""
    env, records = stop_hook
    command = train_command("hydra.run.dir=run")
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**os.environ, **env, slow: "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ((records / "waiting0").exists() and (records / "waiting1").exists()):
            assert process.poll() is None and time.monotonic() < deadline, "never got there"
            time.sleep(0.1)
        time.sleep(0.5)  # rank 0 waiting
        stop = Stop(process, records)
        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    stop.check(figure, 143, output, time.monotonic() - stop.signalled)
    line = (
        "SIGTERM: stopped before the first step, nothing new to save; "
        f"to go on, relaunch with hydra.run.dir={tmp_path / 'run'}"
    )
    assert output.count("SIGTERM: stopped") == 1 and line in output, output[-3000:]
    assert output.count("Traceback") <= 1 and "A collective failed" not in output  # torchrun's


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slow_checkpoint_write_is_waited_for_and_a_full_disk_is_rank_0s_one_line(
    tmp_path, stop_hook
):
    """Rank 0 writes step 10's checkpoint for 14 s under dist.timeout_s=8 (not less: it bounds
    gloo's connection setup too, which a loaded machine can stretch past 3 s): the others wait on
    the CPU group, with no collective pending and the stall watchdog paused, and training goes on to
    step 20, whose write fails as on a full disk: rank 0 says so in one line, exits 5, and no rank
    blames a collective."""
    env, _ = stop_hook
    done = torchrun(
        tmp_path,
        "trainer.max_steps=30",
        "trainer.checkpoint_every=10",
        "dist.timeout_s=8",
        "hydra.run.dir=run",
        env={**env, "FAIL_SECOND_WRITE": "1", "SLOW_SAVE_S": "14"},
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("checkpoint error:")]
    assert len(errors) == 1, output[-3000:]
    assert "rank 0 could not write" in errors[0] and "step_000000020.pt" in errors[0]
    assert "No space left on device" in errors[0] and "free space there" in errors[0]
    assert "A collective failed" not in output and "failed too" not in output
    assert "exitcode  : 5" in output  # rank 0's: a checkpoint could not be written
    assert [p.name for p in checkpoint.checkpoint_paths(tmp_path / "run")] == ["step_000000010.pt"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".partial-*"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", ["file", "dcp"])
def test_a_stop_signal_during_a_background_write_loses_nothing(tmp_path, stop_hook, form):
    """SIGTERM while rank 0 writes step 200's checkpoint in the background (held until the
    stop's save begins, then 1 s more), training going on meanwhile: the write in flight ends,
    then the stop's checkpoint is written, both read back, nothing partial is left; in either
    format (a DCP folder: each rank's share held so). (Writes
    slower than the steps between checkpoints make each save wait for the last, and a stop then
    waits for two writes and the steps to its step: a test of that raced torchrun's 30 s grace on
    a loaded machine.)"""
    env, records = stop_hook
    command = train_command(
        "hydra.run.dir=run",
        "trainer.log_every=1",
        "trainer.max_steps=100000000",
        "trainer.checkpoint_every=200",
        "trainer.val_every=0",  # no best.pt write
        f"trainer.checkpoint_format={form}",
    )
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**os.environ, **env, "HOLD_WRITES_UNTIL_STOP": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines, steps_during_write = [], 0
    try:
        for line in process.stdout:
            lines.append(line)
            if (records / "saving").exists() and STEP_LINE.search(line):
                steps_during_write += 1
                if steps_during_write == 3:  # training goes on while step 200 is written
                    os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(lines)
    stopped = re.findall(r"SIGTERM: stopped at step (\d+) with a checkpoint", output)
    assert len(stopped) == 1, output[-3000:]
    step = int(stopped[0])
    assert 200 < step < 400, output[-3000:]
    suffix = {"file": "pt", "dcp": "dcp"}[form]
    assert f"for the write of checkpoints/step_000000200.{suffix} to finish" in output
    run = tmp_path / "run"
    paths = checkpoint.checkpoint_paths(run)
    assert [p.name for p in paths] == [f"step_000000200.{suffix}", f"step_{step:09d}.{suffix}"], (
        output[-3000:]
    )
    assert [checkpoint.read(p)["step"] for p in paths] == [200, step]
    assert not list((run / "checkpoints").glob(".partial-*"))
    assert "Traceback" not in output.split("SIGTERM: stopped")[0][-2000:]


def test_a_refused_resume_leaves_the_runs_config_as_it_was(kept, tmp_path, monkeypatch, capsys):
    """The guard lets the change through (accept_changes), the checkpoint does not fit: exit 2.
    train's main in this process, as `python -m` runs it: one process, no torchrun."""
    from ddp_project import train
    from ddp_project.run import rundir

    shutil.copytree(kept, tmp_path / "run")
    before = (tmp_path / "run" / "config.yaml").read_text()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "train",
            "model.hidden_dim=64",
            "hydra.run.dir=run",
            "trainer.accept_changes=[model.hidden_dim]",
        ],
    )
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with pytest.raises(SystemExit) as ended:
            train.register_configs()  # as train's __main__ does
            train.main()
    finally:  # Hydra's job logging and the run dir's lock: this process goes on
        for handler in set(root.handlers) - set(handlers):
            handler.close()
        root.handlers[:], root.level = handlers, level
        rundir.release(tmp_path / "run")
    err = capsys.readouterr().err
    assert ended.value.code == 2, err[-3000:]
    assert "config error: step_000000080.pt does not fit this run's model" in err
    assert (tmp_path / "run" / "config.yaml").read_text() == before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_sigkilled_ends_the_launcher_promptly_and_resumes_match_an_uninterrupted_run(
    kept, tmp_path, stop_hook, figure
):
    """kept's run resumed from step 60 (mid epoch 0), rank 1 SIGKILLed once step 70's checkpoint
    (epoch 1) is written: the launcher ends promptly. A relaunch resumes from step 70 and ends
    at step 80 with kept's weights: two resumes, across an epoch edge, lose nothing."""
    env, records = stop_hook
    run_dir = tmp_path / "run"
    shutil.copytree(kept, run_dir)
    for later in checkpoint.checkpoint_paths(run_dir)[1:]:
        later.unlink()
    command = train_command(
        "hydra.run.dir=run",
        "trainer.log_every=5",
        "trainer.max_steps=80",
        "trainer.checkpoint_every=10",
    )
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env={**os.environ, **env, "PAUSE_RANK_1_AFTER_STEP": "70"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not (records / "paused1").exists():
        assert process.poll() is None and time.monotonic() < deadline, "step 70 never written"
        time.sleep(0.2)
    victim = worker_pid(process.pid, rank=1)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    output, _ = process.communicate(timeout=240)
    seconds = time.monotonic() - killed_at
    figure(f"{seconds:.1f} s from rank 1's SIGKILL to the launcher's end")
    assert process.returncode != 0
    assert seconds < 150, output[-3000:]  # not dist.timeout_s's 180 s for rank 0 to give up
    assert "resumed from the checkpoint of step 60 (epoch 0, sample 15360 of it)" in output
    newest = checkpoint.newest_readable(run_dir)[1]["step"]
    assert newest == 70, output[-3000:]
    resumed = torchrun(tmp_path, "trainer.max_steps=80", "hydra.run.dir=run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        f"resumed from the checkpoint of step {newest} (epoch 1, sample 1536 of it)"
        in resumed.stdout
    )
    assert max_abs_diff(final_model(kept, 80), final_model(run_dir, 80)) <= 1e-6

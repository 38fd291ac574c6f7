"""Lose nothing: checkpoints, resume (bit for bit), SIGTERM from Kubernetes, a rank SIGKILLed."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    PACKAGE,
    RUN_NAME,
    shared_folder,
    torchrun,
    train_command,
    worker_pid,
)

from {{ cookiecutter.package }} import checkpoint


def final_model(run_dir, step):
    return torch.load(run_dir / "checkpoints" / f"step_{step:09d}.pt")["model"]


def max_abs_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def kept(request) -> Path:
    """A 2-process run of 50 steps, a checkpoint every 10, the newest 2 kept: tests copy it."""
    tmp_path = shared_folder(request)
    done = torchrun(tmp_path, "trainer.max_steps=50", "trainer.checkpoint_every=10", "trainer.keep_checkpoints=2",
                    "hydra.run.dir=run")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "run"


def test_checkpoints_hold_what_a_resume_needs_and_only_the_newest_are_kept(kept):
    paths = checkpoint.checkpoint_paths(kept)
    assert [p.name for p in paths] == ["step_000000040.pt", "step_000000050.pt"]
    assert not list((kept / "checkpoints").glob(".partial-*"))
    state = torch.load(paths[-1])  # plain torch.load, safe (weights_only) by default
    assert state["step"] == 50 and state["data"] == {"step": 50, "epoch": 0, "batch_in_epoch": 50}
    assert {"model", "optimizer", "scaler", "rng", "config"} <= state.keys()
    assert len(state["rng"]) == 2 and not any(k.startswith("module.") for k in state["model"])
    assert state["config"]["trainer"]["max_steps"] == 50


def test_resume_mid_epoch_matches_an_uninterrupted_run(tmp_path):
    """64 steps make an epoch here: stopping at 37 and going on to 100 crosses an epoch edge."""
    straight = torchrun(tmp_path, "trainer.max_steps=100", "hydra.run.dir=straight")
    first = torchrun(tmp_path, "trainer.max_steps=37", "hydra.run.dir=resumed")
    second = torchrun(tmp_path, "trainer.max_steps=100", "hydra.run.dir=resumed")
    for done in (straight, first, second):
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from the checkpoint of step 37 (epoch 0, batch 37)" in second.stdout
    diff = max_abs_diff(
        final_model(tmp_path / "straight", 100), final_model(tmp_path / "resumed", 100)
    )
    assert diff <= 1e-6


def test_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(kept, tmp_path):
    shutil.copytree(kept, tmp_path / "run")
    newest = tmp_path / "run" / "checkpoints" / "step_000000050.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, as by a node dying mid-write
    done = torchrun(
        tmp_path, "trainer.max_steps=60", "trainer.checkpoint_every=10", "hydra.run.dir=run"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipping unreadable checkpoint step_000000050.pt" in done.stdout + done.stderr
    assert "resumed from the checkpoint of step 40" in done.stdout


def launch(tmp_path, *overrides: str) -> subprocess.Popen:
    command = train_command("hydra.run.dir=run", "trainer.log_every=5", *overrides)
    return subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


# Installed as sitecustomize in the workers: each rank's exit code (os._exit: the ways a stop
# ends) lands in STOP_RECORDS/exit<rank>. With SLOW_RANK_1_INIT, rank 1 sleeps before
# init_process_group while rank 0 waits for it there, in C; with SLOW_RANK_1_RESUME, after
# loading the checkpoint, while rank 0 waits in the exchange before the first step. Each marks
# waiting<rank> on the way. With FAIL_SECOND_WRITE, rank 0's second checkpoint write fails as
# on a full disk.
STOP_HOOK = """
import errno, os, pathlib, time
if "RANK" in os.environ:
    _records = pathlib.Path(os.environ["STOP_RECORDS"])
    _exit, _trainer = os._exit, os.getpid()

    def _recording_exit(code):
        if os.getpid() == _trainer:  # not a DataLoader worker, forked from it
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
        from PACKAGE.trainer import Trainer
        _resume = Trainer.resume

        def _slow_resume(self):
            _resume(self)
            (_records / f"waiting{os.environ['RANK']}").touch()
            if os.environ["RANK"] == "1":
                time.sleep(60)

        Trainer.resume = _slow_resume
    if os.environ.get("FAIL_SECOND_WRITE"):
        from PACKAGE import checkpoint
        _write, _calls = checkpoint.write_atomically, []

        def _write_until_full(state, path):
            _calls.append(path)
            if len(_calls) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return _write(state, path)

        checkpoint.write_atomically = _write_until_full
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


def signal_at_a_step_line(tmp_path, env, signum, after: str, *overrides) -> tuple[str, float]:
    """Train in run/ until the first step line after a line holding `after`, send `signum` to
    the launch's process group (as Ctrl-C does; torchrun forwards it too), and wait for the end.
    Returns the output and the seconds from the signal to its last line."""
    command = train_command("hydra.run.dir=run", "trainer.log_every=5", "trainer.max_steps=100000000",
                            "trainer.checkpoint_every=100000", *overrides)  # fmt: skip
    process = subprocess.Popen(
        command, cwd=tmp_path, env={**os.environ, **env}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    lines, seen, signalled = [], False, None
    try:
        for line in process.stdout:
            lines.append(line)
            last = time.monotonic()
            seen = seen or after in line
            if signalled is None and seen and STEP_LINE.search(line):
                os.killpg(process.pid, signum)
                signalled = last
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(lines)
    assert signalled is not None, output[-3000:]
    return output, last - signalled


def assert_stopped(output: str, seconds: float, records: Path, name: str, code: int) -> int:
    """Every rank stopped with `code` within 5 s, after one line; the step it names."""
    assert seconds < 5, output[-3000:]
    stopped = re.findall(rf"{name}: stopped at step (\d+) with a checkpoint", output)
    assert len(stopped) == 1, output[-3000:]
    assert [(records / f"exit{rank}").read_text() for rank in (0, 1)] == [str(code)] * 2
    assert "KeyboardInterrupt" not in output and output.count("Traceback") <= 1  # torchrun's
    assert "A collective failed" not in output and "failed too" not in output
    return int(stopped[0])


@pytest.mark.timeout(300)
def test_a_stop_signal_stops_every_rank_at_one_step_after_0_1_and_2_resumes(tmp_path, stop_hook):
    """SIGTERM (Kubernetes; torchrun forwards it) on a fresh run, after a resume, and Ctrl-C
    after a second one: each within 5 s, one line, a checkpoint at the step named there, every
    rank exiting 128 + the signal. The old pace counted the steps a checkpoint brought in as
    just run: after a resume the stop came 5 to 30 s late, or torchrun's SIGKILL came first.
    DataLoader workers, in the process group too, ignore both signals."""
    env, records = stop_hook
    run = tmp_path / "run"
    stops = []
    for resumes, (signum, overrides) in enumerate(
        [(signal.SIGTERM, ["data.num_workers=2"]), (signal.SIGTERM, []),
         (signal.SIGINT, ["data.num_workers=2"])]
    ):  # fmt: skip
        for record in records.iterdir():
            record.unlink()
        after = f"resumed from the checkpoint of step {stops[-1]} " if stops else ""
        output, seconds = signal_at_a_step_line(tmp_path, env, signum, after, *overrides)
        stops.append(assert_stopped(output, seconds, records, signum.name, 128 + signum))
        assert checkpoint.newest_readable(run)[1]["step"] == stops[-1], (resumes, output[-3000:])
    assert [p.name for p in checkpoint.checkpoint_paths(run)] == [f"step_{s:09d}.pt" for s in stops]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rank_1_sleeps", ["SLOW_RANK_1_INIT", "SLOW_RANK_1_RESUME"])
def test_a_stop_signal_before_the_first_step_ends_every_rank_at_once(
    tmp_path, stop_hook, rank_1_sleeps
):
    """SIGTERM while rank 0 waits for rank 1 in C (Python runs no handler there): in
    init_process_group, or in the exchange before the first step, which fails as rank 1 ends.
    Nothing to save: every rank ends at once with 143, one line, and no remedy block."""
    env, records = stop_hook
    command = train_command("hydra.run.dir=run")
    process = subprocess.Popen(
        command, cwd=tmp_path, env={**os.environ, **env, rank_1_sleeps: "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ((records / "waiting0").exists() and (records / "waiting1").exists()):
            assert process.poll() is None and time.monotonic() < deadline, "never got there"
            time.sleep(0.1)
        time.sleep(0.5)  # rank 0 waiting
        os.killpg(process.pid, signal.SIGTERM)
        signalled = time.monotonic()
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert time.monotonic() - signalled < 5, output[-3000:]
    line = f"SIGTERM: stopped before the first step, nothing new to save; to go on, relaunch with hydra.run.dir={tmp_path / 'run'}"
    assert output.count("SIGTERM: stopped") == 1 and line in output, output[-3000:]
    assert [(records / f"exit{rank}").read_text() for rank in (0, 1)] == ["143", "143"]
    assert output.count("Traceback") <= 1 and "A collective failed" not in output  # torchrun's


@pytest.mark.timeout(240)
def test_a_full_disk_is_rank_0s_one_line_and_no_rank_blames_a_collective(tmp_path, stop_hook):
    env, _ = stop_hook
    done = torchrun(tmp_path, "trainer.max_steps=30", "trainer.checkpoint_every=10", "hydra.run.dir=run",
                    env={**env, "FAIL_SECOND_WRITE": "1"})  # fmt: skip
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


def test_a_refused_resume_leaves_the_runs_config_as_it_was(kept, tmp_path):
    """The guard lets the change through (accept_changes), the checkpoint does not fit."""
    shutil.copytree(kept, tmp_path / "run")
    before = (tmp_path / "run" / "config.yaml").read_text()
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", "model.hidden_dim=64", "hydra.run.dir=run",
         "trainer.accept_changes=[model.hidden_dim]"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "config error: step_000000050.pt does not fit this run's model" in done.stderr
    assert (tmp_path / "run" / "config.yaml").read_text() == before


@pytest.mark.timeout(240)
def test_a_rank_killed_with_sigkill_ends_the_launcher_promptly_and_a_relaunch_resumes(tmp_path):
    process = launch(tmp_path, "trainer.max_steps=100000000", "trainer.checkpoint_every=20")
    run_dir = tmp_path / "run"
    deadline = time.monotonic() + 120
    while not checkpoint.checkpoint_paths(run_dir):
        assert process.poll() is None and time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.2)
    victim = worker_pid(process.pid, rank=1)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    output, _ = process.communicate(timeout=90)
    assert process.returncode != 0
    assert time.monotonic() - killed_at < 45, output[-3000:]
    newest = checkpoint.newest_readable(run_dir)[1]["step"]
    resumed = torchrun(tmp_path, f"trainer.max_steps={newest + 10}", "hydra.run.dir=run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from the checkpoint of step {newest}" in resumed.stdout


def test_resume_with_another_world_size_restarts_the_epoch(kept, tmp_path):
    shutil.copytree(kept, tmp_path / "run")
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", "trainer.max_steps=55", "hydra.run.dir=run"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "written by 2 processes, this run has 1: epoch 0 starts again" in done.stdout
    assert "resumed from the checkpoint of step 50 (epoch 0, batch 0)" in done.stdout


def test_separate_static_rendezvous_launches_get_separate_run_dirs(tmp_path):
    """torchrun without --standalone names every run "none"; each launch still gets its own dir."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
               "--master-port", "29533", "-m", f"{PACKAGE}.train", "trainer.max_steps=3"]  # fmt: skip
    for _ in range(2):
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    runs = sorted(p.name for p in (tmp_path / "outputs").iterdir())
    assert len(runs) == 2 and all(RUN_NAME.fullmatch(name) for name in runs), runs


SLOW_SAVE = """
import os, time, torch
_save = torch.save

def _slow_save(*args, **kwargs):
    time.sleep(float(os.environ["SLOW_SAVE_S"]))
    return _save(*args, **kwargs)

torch.save = _slow_save
"""


@pytest.mark.timeout(240)
def test_a_checkpoint_write_longer_than_the_collective_timeout_is_no_collective_failure(tmp_path):
    """Rank 0 writes for 8 s under dist.timeout_s=3: the others wait on the CPU group, with no
    collective pending and the stall watchdog paused, and training goes on."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_SAVE)
    env = {"PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}", "SLOW_SAVE_S": "8"}
    done = torchrun(tmp_path, "trainer.max_steps=20", "trainer.checkpoint_every=10", "dist.timeout_s=3",
                    "hydra.run.dir=run", env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "A collective failed" not in done.stderr
    names = [p.name for p in checkpoint.checkpoint_paths(tmp_path / "run")]
    assert names == ["step_000000010.pt", "step_000000020.pt"]

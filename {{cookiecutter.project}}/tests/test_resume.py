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
    wait_for_metrics,
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


@pytest.mark.parametrize("workers", [0, 2])  # DataLoader workers must not die of torchrun's SIGTERM
def test_sigterm_stops_every_rank_at_one_step_with_a_checkpoint_there(tmp_path, workers):
    process = launch(tmp_path, "trainer.max_steps=100000000", "trainer.checkpoint_every=100000",
                     f"data.num_workers={workers}")  # fmt: skip
    wait_for_metrics(process, tmp_path / "run")
    process.send_signal(signal.SIGTERM)  # what Kubernetes sends to the container's PID 1
    output, _ = process.communicate(timeout=60)
    assert process.returncode != 0  # torchrun reports a signalled run as failed: the Job retries it
    stopped = re.search(r"SIGTERM: stopped at step (\d+) with a checkpoint", output)
    assert stopped, output[-3000:]
    step = int(stopped.group(1))
    assert [p.name for p in checkpoint.checkpoint_paths(tmp_path / "run")] == [
        f"step_{step:09d}.pt"
    ]
    # whole and readable, what a resume loads (the resume itself: the SIGKILL test below)
    assert checkpoint.newest_readable(tmp_path / "run")[1]["step"] == step


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

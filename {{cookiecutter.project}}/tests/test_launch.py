"""`<project> train`, the launcher that make train and the Job use: a bad override or run dir
ends in one line before any worker starts; a failure ends in one line naming the process and its
exit; workers never outlive it."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    PACKAGE,
    launch,
    launch_command,
    read_metrics,
    shared_folder,
    wait_for_metrics,
    worker_pids,
)
from torch.distributed.run import get_args_parser

from {{ cookiecutter.package }} import checkpoint
from {{ cookiecutter.package }} import launch as launcher

TORCHRUN = get_args_parser()


def stderr_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["trainer.max_stepz=3"],
            "config error: trainer.max_stepz: no such key; allowed: max_steps,",
        ),
        (["+trainer.foo=1"], "config error: trainer.foo: no such key;"),
        (["trainer.lr=nan"], "config error: trainer.lr=nan: must be a finite number above 0"),
        (["nccl=fastest"], "config error: nccl=fastest: no such option; allowed: auto,"),
        (
            ["--cfg", "job"],
            f"{launcher.COMMAND} train: --cfg: not a torchrun option; Hydra's own flags",
        ),
        (["-m", "x"], f"{launcher.COMMAND} train: -m: the launcher runs -m {PACKAGE}.train itself"),
    ],
)
def test_a_bad_argument_is_one_line_before_any_worker_starts(
    tmp_path, monkeypatch, capsys, args, line
):
    """In this process (a launch costs seconds of CPU); the console script's own refusals, in
    test_rundir.py."""
    monkeypatch.chdir(tmp_path)
    try:
        code = launcher.main(["train", *args])
    except SystemExit as stop:  # config.exit_with_error
        code = stop.code
    out, err = capsys.readouterr()
    lines = stderr_lines(err)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(line)
    assert out == "" and list(tmp_path.iterdir()) == []  # no run dir, no worker output


def test_torchrun_options_and_overrides_are_told_apart_by_torchruns_own_parser():
    args = ["--nproc-per-node", "2", "--rdzv-conf", "join_timeout=5", "--standalone",
            "--max-restarts=1", "trainer.lr=0.1", "hydra.run.dir=x"]  # fmt: skip
    options, overrides = launcher.split(args, TORCHRUN)
    assert options == args[:6] and overrides == ["trainer.lr=0.1", "hydra.run.dir=x"]


COMMON = ("trainer.checkpoint_every=10", "trainer.log_every=5", "hydra.run.dir=run")


@pytest.fixture(scope="module")
def good_run(request) -> tuple[Path, subprocess.CompletedProcess]:
    """20 steps under the launcher, a checkpoint every 10: its folder, and how it ended."""
    tmp_path = shared_folder(request)
    return tmp_path, launch(tmp_path, "trainer.max_steps=20", *COMMON)


def test_a_run_ends_with_the_workers_exit_code(good_run):
    cwd, done = good_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "OMP_NUM_THREADS" not in done.stderr
    assert read_metrics(cwd / "run")[-1]["step"] == 20


def test_a_diverging_run_stops_in_one_line_and_keeps_the_good_checkpoints(good_run, tmp_path):
    """trainer.lr=1e30 passes the check (it is finite) and blows the weights up at once: the run
    ends at its first log window in one line, exit 4, the earlier checkpoints as they were."""
    assert good_run[1].returncode == 0
    shutil.copytree(good_run[0] / "run", tmp_path / "run")
    good = {p.name: p.read_bytes() for p in checkpoint.checkpoint_paths(tmp_path / "run")}
    done = launch(tmp_path, "trainer.max_steps=60", "trainer.lr=1e30",
                  "trainer.accept_changes=[trainer.lr]", *COMMON)  # fmt: skip
    assert done.returncode == 4
    assert stderr_lines(done.stderr) == [
        "training diverged: step 25: the loss is not finite; nothing was saved from it. Lower "
        "trainer.lr (now 1e+30) or set trainer.max_grad_norm, and resume from step_000000020.pt: "
        "relaunch with the same hydra.run.dir, the new value and trainer.accept_changes=[trainer.lr]"
    ]
    after = {p.name: p.read_bytes() for p in checkpoint.checkpoint_paths(tmp_path / "run")}
    assert after == good


def start(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        launch_command("trainer.max_steps=100000000", "trainer.log_every=5", "hydra.run.dir=run", *args),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


@pytest.mark.timeout(240)
def test_a_killed_worker_is_named_with_its_signal_and_the_exit_passes_it_on(tmp_path):
    process = start(tmp_path)
    wait_for_metrics(process, tmp_path / "run")
    victim = worker_pids(process.pid)[1]
    os.kill(victim, signal.SIGKILL)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGKILL
    assert stderr.strip().splitlines()[-1] == (
        f"{launcher.COMMAND} train failed: rank 1 (pid {victim}) was killed by SIGKILL"
    )
    assert "Traceback" not in stderr
    assert "peer-to-peer" not in stderr  # gloo: no NCCL advice, whoever reported first


@pytest.mark.timeout(240)
def test_sigterm_checkpoints_and_the_launcher_says_so(tmp_path):
    process = start(tmp_path)
    wait_for_metrics(process, tmp_path / "run")
    process.send_signal(signal.SIGTERM)  # what Kubernetes sends to the container's PID 1
    _, stderr = process.communicate(timeout=90)
    assert process.returncode == 128 + signal.SIGTERM
    assert stderr.strip().splitlines()[-1] == f"{launcher.COMMAND} train: stopped by SIGTERM"
    assert checkpoint.checkpoint_paths(tmp_path / "run"), "no checkpoint at the stop"


@pytest.mark.timeout(240)
def test_workers_stop_with_a_checkpoint_within_30_s_when_the_launcher_is_killed(tmp_path):
    """SIGKILL leaves torchrun no time to stop its workers: they notice they were orphaned,
    agree on a step, checkpoint it and exit, instead of training on unsupervised."""
    process = start(tmp_path, "trainer.checkpoint_every=100000")
    wait_for_metrics(process, tmp_path / "run")
    workers = list(worker_pids(process.pid).values())
    assert len(workers) == 2
    os.kill(process.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    while any(Path(f"/proc/{pid}").exists() and not zombie(pid) for pid in workers):
        assert time.monotonic() - killed_at < 30, "workers outlived their launcher by 30 s"
        time.sleep(0.2)
    process.communicate(timeout=30)
    (saved,) = checkpoint.checkpoint_paths(
        tmp_path / "run"
    )  # the stop's: the periodic ones are off
    step = checkpoint.step_of(saved)
    resumed = launch(tmp_path, f"trainer.max_steps={step + 5}", "hydra.run.dir=run")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from the checkpoint of step {step}" in resumed.stdout


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_summary_blames_the_cause_not_its_consequences():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failure(rank: int, code: int, at: int) -> ProcessFailure:
        made = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        made.timestamp = at
        return made

    # rank 0 saw its peer's connection close first (exit 3); rank 1 was killed
    killed = ChildFailedError(
        "train", {0: failure(0, 3, at=1), 1: failure(1, -signal.SIGKILL, at=2)}
    )
    assert launcher.summary(killed) == ("rank 1 (pid 101) was killed by SIGKILL", 137)
    diverged = ChildFailedError(
        "train", {0: failure(0, -signal.SIGTERM, at=1), 1: failure(1, 4, at=2)}
    )
    assert launcher.summary(diverged)[1] == 4

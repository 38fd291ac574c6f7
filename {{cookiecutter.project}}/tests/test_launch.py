"""`<project> train`, the launcher that make train and the Job use: a bad override or run dir
ends in one line before any worker starts; a failure ends in one line naming the process and its
exit; workers never outlive it."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import (
    PACKAGE,
    launch,
    launch_command,
    no_torchrun,
    read_metrics,
    shared_folder,
    users_env,
    wait_for_metrics,
    worker_pids,
)
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import get_args_parser

from ddp_project import launch as launcher
from ddp_project import train
from ddp_project.launcher import run_dir_plan, torchrun_args, worker_exits
from ddp_project.run import checkpoint, oom, stopping

TORCHRUN = get_args_parser()

pytestmark = pytest.mark.usefixtures("launcher_state")  # conftest.py


def stderr_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["trainer.max_stepz=3"],
            "config error: trainer.max_stepz: no such key; "
            "did you mean trainer.max_steps? allowed: max_steps,",
        ),
        (["+trainer.foo=1"], "config error: trainer.foo: no such key;"),
        (["trainer.lr=nan"], "config error: trainer.lr=nan: must be a finite number above 0"),
        (["nccl=fastest"], "config error: nccl=fastest: no such option; allowed: auto,"),
        (
            ["--cfg", "job"],
            f"{launcher.COMMAND} train: --cfg: not a torchrun option; Hydra's own flags",
        ),
        (["--module", "x"], f"{launcher.COMMAND} train: --module: the launcher runs -m"),
        # A sweep: one process per trial (python -m <package>.train -m), never one per rank.
        (["-m", "trainer.lr=0.1,0.2"], f"{launcher.COMMAND} train: -m: a sweep runs in one"),
        (["--multirun", "x=1"], f"{launcher.COMMAND} train: --multirun: a sweep runs in one"),
        (["hparams_search=optuna"], f"{launcher.COMMAND} train: hparams_search=optuna: a sweep"),
        (["hydra.mode=MULTIRUN"], f"{launcher.COMMAND} train: hydra.mode=MULTIRUN: a sweep"),
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
    except SystemExit as stop:  # core.exits.exit_with_error
        code = stop.code
    out, err = capsys.readouterr()
    lines = stderr_lines(err)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(line)
    assert out == "" and list(tmp_path.iterdir()) == []  # no run dir, no worker output


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node=0: must be a number of processes from 1 to"),
        (["--nproc-per-node", "abc"], "--nproc-per-node=abc: must be a number of processes"),
        (["--nproc-per-node", "-1"], "--nproc-per-node=-1: must be a number of processes"),
        (["--nproc-per-node="], "--nproc-per-node='': must be a number of processes"),
        (["--nproc-per-node", "9" * 30], f"--nproc-per-node={'9' * 30}: must be a number"),
        (["--nproc-per-node"], "--nproc-per-node: needs a value"),
        (["--nnodes", "0"], "--nnodes=0: must be a number of nodes (1 or more), or MIN:MAX"),
        (["--nnodes", "1:0"], "--nnodes=1:0: must be a number of nodes"),
        (["--nnodes", "2:1"], "--nnodes=2:1: must be a number of nodes"),
        (["--nnodes="], "--nnodes='': must be a number of nodes"),
        (["--nnodes", "1:2:3"], "--nnodes=1:2:3: must be a number of nodes"),
        (["--standalone", "--nnodes", "2"], "--nnodes=2: --standalone runs one node"),
        (["--max-restarts", "-1"], "--max-restarts=-1: must be 0 or more"),
        (["--max-restarts", "x"], "--max-restarts='x': must be a whole number"),
        (["--node-rank", "-1"], "--node-rank=-1: must be from 0 to 0"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank=2: must be from 0 to 1"),
        (["--rdzv-backend", "zk"], "--rdzv-backend=zk: no such backend; allowed: c10d,"),
        (["--rdzv-endpoint", "host:port"], "--rdzv-endpoint=host:port: must be HOST or HOST:PORT"),
        (["--rdzv-endpoint", "host:70000"], "--rdzv-endpoint=host:70000: must be HOST or"),
        (["--rdzv-conf", "=1"], "--rdzv-conf==1: must be KEY=VALUE pairs"),
        (["--rdzv-conf", "join_timeout=soon"], "--rdzv-conf=join_timeout=soon: must be KEY=VALUE"),
        (
            ["--monitor-interval", "0"],
            "--monitor-interval=0.0: must be a number of seconds above 0",
        ),
        (["--monitor-interval", "nan"], "--monitor-interval=nan: must be a number of seconds"),
        (["--master-port", "0"], "--master-port=0: must be a port, 1 to 65535"),
        (["-r", "9"], "--redirects=9: must be 0 (none), 1 (stdout), 2 (stderr) or 3 (both)"),
        (["--local-ranks-filter", "a"], "--local-ranks-filter=a: must be local ranks"),
        (["--start-method", "x"], "--start-method: invalid choice: 'x'"),
    ],
)
def test_a_torchrun_option_that_cannot_work_is_one_line_naming_it(
    tmp_path, monkeypatch, capsys, args, line
):
    """Each of these gave torchrun's ZeroDivisionError, ValueError, AssertionError or argparse's
    usage block, or a world of -1 processes."""
    monkeypatch.chdir(tmp_path)
    no_torchrun(monkeypatch)
    code = launcher.main(["train", *args])
    out, err = capsys.readouterr()
    assert code == 2
    assert stderr_lines(err) == [stderr_lines(err)[0]] and err.startswith(
        f"{launcher.COMMAND} train: {line}"
    ), err
    assert out == "" and list(tmp_path.iterdir()) == []


def test_an_option_from_the_environment_is_named_by_its_variable(tmp_path, monkeypatch, capsys):
    """Operators pass torchrun its options in PET_* variables: the line names the variable."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PET_NPROC_PER_NODE", "0")
    no_torchrun(monkeypatch)
    assert launcher.main(["train"]) == 2
    assert capsys.readouterr().err.startswith(
        f"{launcher.COMMAND} train: PET_NPROC_PER_NODE=0: must be a number of processes"
    )


@pytest.mark.parametrize("quoted", ["'run dir'", '"run dir"'])
def test_a_quoted_run_dir_is_read_as_hydra_reads_it(tmp_path, monkeypatch, capsys, quoted):
    """The launcher checked (and created) `'run dir'`, quotes and all, where the workers use
    `run dir`: here a file, which it must refuse."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run dir").write_text("not a dir")
    no_torchrun(monkeypatch)
    assert launcher.main(["train", "--nproc-per-node", "1", f"hydra.run.dir={quoted}"]) == 2
    assert stderr_lines(capsys.readouterr().err) == [
        "config error: hydra.run.dir=run dir: is a file, not a directory; choose another "
        "hydra.run.dir"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["run dir"]  # no `'run dir'` beside it


@pytest.mark.parametrize(
    ("override", "run_dir"),
    [
        ("hydra.run.dir='a b'", "a b"),
        ('hydra.run.dir="/tmp/x"', "/tmp/x"),
        ("++hydra.run.dir=run", "run"),
        (r"hydra.run.dir=a\,b", "a,b"),  # Hydra's escape
        ("hydra.run.dir=${oc.env:HOME}/run", None),  # the workers resolve it
        ("trainer.lr=0.1", None),
    ],
)
def test_the_run_dir_of_a_multi_node_launch_is_read_as_hydra_reads_it(override, run_dir):
    """With several nodes the launcher cannot compose the default dir's name; it checks an
    explicit one, which it read quotes and all."""
    found = run_dir_plan.explicit_run_dir(["trainer.max_steps=3", override])
    assert found == (Path(run_dir) if run_dir else None)


def test_torchrun_options_and_overrides_are_told_apart_by_torchruns_own_parser():
    args = [
        "--nproc-per-node",
        "2",
        "--rdzv-conf",
        "join_timeout=5",
        "--standalone",
        "--max-restarts=1",
        "trainer.lr=0.1",
        "hydra.run.dir=x",
    ]
    options, overrides = torchrun_args.split(args, TORCHRUN)
    assert options == args[:6] and overrides == ["trainer.lr=0.1", "hydra.run.dir=x"]


def start(tmp_path: Path, *args: str, options: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen(
        launch_command(
            *options,
            "trainer.max_steps=100000000",
            "trainer.log_every=5",
            "hydra.run.dir=run",
            *args,
        ),
        cwd=tmp_path,
        env=users_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists() and not zombie(pid)]


COMMON = ("trainer.checkpoint_every=10", "trainer.log_every=5", "hydra.run.dir=run")


@pytest.fixture(scope="module")
def good_run(request) -> SimpleNamespace:
    """Two launches in one folder (each costs seconds of CPU): a run whose launcher is
    SIGKILLed, its workers left to stop on their own; then, resumed from what they saved, a good
    run to a round step under the launcher, a checkpoint every 10 steps."""
    cwd = shared_folder(request)
    process = start(cwd, "trainer.checkpoint_every=100000")  # the stop's checkpoint alone
    wait_for_metrics(process, cwd / "run")
    workers = list(worker_pids(process.pid).values())
    os.kill(process.pid, signal.SIGKILL)
    killed_at, outlived_s = time.monotonic(), 0.0
    while alive(workers) and outlived_s < 120:  # the last time they were seen alive
        outlived_s = time.monotonic() - killed_at
        time.sleep(0.2)
    for pid in alive(workers):  # failed, below: end them here, not at the end of the session
        os.kill(pid, signal.SIGKILL)
    process.communicate(timeout=30)
    saved = checkpoint.checkpoint_paths(cwd / "run")
    stopped_at = checkpoint.step_of(saved[-1]) if saved else 0
    steps = (stopped_at // 10 + 2) * 10  # 10 to 20 steps more, a checkpoint at the last
    # One worker (two are the killed run's, before, and the diverging run's, below)
    done = launch(cwd, "--nproc-per-node", "1", f"trainer.max_steps={steps}", *COMMON)
    return SimpleNamespace(
        cwd=cwd,
        workers=workers,
        outlived_s=outlived_s,
        saved=saved,
        stopped_at=stopped_at,
        steps=steps,
        done=done,
    )


@pytest.mark.slow
def test_workers_stop_with_a_checkpoint_when_the_launcher_is_killed(good_run, figure):
    """SIGKILL leaves torchrun no time to stop its workers: they notice they were orphaned,
    agree on a step, checkpoint it and exit, instead of training on unsupervised (each ends
    itself at most train.ORPHAN_EXIT_S after it noticed; the bound below is for a loaded
    machine, the figure is this one's); the run resumes from that step."""
    assert len(good_run.workers) == 2
    figure(f"the workers outlived their SIGKILLed launcher by {good_run.outlived_s:.1f} s")
    assert good_run.outlived_s < 120, "workers outlived their launcher by 120 s"
    (saved,) = good_run.saved  # the stop's: the periodic ones are off
    step = checkpoint.step_of(saved)
    resumed = good_run.done
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from the checkpoint of step {step}" in resumed.stdout


@pytest.mark.slow
def test_a_run_ends_with_the_workers_exit_code(good_run):
    """torchrun's OMP_NUM_THREADS banner (two workers or more): see the killed worker's test."""
    cwd, done = good_run.cwd, good_run.done
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "OMP_NUM_THREADS" not in done.stderr
    assert read_metrics(cwd / "run")[-1]["step"] == good_run.steps


@pytest.mark.slow
def test_a_diverging_run_stops_in_one_line_and_keeps_the_good_checkpoints(good_run, tmp_path):
    """trainer.lr=1e30 passes the check (it is finite) and blows the weights up at once: the run
    ends at its first log window in one line, exit 4, the earlier checkpoints as they were."""
    assert good_run.done.returncode == 0
    shutil.copytree(good_run.cwd / "run", tmp_path / "run")
    good = {p.name: p.read_bytes() for p in checkpoint.checkpoint_paths(tmp_path / "run")}
    last = good_run.steps  # the good run's last step, and its newest checkpoint
    done = launch(
        tmp_path,
        f"trainer.max_steps={last + 40}",
        "trainer.lr=1e30",
        "trainer.accept_changes=[trainer.lr]",
        *COMMON,
    )
    assert done.returncode == 4
    assert stderr_lines(done.stderr) == [
        f"training diverged: step {last + 5}: the loss is not finite; nothing was saved from it. "
        f"Lower trainer.lr (now 1e+30) or set trainer.max_grad_norm, and resume from "
        f"step_{last:09d}.pt: relaunch with the same hydra.run.dir, the new value and "
        "trainer.accept_changes=[trainer.lr]"
    ]
    after = {p.name: p.read_bytes() for p in checkpoint.checkpoint_paths(tmp_path / "run")}
    assert after == good


@pytest.mark.slow
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
    assert "Traceback" not in stderr and "OMP_NUM_THREADS" not in stderr  # the launcher sets it
    assert "peer-to-peer" not in stderr  # gloo: no NCCL advice, whoever reported first


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_sigterm_checkpoints_and_the_launcher_says_so(tmp_path):
    """One worker: every rank stopping at one step is test_resume.py's (two processes)."""
    process = start(tmp_path, options=("--nproc-per-node", "1"))
    wait_for_metrics(process, tmp_path / "run")
    process.send_signal(signal.SIGTERM)  # what Kubernetes sends to the container's PID 1
    _, stderr = process.communicate(timeout=90)
    assert process.returncode == 128 + signal.SIGTERM
    assert stderr.strip().splitlines()[-1] == f"{launcher.COMMAND} train: stopped by SIGTERM"
    assert checkpoint.checkpoint_paths(tmp_path / "run"), "no checkpoint at the stop"


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
    assert worker_exits.summary(killed) == ("rank 1 (pid 101) was killed by SIGKILL", 137)
    diverged = ChildFailedError(
        "train", {0: failure(0, -signal.SIGTERM, at=1), 1: failure(1, 4, at=2)}
    )
    assert worker_exits.summary(diverged)[1] == 4


def failure(rank: int, code: int, at: int):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    made = ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
    made.timestamp = at
    return made


@pytest.mark.parametrize("codes", [(130, 130), (-signal.SIGINT, 130), (143, -signal.SIGTERM)])
def test_workers_that_were_stopped_are_not_blamed(codes):
    """Ctrl-C reaches every process of the group: workers that stopped (with a checkpoint) before
    torchrun saw the signal are no rank's failure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    err = ChildFailedError("train", {i: failure(i, code, at=i) for i, code in enumerate(codes)})
    line, code = worker_exits.summary(err)
    name = signal.Signals(abs(codes[0]) % 128).name
    assert (line, code) == (f"stopped by {name}", 128 + abs(codes[0]) % 128)


@pytest.mark.parametrize(
    "stop",
    [
        lambda: SignalException("SIGINT", signal.SIGINT),
        KeyboardInterrupt,  # before torchrun's handler is in place: its rendezvous, say
    ],
    ids=["in torchrun", "before torchrun"],
)
def test_ctrl_c_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys, stop):
    monkeypatch.chdir(tmp_path)

    def interrupted(parsed):
        raise stop()

    monkeypatch.setattr(launcher, "run", interrupted)
    code = launcher.main(["train", "--nproc-per-node", "1", "hydra.run.dir=run"])
    assert code == 130
    assert stderr_lines(capsys.readouterr().err)[-1].startswith(
        f"{launcher.COMMAND} train: stopped by SIGINT"
    )


def workers_wrote(run_dir: Path, rows: bool = False, saved: bool = False) -> None:
    """What the workers leave in a run dir before their first step: Hydra's files, an empty
    log and metrics file; with `rows`/`saved`, a logged step and a checkpoint."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("trainer: {}\n")
    (run_dir / "train.log").write_text("")
    (run_dir / "metrics.jsonl").write_text('{"step": 5}\n' if rows else "")
    if saved:
        (run_dir / "checkpoints").mkdir()
        (run_dir / "checkpoints" / "step_000000005.pt").write_bytes(b"x")


@pytest.mark.parametrize(
    ("existed", "rows", "saved", "kept"),
    [
        (False, False, False, False),  # made by this launch, nothing in it: removed
        (False, True, False, True),  # a logged step
        (False, False, True, True),  # a checkpoint
        (True, False, False, True),  # the user's dir: never removed
    ],
)
def test_a_stopped_launch_leaves_no_empty_run_dir(
    tmp_path, monkeypatch, capsys, existed, rows, saved, kept
):
    """SIGTERM seconds after a launch left a run dir with Hydra's files alone."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    if existed:
        run_dir.mkdir()

    def stopped(parsed):
        workers_wrote(run_dir, rows, saved)
        raise SignalException("SIGTERM", signal.SIGTERM)

    monkeypatch.setattr(launcher, "run", stopped)
    assert launcher.main(["train", "--nproc-per-node", "1", "hydra.run.dir=run"]) == 143
    line = stderr_lines(capsys.readouterr().err)[-1]
    assert run_dir.exists() == kept
    if kept:
        assert line == f"{launcher.COMMAND} train: stopped by SIGTERM"
    else:
        assert line == (
            f"{launcher.COMMAND} train: stopped by SIGTERM before any step was saved or logged; "
            "removed run"
        )


def test_the_default_run_dir_of_a_stopped_launch_goes_too(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    made = []

    def stopped(parsed):
        assert not (tmp_path / "outputs").exists() or not any((tmp_path / "outputs").iterdir())
        run_dir = tmp_path / "outputs" / os.environ["DDP_RUN_NAME"]  # the launcher named it
        made.append(run_dir)
        workers_wrote(run_dir)
        raise SignalException("SIGTERM", signal.SIGTERM)

    monkeypatch.setattr(launcher, "run", stopped)
    assert launcher.main(["train", "--nproc-per-node", "1"]) == 143
    assert made and list(tmp_path.iterdir()) == []  # outputs/ too: this launch made it


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_before_torchrun_starts_is_one_line_and_leaves_nothing(
    tmp_path, monkeypatch, capsys, signum
):
    """SIGTERM while the launcher composed the config killed it silently (exit -15), leaving
    the run dir it had made to check it."""
    monkeypatch.chdir(tmp_path)
    real = launcher.check.compose_train

    def signalled(overrides, folder):
        composed = real(overrides, folder)
        os.kill(os.getpid(), signum)  # the handler raises here, as at any point of the check
        return composed

    monkeypatch.setattr(launcher.check, "compose_train", signalled)
    no_torchrun(monkeypatch)
    code = launcher.main(["train", "--nproc-per-node", "1", "hydra.run.dir=run"])
    assert code == 128 + signum
    assert stderr_lines(capsys.readouterr().err) == [
        f"{launcher.COMMAND} train: stopped by {signal.Signals(signum).name}"
    ]
    assert list(tmp_path.iterdir()) == []


def test_the_launcher_removes_only_empty_dirs_it_made_to_check(tmp_path, monkeypatch):
    """With several nodes on one file system, another node's workers may write into the run dir
    while this launcher checks it: what they wrote stays."""
    monkeypatch.chdir(tmp_path)
    real = launcher.rundir.launch_problem

    def another_node_writes(run_dir, busy=True):
        found = real(run_dir, busy)
        (run_dir / "train.log").write_text("node 1's line\n")
        return found

    monkeypatch.setattr(launcher.rundir, "launch_problem", another_node_writes)
    monkeypatch.setattr(launcher, "run", lambda parsed: None)
    args = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:1"]
    assert launcher.main(["train", *args, "hydra.run.dir=out/run"]) == 0
    assert (tmp_path / "out" / "run" / "train.log").read_text() == "node 1's line\n"


def catches(pid: int, signum: int) -> bool:
    """Whether a process has a handler of its own for `signum` (SigCgt in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    (mask,) = [line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")]
    return bool(int(mask, 16) >> (signum - 1) & 1)


def loads(pid: int | None, library: str) -> bool:
    """Whether a process has a library whose path holds `library` loaded (/proc maps)."""
    try:
        return pid is not None and library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def socket_inodes(pid: int) -> set[str]:
    found = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    found.add(target[len("socket:[") : -1])
    except OSError:
        pass
    return found


def listens(pid: int) -> bool:
    """Whether a process holds a listening TCP socket: the launcher, torchrun's rendezvous."""
    inodes = socket_inodes(pid)
    for table in ("tcp", "tcp6"):
        with suppress(OSError):
            for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    return True
    return False


# Installed as sitecustomize in the launches below. With SLOW_RANK_1_SPAWN, the launcher's start
# of rank 1's process marks `spawning1` in LAUNCH_MARKS and takes 60 s, rank 0's running already
# (a loaded machine's fork and exec, drawn out): a stop signal then is raised inside torchrun's
# start of its workers. With SLOW_PLOT, rank 0 marks `plotting` before the end-of-run plot, and
# takes 60 s more.
LAUNCH_HOOK = """
import os, pathlib, time
_marks = os.environ.get("LAUNCH_MARKS")
if _marks and os.environ.get("SLOW_RANK_1_SPAWN") and "RANK" not in os.environ:
    import subprocess
    _init = subprocess.Popen.__init__

    def _slow_rank_1(self, *args, **kwargs):
        if (kwargs.get("env") or {}).get("LOCAL_RANK") == "1":
            pathlib.Path(_marks, "spawning1").touch()
            for _ in range(600):  # Python code: a signal's handler runs between the sleeps
                time.sleep(0.1)
        _init(self, *args, **kwargs)

    subprocess.Popen.__init__ = _slow_rank_1
if _marks and os.environ.get("SLOW_PLOT") and os.environ.get("RANK") == "0":
    from PACKAGE.record import metrics
    _plot = metrics.plot_and_log

    def _slow_plot(run_dir):
        pathlib.Path(_marks, "plotting").touch()
        time.sleep(60)
        _plot(run_dir)

    metrics.plot_and_log = _slow_plot
""".replace("PACKAGE", PACKAGE)


@dataclass(frozen=True)
class Seen:
    """A launch as seen from outside, at one look."""

    launcher: int  # its pid
    worker: int | None  # rank 0's pid, once it exists
    run: Path
    marks: Path  # LAUNCH_HOOK's


@dataclass(frozen=True)
class Moment:
    """A moment of a launch, as `reached` sees it; whom the signal goes to (the launcher's
    process group, as a terminal's Ctrl-C does, or rank 0's alone, as torchrun passes a stop
    on); the launch's processes, and its overrides and environment beside the usual."""

    reached: Callable[[Seen], bool]
    to_worker: bool = False
    nproc: int = 1
    overrides: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def launched_here(pid: int, marks: Path) -> str | None:
    """The RANK of a worker of this test's launch (whose environment names its marks dir), if
    `pid` is one, alive."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if zombie(pid) or f"LAUNCH_MARKS={marks}".encode() not in environ:
        return None
    ranks = [item[len(b"RANK=") :].decode() for item in environ if item.startswith(b"RANK=")]
    return ranks[0] if ranks else None


def launched_by(launcher_pid: int, marks: Path) -> dict[int, str]:
    """pid -> RANK of the launcher's workers now (its children: cheaper than all of /proc)."""
    found = {pid: launched_here(pid, marks) for pid in oom.children(launcher_pid)}
    return {pid: rank for pid, rank in found.items() if rank is not None}


def interpreter_started(pid: int | None) -> bool:
    return pid is not None and catches(pid, signal.SIGINT)


def logged_a_row(run: Path) -> bool:
    rows = run / "metrics.jsonl"
    return rows.exists() and rows.stat().st_size > 0


MOMENTS = {
    # The launcher's handlers are in (Python itself takes no SIGHUP): torch imports next.
    "launcher imports torch": Moment(lambda at: catches(at.launcher, signal.SIGHUP)),
    # The config is checked; torchrun's rendezvous store listens, its workers start next.
    "torchrun rendezvous": Moment(lambda at: listens(at.launcher)),
    # A worker's interpreter took SIGINT (KeyboardInterrupt) and imports site, then runpy:
    # train.py's first line is next.
    "a worker's interpreter starts": Moment(lambda at: interpreter_started(at.worker)),
    # ... with the signal to that worker alone, as torchrun passes a stop on: at once.
    "a worker's interpreter starts, signalled alone": Moment(
        lambda at: interpreter_started(at.worker), to_worker=True
    ),
    # train.py imports torch: its libraries are loaded, seconds of Python modules follow.
    "a worker imports torch": Moment(lambda at: loads(at.worker, "libtorch")),
    # stopping.SIGNALS holds its wakeup socket; Hydra composes, its logging not yet set up.
    "a worker composes": Moment(
        lambda at: at.worker is not None and bool(socket_inodes(at.worker)) and not at.run.exists()
    ),
    # Hydra made the run dir: the process group and the gate, two ranks.
    "the workers start the group": Moment(lambda at: (at.run / ".hydra").exists(), nproc=2),
    "training": Moment(lambda at: logged_a_row(at.run)),
    # torchrun had started rank 0 and not yet rank 1 (see LAUNCH_HOOK).
    "torchrun starts rank 1": Moment(
        lambda at: (at.marks / "spawning1").exists(),
        nproc=2,
        env=(("SLOW_RANK_1_SPAWN", "1"),),
    ),
    # The last step is saved; rank 0 draws metrics.png (see LAUNCH_HOOK).
    "the end-of-run plot": Moment(
        lambda at: (at.marks / "plotting").exists(),
        overrides=("trainer.max_steps=10",),
        env=(("SLOW_PLOT", "1"),),
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("moment", "signum"),
    [(name, signal.SIGINT) for name in MOMENTS]
    + [
        ("a worker's interpreter starts, signalled alone", signal.SIGTERM),
        ("a worker imports torch", signal.SIGTERM),
        ("the workers start the group", signal.SIGTERM),
    ],
    ids=lambda value: value.name if isinstance(value, signal.Signals) else value,
)
def test_a_stop_at_any_moment_of_a_launch_is_one_line(tmp_path, moment, signum):
    """Ctrl-C (SIGINT to the launcher's process group) or SIGTERM at each moment of a launch,
    each found by what can be seen of it in /proc and the run dir, not by the clock: stderr
    holds one line, the launcher's stop line (blank lines aside; nothing else, a traceback
    least of all), and the launch exits 128 + the signal, leaving no worker running and no run
    dir without a step in it. Ctrl-C while a worker imported gave an import traceback and
    torchrun's "Received 2 death signal" line; torchrun's start of its workers, interrupted,
    left the workers it had started running on, to a traceback once the launcher was gone."""
    given = MOMENTS[moment]
    run, marks, hook = tmp_path / "run", tmp_path / "marks", tmp_path / "hook"
    marks.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(LAUNCH_HOOK)
    env = {
        **users_env(),
        **dict(given.env),
        "LAUNCH_MARKS": str(marks),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
    }
    steps = given.overrides or ("trainer.max_steps=100000000",)
    process = subprocess.Popen(
        launch_command(
            "--nproc-per-node", str(given.nproc), "hydra.run.dir=run", "trainer.log_every=5", *steps
        ),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    workers: dict[int, str] = {}  # pid -> RANK
    try:
        deadline = time.monotonic() + 240
        while True:
            workers.update(launched_by(process.pid, marks))
            rank_0 = next((pid for pid, rank in workers.items() if rank == "0"), None)
            if given.reached(Seen(process.pid, rank_0, run, marks)):
                break
            assert process.poll() is None, f"ended before {moment}: {process.communicate()}"
            assert time.monotonic() < deadline, f"never got to {moment}"
            time.sleep(0.005)
        os.killpg(rank_0 if given.to_worker else process.pid, signum)
        out, err = process.communicate(timeout=150)
    finally:
        for pid in [process.pid] if process.poll() is None else []:
            os.killpg(pid, signal.SIGKILL)
        for pid in workers:
            if launched_here(pid, marks):  # not a pid used again since
                os.killpg(pid, signal.SIGKILL)
    name = signal.Signals(signum).name
    plain = f"{launcher.COMMAND} train: stopped by {name}"
    removed = f"{plain} before any step was saved or logged; removed run"
    assert process.returncode == 128 + signum, err[-3000:]
    assert stderr_lines(err) in ([plain], [removed]), err[-3000:]
    assert "Traceback" not in out + err
    assert not [pid for pid in workers if launched_here(pid, marks)], "a worker outlived it"
    assert not run.exists() or run_dir_plan.of_value(run), "a run dir without a step was left"
    if moment == "training":
        assert stderr_lines(err) == [plain] and checkpoint.checkpoint_paths(run)
        assert f"{name}: stopped at step " in out  # rank 0's line, in its log on stdout
    if moment == "the end-of-run plot":
        assert f"{name}: stopped after the last step, nothing new to save" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    "moment",
    ["imports torch", "composes"],  # its libraries loaded; stopping.SIGNALS's socket made
)
def test_ctrl_c_while_a_lone_worker_starts_is_one_line(tmp_path, moment):
    """`python -m <package>.train` without torchrun: its own one line, exit 130. While it
    composed, before Hydra set up logging, the line came from logging's last resort."""
    process = subprocess.Popen(
        [sys.executable, "-m", f"{PACKAGE}.train", "hydra.run.dir=run"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not (
            loads(process.pid, "libtorch")
            if moment == "imports torch"
            else socket_inodes(process.pid) and not (tmp_path / "run").exists()
        ):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.005)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, err[-3000:]
    assert stderr_lines(err) == ["SIGINT: stopped before the first step, nothing new to save"]
    assert "Traceback" not in out


def test_a_second_ctrl_c_while_the_launcher_ends_changes_nothing(tmp_path, monkeypatch, capsys):
    """Ctrl-C pressed twice: the second, once the launcher had said its line, raised through
    its end (KeyboardInterrupt here, torchrun's SignalException in a launch)."""
    monkeypatch.chdir(tmp_path)

    class PressedAgain(launcher.MemoryWatch):
        def __exit__(self, *exc: object) -> None:  # after the line
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)  # its handler runs once this thread runs Python again
            super().__exit__(*exc)

    def interrupted(parsed):
        raise SignalException("SIGINT", signal.SIGINT)

    monkeypatch.setattr(launcher, "MemoryWatch", PressedAgain)
    monkeypatch.setattr(launcher, "run", interrupted)
    assert launcher.main(["train", "--nproc-per-node", "1", "hydra.run.dir=run"]) == 130
    assert stderr_lines(capsys.readouterr().err) == [f"{launcher.COMMAND} train: stopped by SIGINT"]


def test_the_signals_torchrun_passes_on_are_those_the_workers_hold_back_and_take_first():
    assert launcher.HELD_FOR_WORKERS == set(train.STARTING_STOPS) == set(stopping.STOP_SIGNALS)


def test_torchruns_line_about_the_stop_signal_gives_way_to_the_launchers():
    said_below = worker_exits.SaidAgainBelow()

    def passes(message: str, *args: object) -> bool:
        record = logging.LogRecord("x", logging.WARNING, __file__, 1, message, args, None)
        return said_below.filter(record)

    assert "torch.distributed.elastic.agent.server.api" in worker_exits.TORCHRUN_LOGGERS
    assert not passes("Received %s death signal, shutting down workers", signal.SIGINT)
    assert not passes("Received %s death signal, shutting down workers", signal.SIGTERM.name)
    assert passes("Unable to shutdown process %s via %s, forcefully exiting via %s", 1, 2, 9)
    assert passes("Received 2 death signals from somewhere else")


def test_a_stop_before_the_workers_made_the_default_run_dir_leaves_no_outputs_dir(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)

    def stopped(parsed):
        assert list(tmp_path.iterdir()) == []  # the launcher made outputs/<run> to check it
        raise SignalException("SIGTERM", signal.SIGTERM)

    monkeypatch.setattr(launcher, "run", stopped)
    assert launcher.main(["train", "--nproc-per-node", "1"]) == 143
    assert list(tmp_path.iterdir()) == []


GIB = 2**30


def memory_config(batch_size, async_checkpoint=False):
    trainer = SimpleNamespace(async_checkpoint=async_checkpoint, checkpoint_every=100)
    return SimpleNamespace(data=SimpleNamespace(batch_size=batch_size), trainer=trainer)


def test_a_worker_killed_for_memory_is_named_with_the_figures_and_a_smaller_setting():
    config = memory_config(8)
    line = oom.memory_line(
        0,
        41,
        held=int(11.8 * GIB),
        total=int(23.5 * GIB),
        limit=(24 * GIB, "this machine has"),
        evidence=True,
        config=config,
        local_size=2,
    )
    assert line == (
        "rank 0 (pid 41) was killed for memory: it held 11.8 GiB (this node's 2 processes "
        "23.5 GiB) of the 24.0 GiB this machine has; try data.batch_size=4 or --nproc-per-node 1"
    )
    one = oom.memory_line(
        1,
        42,
        held=None,
        total=None,
        limit=(GIB // 2, "its cgroup (container) allows"),
        evidence=True,
        config=memory_config(1, async_checkpoint=True),
        local_size=1,
    )
    assert one == "rank 1 (pid 42) was killed for memory: its cgroup (container) allows 0.5 GiB"
    background = oom.memory_line(
        0, 41, GIB, GIB, (GIB, "this machine has"), True, memory_config(1, async_checkpoint=True), 1
    )
    assert background.endswith(
        "; try trainer.async_checkpoint=false (rank 0 holds a host copy of the state)"
    )
    # without evidence, a SIGKILL is a SIGKILL: no claim about memory
    assert oom.memory_line(0, 41, GIB, GIB, (24 * GIB, "x"), False, config, 2) is None


def test_the_evidence_of_a_kill_for_memory(monkeypatch):
    """A SIGKILL counts as one for memory when the kernel counted an OOM kill during the run, or
    when the workers held 90% of the limit when last seen; otherwise it is not."""
    config = memory_config(8)
    counts = {"/proc/vmstat": 3}
    monkeypatch.setattr(oom, "oom_kills", lambda: dict(counts))
    monkeypatch.setattr(oom, "memory_limit", lambda: (10 * GIB, "this machine has"))
    watch = oom.MemoryWatch(config, local_size=2)
    watch.last, watch.total_with = {41: 4 * GIB}, {41: 8 * GIB}
    assert watch.verdict(0, 41) is None  # 80% of the limit, no kill counted
    watch.total_with[41] = 9 * GIB
    assert watch.verdict(0, 41).startswith("rank 0 (pid 41) was killed for memory: it held 4.0")
    watch.total_with[41] = GIB
    counts["/proc/vmstat"] = 4  # the kernel's OOM killer struck during the run
    assert "killed for memory" in watch.verdict(0, 41)
    assert watch.verdict(1, 99) == (
        "rank 1 (pid 99) was killed for memory: this machine has 10.0 GiB; try "
        "data.batch_size=4 or --nproc-per-node 1"
    )


def test_the_launcher_names_a_worker_killed_for_memory(tmp_path, monkeypatch, capsys):
    """main() passes its memory watch to the summary: a SIGKILL while the kernel counted an OOM
    kill is named as one."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    monkeypatch.chdir(tmp_path)
    counts = iter(range(100))
    monkeypatch.setattr(oom, "oom_kills", lambda: {"/proc/vmstat": next(counts)})

    def killed(parsed):
        raise ChildFailedError("train", {0: failure(0, -signal.SIGKILL, at=1)})

    monkeypatch.setattr(launcher, "run", killed)
    assert launcher.main(["train", "--nproc-per-node", "1", "hydra.run.dir=run"]) == 137
    assert stderr_lines(capsys.readouterr().err)[-1].startswith(
        f"{launcher.COMMAND} train failed: rank 0 (pid 100) was killed for memory: "
    )


def test_the_memory_watch_sees_what_a_worker_holds():
    """The sampler, on a real child of this process that holds 200 MiB."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; b = bytearray(200 * 2**20); b[::4096] = b'x' * "
            "len(b[::4096]); print(flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        child.stdout.readline()  # allocated
        watch = oom.MemoryWatch(SimpleNamespace(), local_size=1)
        watch.sample()
        assert watch.last[child.pid] >= 200 * 2**20
        assert watch.total_with[child.pid] >= watch.last[child.pid]
    finally:
        child.kill()
        child.wait()


def test_the_kernels_counts_and_limits_are_readable_here():
    """Linux: the cgroup counts OOM kills, or /proc/vmstat where none does (it counts every
    container of the node: never beside a cgroup's count); /proc/meminfo or a cgroup gives the
    limit."""
    kills = oom.oom_kills()
    cgroups = [path for path in kills if path.startswith("/sys/fs/cgroup")]
    assert kills and (
        list(kills) == ["/proc/vmstat"] if not cgroups else "/proc/vmstat" not in kills
    )
    limit, what = oom.memory_limit()
    assert limit > 2**27 and what in ("this machine has", "its cgroup (container) allows")


# torch's keep-alive timer dropped in its own thread: the handler it serves, gone in the timer's
# last call, takes it along, and its finalizer joins the thread it runs in (as a launch stopped
# while its workers start ended, 1 run in 13 here). Then an unraisable error of another kind.
TIMER_RACE = """
import gc, sys, threading, time, weakref
from datetime import timedelta
from torch.distributed.elastic.rendezvous.utils import _PeriodicTimer
from ddp_project import launch
if sys.argv[1] == "hooked":
    sys.unraisablehook = launch.timer_joined_from_itself
holder, done = [], threading.Event()

def last_call():
    holder.clear()  # the timer's last reference goes, in the timer's thread
    gc.collect()
    done.set()

holder.append(_PeriodicTimer(timedelta(seconds=0.01), last_call))
holder[0].start()
done.wait(30)
time.sleep(0.5)

class Other:
    pass

weakref.finalize(other := Other(), lambda: 1 / 0)
del other
gc.collect()
print("done", flush=True)
"""


@pytest.mark.parametrize("hook", ["hooked", "python's"])
def test_torchs_timer_joined_from_its_own_thread_prints_nothing_and_other_errors_still_do(hook):
    done = subprocess.run(
        [sys.executable, "-c", TIMER_RACE, hook], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr[-3000:]
    assert ("cannot join current thread" in done.stderr) == (hook != "hooked")
    assert "ZeroDivisionError" in done.stderr  # not the timer's: Python's hook prints it


# What only a worker needs: the launcher's checks must not import it (seconds in every launch).
WORKERS_ONLY = ("torch._dynamo", "torch.distributed.tensor", f"{PACKAGE}.run.checkpoint")


def test_the_launchers_checks_import_nothing_only_a_worker_needs(tmp_path):
    """Composing, checking the config (the optimizer's class and keywords too) and the run dir of
    a resume, in a fresh process as the command runs them: none of dynamo (building an
    optimizer imports it), DTensor or the checkpoint formats."""
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    (run / "step_000000010.pt").write_bytes(b"a resume's checkpoint: the workers read it")
    probe = (
        f"import sys; from {PACKAGE} import launch; from {PACKAGE}.core.world import World; "
        "launch.checked(['optimizer=sgd', 'hydra.run.dir=run'], World(size=2, local_size=2)); "
        f"print([name for name in {WORKERS_ONLY!r} if name in sys.modules])"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"

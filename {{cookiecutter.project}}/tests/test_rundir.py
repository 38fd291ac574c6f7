"""The run dir: one run at a time, a resume that continues the same experiment, a directory that
can be written; each refusal one line, with nothing in the run dir changed."""

import json
import os
import shutil
import socket
import subprocess
import sys

import conftest
import pytest
import torch
from conftest import (
    PACKAGE,
    launch_command,
    no_torchrun,
    read_metrics,
    shared_folder,
    wait_for_metrics,
)
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict

from ddp_project import launch as launcher
from ddp_project.config import compose as check
from ddp_project.config.schema import register_configs
from ddp_project.core.world import World
from ddp_project.run import checkpoint, rundir

pytestmark = pytest.mark.usefixtures("launcher_state")  # conftest.py


# One process per launch: what is checked here does not depend on the world size, and each
# process saved is seconds of CPU.


def launch(cwd, *args: str) -> subprocess.CompletedProcess:
    return conftest.launch(cwd, "--nproc-per-node", "1", *args)


def train_alone(cwd, *overrides: str) -> subprocess.CompletedProcess:
    """`python -m <package>.train`: the worker's own checks (RunDirGuard) without the launcher's,
    in one process (under torchrun each worker runs the same; the agent would add seconds)."""
    return subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", *overrides],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )


def launcher_refusal(cwd, monkeypatch, capsys, *overrides: str) -> tuple[int, str]:
    """`<project> train --nproc-per-node 1 <overrides>` in this process, where the launcher
    refuses before torchrun starts: (its exit code, its stderr)."""
    monkeypatch.chdir(cwd)
    no_torchrun(monkeypatch)
    capsys.readouterr()
    code = launcher.main(["train", "--nproc-per-node", "1", *overrides])
    return code, capsys.readouterr().err


def resume_refusal(cwd, *overrides: str) -> tuple[int, str]:
    """`<project> train --nproc-per-node 1 <overrides>` refusing a resume: the worker's first
    line (the launcher does not read checkpoints: their formats are a worker's imports), with
    the launcher adding nothing: (the exit code, stderr)."""
    done = launch(cwd, "--nproc-per-node", "1", *overrides)
    return done.returncode, done.stderr


def one_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def snapshot(run_dir) -> dict:
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


@pytest.mark.slow  # a second launch while the first trains
@pytest.mark.timeout(300)
def test_a_second_launch_into_a_busy_run_dir_is_refused_and_changes_nothing(
    tmp_path, monkeypatch, capsys
):
    first = subprocess.Popen(
        launch_command(
            "--nproc-per-node",
            "1",
            "trainer.max_steps=100000000",
            "trainer.log_every=5",
            "hydra.run.dir=run",
        ),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_metrics(first, tmp_path / "run")
        hydra_files = {p.name: p.read_bytes() for p in (tmp_path / "run" / ".hydra").iterdir()}
        holder = json.loads((tmp_path / "run" / ".lock").read_text())
        expected = (
            f"config error: hydra.run.dir=run: in use by pid {holder['pid']} "
            f"on {socket.gethostname()}"
        )
        code, said = launcher_refusal(  # the launcher's check, in this process
            tmp_path, monkeypatch, capsys, "trainer.max_steps=50", "hydra.run.dir=run"
        )
        assert code == 2 and expected in said
        second = train_alone(tmp_path, "trainer.max_steps=50", "hydra.run.dir=run")  # the worker's
        assert second.returncode != 0
        assert expected in second.stderr and f"{PACKAGE}/" not in second.stderr  # no traceback
        assert {
            p.name: p.read_bytes() for p in (tmp_path / "run" / ".hydra").iterdir()
        } == hydra_files
        steps = [row["step"] for row in read_metrics(tmp_path / "run")]
        assert steps == sorted(set(steps))  # one run's rows, in order, none twice
    finally:
        first.kill()
        first.communicate(timeout=60)


DEAD = {"host": socket.gethostname(), "pid": 2**22 + 17, "since": 0, "command": "killed"}


@pytest.fixture(scope="module")
def trained_once(request):
    """Trained in run/ for 10 steps with a checkpoint there, by a launch that found the lock of a
    run that died (DEAD) in run/."""
    cwd = shared_folder(request)
    (cwd / "run").mkdir()
    (cwd / "run" / ".lock").write_text(json.dumps(DEAD))
    done = launch(cwd, "trainer.max_steps=10", "trainer.checkpoint_every=10", "hydra.run.dir=run")
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd


def test_the_lock_of_a_run_that_died_is_taken_over(trained_once):
    assert read_metrics(trained_once / "run")[-1]["step"] == 10  # the launch ran
    assert json.loads((trained_once / "run" / ".lock").read_text())["pid"] != DEAD["pid"]


@pytest.fixture
def trained(trained_once, tmp_path):
    """A folder holding run/, trained for 10 steps with a checkpoint there; each test's own copy."""
    shutil.copytree(trained_once / "run", tmp_path / "run")
    return tmp_path


def test_a_resume_that_would_change_results_is_refused_listing_every_difference(trained):
    before = snapshot(trained / "run")
    code, said = resume_refusal(
        trained,
        "trainer.max_steps=20",
        "trainer.seed=1",
        "data.batch_size=64",
        "hydra.run.dir=run",
    )
    assert code == 2
    assert said.splitlines() == [
        "config error: hydra.run.dir=run resumes from step_000000010.pt, written with another "
        "config: data.batch_size 128 -> 64, trainer.seed 0 -> 1. These change results; to continue "
        "anyway add trainer.accept_changes=[data.batch_size,trainer.seed], or choose another "
        "hydra.run.dir"
    ]
    assert snapshot(trained / "run") == before  # the lock's holder too


def test_an_accepted_change_resumes_with_it_and_what_does_not_change_results_may_change(
    trained, monkeypatch
):
    """Only trainer.lr is accepted: the other keys changed here change no result, and need
    not be."""
    done = launch(
        trained,
        "trainer.max_steps=20",
        "trainer.lr=0.001",
        "trainer.accept_changes=[trainer.lr]",
        "trainer.log_every=5",
        "trainer.checkpoint_every=5",
        "trainer.keep_checkpoints=4",
        "data.num_workers=1",
        "hydra.run.dir=run",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from the checkpoint of step 10" in done.stdout
    assert [row["lr"] for row in read_metrics(trained / "run")][-1] == pytest.approx(0.001)
    # The newest checkpoint carries the new lr: the launcher (in this process) starts the next
    # resume without an accept list; the workers check it with the same resume_problem.
    started = []
    monkeypatch.chdir(trained)
    monkeypatch.setattr(launcher, "run", started.append)
    assert (
        launcher.main(
            [
                "train",
                "--nproc-per-node",
                "1",
                "trainer.max_steps=30",
                "trainer.lr=0.001",
                "hydra.run.dir=run",
            ]
        )
        == 0
    )
    assert len(started) == 1
    assert (
        rundir.resume_problem(
            trained / "run",
            check.compose_and_check(["trainer.max_steps=30", "trainer.lr=0.001"]),
            World(),
        )
        is None
    )


def test_an_accept_list_naming_no_key_is_refused(trained, monkeypatch, capsys):
    code, said = launcher_refusal(
        trained,
        monkeypatch,
        capsys,
        "trainer.max_steps=20",
        "trainer.accept_changes=[trainer.lrr]",
        "hydra.run.dir=run",
    )
    assert code == 2
    (line,) = said.splitlines()
    assert line.startswith(
        "config error: trainer.accept_changes: trainer.lrr is no key of the config"
    )


def test_a_resume_under_other_options_is_refused_naming_both(trained):
    before = snapshot(trained / "run")
    code, said = resume_refusal(
        trained,
        "trainer.max_steps=20",
        "model=gpt",
        "data=tokens",
        "hydra.run.dir=run",
    )
    assert code == 2
    assert said.splitlines() == [
        "config error: data=tokens, model=gpt: the checkpoint in run (step_000000010.pt) was "
        "trained with data=synthetic, model=mlp; resume with data=synthetic, model=mlp, add "
        "trainer.accept_changes=[data,model] to switch, or choose another hydra.run.dir"
    ]
    # the worker alone (python -m <package>.train) refuses the switch it was not told to accept
    direct = train_alone(
        trained,
        "trainer.max_steps=20",
        "model=gpt",
        "data=tokens",
        "trainer.accept_changes=[data]",
        "hydra.run.dir=run",
    )
    assert direct.returncode != 0
    assert (
        "config error: model=gpt: the checkpoint in run (step_000000010.pt) was trained with "
        "model=mlp; resume with model=mlp, add trainer.accept_changes=[model] to switch"
        in direct.stderr
    )
    assert snapshot(trained / "run") == before


def test_a_checkpoint_that_records_no_options_resumes_as_the_options_its_keys_fit(trained):
    """Written before checkpoints recorded their options: model=mlp's and data=synthetic's keys
    are no other option's."""
    path = checkpoint.checkpoint_paths(trained / "run")[-1]
    state = checkpoint.read(path)
    assert state.pop("options") == {"data": "synthetic", "model": "mlp"}
    torch.save(state, path)
    same = check.compose_and_check(["trainer.max_steps=20"])
    assert rundir.resume_problem(trained / "run", same, World()) is None
    other = check.compose_and_check(["trainer.max_steps=20", "model=gpt", "data=tokens"])
    assert rundir.resume_problem(trained / "run", other, World()).startswith(
        f"data=tokens, model=gpt: the checkpoint in {trained / 'run'} (step_000000010.pt) was "
        "trained with data=synthetic, model=mlp; "
    )


def test_a_checkpoint_of_another_shape_is_one_line(trained):
    before = snapshot(trained / "run")
    done = launch(
        trained,
        "trainer.max_steps=20",
        "model.hidden_dim=64",
        "trainer.accept_changes=[model.hidden_dim]",
        "hydra.run.dir=run",
    )
    assert done.returncode == 2
    line = one_line(done)
    assert line.startswith("config error: step_000000010.pt does not fit this run's model: ")
    assert "size mismatch" in line and line.endswith("or choose another hydra.run.dir")
    assert {k: v for k, v in snapshot(trained / "run").items() if k.parts[0] == "checkpoints"} == {
        k: v for k, v in before.items() if k.parts[0] == "checkpoints"
    }


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda tmp: (tmp / "a-file").write_text("x") and "a-file",
            "hydra.run.dir=a-file: is a file, not a directory",
        ),
        (
            lambda tmp: "/proc/1/no-such-dir/run",
            "hydra.run.dir=/proc/1/no-such-dir/run: cannot be created",
        ),
    ],
    ids=["a file", "unwritable"],
)
def test_an_unusable_run_dir_is_one_line(tmp_path, monkeypatch, capsys, make, message):
    run_dir = make(tmp_path)
    code, said = launcher_refusal(tmp_path, monkeypatch, capsys, f"hydra.run.dir={run_dir}")
    assert code == 2 and f"config error: {message}" in said  # the launcher's check
    done = train_alone(tmp_path, f"hydra.run.dir={run_dir}")  # the worker's own
    assert done.returncode != 0
    assert f"config error: {message}" in done.stderr
    assert f"{PACKAGE}/" not in done.stderr  # no traceback through the project's code
    if os.geteuid() != 0:
        assert not (tmp_path / "outputs").exists()


def test_a_resume_below_the_checkpoints_step_is_refused_before_any_step(trained):
    """trainer.max_steps=5 on a run at step 10 ended at once, looking resumed."""
    before = snapshot(trained / "run")
    code, said = resume_refusal(trained, "trainer.max_steps=5", "hydra.run.dir=run")
    assert code == 2
    assert said.splitlines() == [
        "config error: trainer.max_steps=5 is below step 10 of the checkpoint in run "
        "(step_000000010.pt): raise trainer.max_steps, or choose another hydra.run.dir"
    ]
    assert snapshot(trained / "run") == before


def test_a_resume_to_the_checkpoints_own_step_is_allowed(trained):
    """A finished run relaunched as it was (a Job's pod restarted after the end) is no error."""
    same = check.compose_and_check(["trainer.max_steps=10"])
    assert rundir.resume_problem(trained / "run", same, World()) is None
    assert "below step 10" in rundir.resume_problem(
        trained / "run", check.compose_and_check(["trainer.max_steps=9"]), World()
    )


def test_the_launcher_refuses_a_run_dir_another_process_holds(tmp_path):
    """In this process: the launcher's own check, before any worker's."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from {PACKAGE}.run import rundir; from pathlib import Path; "
            f"rundir.acquire(Path({str(tmp_path / 'run')!r})); print(flush=True); "
            "import time; time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    (tmp_path / "run").mkdir()
    try:
        holder.stdout.readline()
        problem = rundir.launch_problem(tmp_path / "run")
        free = rundir.launch_problem(tmp_path / "run", busy=False)
    finally:
        holder.kill()
        holder.wait()
    assert problem.startswith(f"hydra.run.dir={tmp_path / 'run'}: in use by pid {holder.pid}")
    assert free is None  # several nodes: the workers' guard decides
    assert rundir.launch_problem(tmp_path / "run") is None  # its holder is gone


@pytest.mark.parametrize(
    ("entries", "line"),
    [
        (
            "[nope]",
            "trainer.accept_changes: nope is no key of the config; allowed: a group (model,",
        ),
        (
            "[trainer.lrr]",
            "trainer.accept_changes: trainer.lrr is no key of the config; did you mean trainer.lr?",
        ),
        ("['']", "trainer.accept_changes: '' is no key of the config;"),
    ],
)
def test_an_accept_list_naming_no_key_is_refused_without_a_checkpoint_too(entries, line):
    assert check.config_problem([f"trainer.accept_changes={entries}"]).startswith(line)


@pytest.mark.parametrize(
    "entries", ["[trainer.lr]", "[model]", "[model.n_layer,data]", "[nccl.env]"]
)
def test_accept_changes_takes_keys_and_groups_of_the_schema(entries):
    """A group accepts each key in it; model.n_layer is a key of model=gpt, for a resume that
    switches from model=mlp."""
    assert check.config_problem([f"trainer.accept_changes={entries}"]) is None


def test_an_accepted_group_accepts_each_key_in_it(trained):
    saved = checkpoint.read(checkpoint.checkpoint_paths(trained / "run")[-1])["config"]
    config = check.compose_and_check(["trainer.seed=1", "trainer.lr=0.1"])
    assert [key for key, _, _ in rundir.changes_on_resume(saved, config)] == [
        "trainer.lr",
        "trainer.seed",
    ]
    config.trainer.accept_changes = ["trainer"]
    assert rundir.changes_on_resume(saved, config) == []


def sweep_command(*overrides: str) -> list[str]:
    """`python -m <package>.train -m ...`: Hydra's sweep, one process, no torchrun."""
    return [sys.executable, "-m", f"{PACKAGE}.train", "-m", *overrides]


def sweep(cwd, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        sweep_command(
            "experiment=smoke", "trainer.checkpoint_every=5", "hydra.sweep.dir=sweep", *overrides
        ),
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # one thread, as torchrun gives
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def swept(request):
    """A sweep of one job, 5 steps with a checkpoint, in sweep/0."""
    cwd = shared_folder(request)
    done = sweep(cwd, "trainer.lr=0.001", "trainer.max_steps=5")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (cwd / "sweep" / "0" / "checkpoints" / "step_000000005.pt").exists()
    return cwd


@pytest.mark.timeout(300)
def test_a_sweep_that_would_change_results_is_refused_like_a_run(swept, tmp_path):
    """The second sweep resumed from the first's checkpoints under another config, silently."""
    shutil.copytree(swept / "sweep", tmp_path / "sweep")
    before = snapshot(tmp_path / "sweep")
    done = sweep(tmp_path, "trainer.lr=0.5", "data.batch_size=64", "trainer.max_steps=12")
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if not line.startswith("[")]  # Hydra's
    assert lines == [
        f"config error: hydra.sweep.dir=sweep job 0 ({tmp_path / 'sweep' / '0'}) resumes from "
        "step_000000005.pt, written with another config: data.batch_size 128 -> 64, trainer.lr "
        "0.001 -> 0.5. These change results; to continue anyway add "
        "trainer.accept_changes=[data.batch_size,trainer.lr], or choose another hydra.sweep.dir"
    ]
    assert snapshot(tmp_path / "sweep") == before  # Hydra's files of the job dir put back


def sweep_job_config(sweep_dir, job: int):
    """The config Hydra hands a sweep's job to its callbacks (hydra.runtime set as
    run_job sets it)."""
    register_configs()
    with initialize_config_module(config_module=f"{PACKAGE}.configs", version_base="1.3"):
        cfg = compose(
            config_name="train",
            return_hydra_config=True,
            overrides=[f"hydra.sweep.dir={sweep_dir}", "hydra.mode=MULTIRUN"],
        )
    with open_dict(cfg):
        cfg.hydra.job.num = job
        cfg.hydra.runtime.output_dir = str(sweep_dir / str(job))
    return cfg


def test_a_sweep_job_holds_its_dirs_lock_while_it_runs(tmp_path, capsys):
    """In this process: the guard's job hooks as Hydra calls them (the sweep tests above show
    that it does). Job 0 holds sweep/0 until it ends; another process is refused meanwhile."""
    guard = rundir.RunDirGuard()
    config = sweep_job_config(tmp_path / "sweep", 0)
    guard.on_multirun_start(config)
    guard.on_job_start(config)
    other = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from {PACKAGE}.run import rundir; from pathlib import Path; "
            f"rundir.acquire(Path({str(tmp_path / 'sweep' / '0')!r}), wait_s=0)",
        ],
        capture_output=True,
        text=True,
    )
    assert other.returncode != 0 and f"in use by pid {os.getpid()}" in other.stderr
    guard.on_job_end(config)  # the next job, or another sweep, may use it now
    assert tmp_path / "sweep" / "0" not in rundir._held
    guard.on_job_start(config)  # and this process can take it again
    guard.on_job_end(config)


def test_a_sweep_job_whose_dir_is_in_use_is_refused(tmp_path, capsys):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from {PACKAGE}.run import rundir; from pathlib import Path; "
            f"rundir.acquire(Path({str(tmp_path / 'sweep' / '0')!r})); print(flush=True); "
            "import time; time.sleep(120)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    (tmp_path / "sweep" / "0").mkdir(parents=True)
    try:
        holder.stdout.readline()  # it holds the lock
        config = sweep_job_config(tmp_path / "sweep", 0)
        with pytest.raises(SystemExit) as stop:
            rundir.RunDirGuard().on_job_start(config)
    finally:
        holder.kill()
        holder.wait()
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(
        f"config error: hydra.sweep.dir={tmp_path / 'sweep'} job 0 ({tmp_path / 'sweep' / '0'}): "
        f"in use by pid {holder.pid}"
    )


def test_a_sweep_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "sweep").write_text("x")
    with pytest.raises(SystemExit) as stop:
        rundir.RunDirGuard().on_multirun_start(sweep_job_config(tmp_path / "sweep", 0))
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"config error: hydra.sweep.dir={tmp_path / 'sweep'}: is a file, not a directory; choose "
        "another hydra.sweep.dir\n"
    )


@pytest.mark.parametrize(
    ("make", "override", "line"),
    [
        (
            lambda tmp: (tmp / "run" / ".lock").mkdir(parents=True),
            "hydra.run.dir=run",
            "config error: hydra.run.dir=run: its lock file .lock cannot be opened (Is a "
            "directory); remove it if no run uses that dir, or choose another hydra.run.dir",
        ),
        (
            lambda tmp: None,
            "hydra.run.dir=''",  # Hydra reads it as ".": the run would write into the launch dir
            "config error: hydra.run.dir='': empty; name a directory, or leave hydra.run.dir out "
            "for a new one under outputs/",
        ),
        (
            lambda tmp: None,
            f"hydra.run.dir={'x' * 300}",
            f"config error: hydra.run.dir={'x' * 300}: cannot be created (File name too long)",
        ),
    ],
    ids=["lock is a dir", "empty", "name too long"],
)
def test_a_hostile_run_dir_is_one_line(tmp_path, monkeypatch, capsys, make, override, line):
    """Each gave a traceback (IsADirectoryError, OSError) or ran in the launch dir itself."""
    monkeypatch.chdir(tmp_path)
    make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    no_torchrun(monkeypatch)
    assert launcher.main(["train", "--nproc-per-node", "1", override]) == 2
    assert capsys.readouterr().err.splitlines() == [line]
    assert sorted(tmp_path.rglob("*")) == before


def test_the_workers_guard_refuses_a_lock_it_cannot_open(tmp_path, capsys):
    """torchrun without the launcher: the guard's own line, not IsADirectoryError."""
    (tmp_path / "run" / ".lock").mkdir(parents=True)
    config = OmegaConf.create({"hydra": {"run": {"dir": str(tmp_path / "run")}}})
    with pytest.raises(SystemExit) as stop:
        rundir.RunDirGuard().on_run_start(config)  # as Hydra calls it
    assert stop.value.code == 2
    assert "its lock file .lock cannot be opened (Is a directory)" in capsys.readouterr().err


def test_the_keys_a_resume_may_change_and_evaluate_may_set_are_the_schemas_marked_fields():
    """Marked in config/schema.py and config/options.py (field metadata), read by rundir and
    evaluate: no list beside it."""
    from ddp_project import evaluate
    from ddp_project.run import rundir

    assert sorted(rundir.RESUME_MAY_CHANGE) == [
        "data.num_workers",
        "data.on_device",
        "data.pin_memory",
        "deploy.",
        "dist.activation_checkpointing",
        "dist.async_error_handling",
        "dist.backend",
        "dist.bucket_cap_mb",
        "dist.checkpoint_timeout_s",
        "dist.gate_timeout_s",
        "dist.gradient_as_bucket_view",
        "dist.static_graph",
        "dist.strategy",
        "dist.time_comm",
        "dist.timeout_s",
        "logger.",
        "nccl.",
        "profile.",  # what is recorded, not what is trained
        "trainer.accept_changes",
        "trainer.async_checkpoint",
        "trainer.checkpoint_every",
        "trainer.checkpoint_format",
        "trainer.keep_best",
        "trainer.keep_checkpoints",
        "trainer.log_every",
        "trainer.max_steps",
        "trainer.on_nonfinite",
        "trainer.patience",
        "trainer.val_batches",
        "trainer.val_every",
    ]
    adjustable = evaluate.ADJUSTABLE
    assert adjustable == ("data.batch_size", "data.num_workers", "data.pin_memory", "dist.backend")

"""The run dir: one run at a time, a resume that continues the same experiment, a directory that
can be written; each refusal one line, with nothing in the run dir changed."""

import json
import os
import shutil
import socket
import subprocess

import conftest
import pytest
from conftest import PACKAGE, launch_command, read_metrics, shared_folder, wait_for_metrics

# One process per launch: what is checked here does not depend on the world size, and each
# process saved is seconds of CPU.


def launch(cwd, *args: str) -> subprocess.CompletedProcess:
    return conftest.launch(cwd, "--nproc-per-node", "1", *args)


def torchrun(cwd, *overrides: str) -> subprocess.CompletedProcess:
    return conftest.torchrun(cwd, *overrides, nproc=1)


def one_line(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def snapshot(run_dir) -> dict:
    return {
        p.relative_to(run_dir): p.read_bytes()
        for p in run_dir.rglob("*")
        if p.is_file() and p.name != ".lock"
    }


@pytest.mark.timeout(300)
def test_a_second_launch_into_a_busy_run_dir_is_refused_and_changes_nothing(tmp_path):
    first = subprocess.Popen(
        launch_command("--nproc-per-node", "1", "trainer.max_steps=100000000", "trainer.log_every=5",
                       "hydra.run.dir=run"),  # fmt: skip
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_metrics(first, tmp_path / "run")
        hydra_files = {p.name: p.read_bytes() for p in (tmp_path / "run" / ".hydra").iterdir()}
        holder = json.loads((tmp_path / "run" / ".lock").read_text())
        expected = f"config error: hydra.run.dir=run: in use by pid {holder['pid']} on {socket.gethostname()}"
        for second in (
            launch(tmp_path, "trainer.max_steps=50", "hydra.run.dir=run"),  # the launcher's check
            torchrun(tmp_path, "trainer.max_steps=50", "hydra.run.dir=run"),  # the workers' own
        ):
            assert second.returncode != 0
            assert (
                expected in second.stderr and f"{PACKAGE}/" not in second.stderr
            )  # no traceback of ours
        assert {
            p.name: p.read_bytes() for p in (tmp_path / "run" / ".hydra").iterdir()
        } == hydra_files
        steps = [row["step"] for row in read_metrics(tmp_path / "run")]
        assert steps == sorted(set(steps))  # one run's rows, in order, none twice
    finally:
        first.kill()
        first.communicate(timeout=60)


def test_the_lock_of_a_run_that_died_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    dead = {"host": socket.gethostname(), "pid": 2**22 + 17, "since": 0, "command": "killed"}
    (run_dir / ".lock").write_text(json.dumps(dead))
    done = launch(tmp_path, "trainer.max_steps=5", "hydra.run.dir=run")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run_dir / ".lock").read_text())["pid"] != dead["pid"]


@pytest.fixture(scope="module")
def trained_once(request):
    cwd = shared_folder(request)
    done = launch(cwd, "trainer.max_steps=10", "trainer.checkpoint_every=10", "hydra.run.dir=run")
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd


@pytest.fixture
def trained(trained_once, tmp_path):
    """A folder holding run/, trained for 10 steps with a checkpoint there; each test's own copy."""
    shutil.copytree(trained_once / "run", tmp_path / "run")
    return tmp_path


def test_a_resume_that_would_change_results_is_refused_listing_every_difference(trained):
    before = snapshot(trained / "run")
    done = launch(
        trained, "trainer.max_steps=20", "trainer.seed=1", "data.batch_size=64", "hydra.run.dir=run"
    )
    assert done.returncode == 2
    assert one_line(done) == (
        "config error: hydra.run.dir=run resumes from step_000000010.pt, written with another "
        "config: data.batch_size 128 -> 64, trainer.seed 0 -> 1. These change results; to continue "
        "anyway add trainer.accept_changes=[data.batch_size,trainer.seed], or choose another "
        "hydra.run.dir"
    )
    assert snapshot(trained / "run") == before
    # the workers refuse it too, when launched by torchrun without the launcher
    direct = torchrun(trained, "trainer.max_steps=20", "trainer.seed=1", "hydra.run.dir=run")
    assert direct.returncode != 0 and "trainer.seed 0 -> 1" in direct.stderr
    assert snapshot(trained / "run") == before


def test_a_resume_may_change_what_does_not_change_results(trained):
    done = launch(trained, "trainer.max_steps=20", "trainer.log_every=5", "trainer.checkpoint_every=5",
                  "trainer.keep_checkpoints=4", "data.num_workers=1", "hydra.run.dir=run")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from the checkpoint of step 10" in done.stdout


def test_an_accepted_change_resumes_with_it(trained):
    done = launch(trained, "trainer.max_steps=20", "trainer.lr=0.001", "trainer.accept_changes=[trainer.lr]",
                  "hydra.run.dir=run")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["lr"] for row in read_metrics(trained / "run")][-1] == pytest.approx(0.001)
    again = launch(trained, "trainer.max_steps=30", "trainer.lr=0.001", "hydra.run.dir=run")
    assert again.returncode == 0, again.stderr[-3000:]  # the newest checkpoint carries the new lr


def test_an_accept_list_naming_no_key_is_refused(trained):
    done = launch(
        trained, "trainer.max_steps=20", "trainer.accept_changes=[trainer.lrr]", "hydra.run.dir=run"
    )
    assert done.returncode == 2
    assert one_line(done).startswith(
        "config error: trainer.accept_changes: trainer.lrr is no key of the config"
    )


def test_a_checkpoint_of_another_shape_is_one_line(trained):
    before = snapshot(trained / "run")
    done = launch(trained, "trainer.max_steps=20", "model.hidden_dim=64",
                  "trainer.accept_changes=[model.hidden_dim]", "hydra.run.dir=run")  # fmt: skip
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
def test_an_unusable_run_dir_is_one_line(tmp_path, make, message):
    run_dir = make(tmp_path)
    for done in (
        launch(tmp_path, f"hydra.run.dir={run_dir}"),
        torchrun(tmp_path, f"hydra.run.dir={run_dir}"),
    ):
        assert done.returncode != 0
        assert f"config error: {message}" in done.stderr
        assert f"{PACKAGE}/" not in done.stderr  # no traceback through the project's code
    if os.geteuid() != 0:
        assert not (tmp_path / "outputs").exists()

"""The rendered project works as its image runs it: installed non-editably, launched elsewhere."""

import json
import os
import signal
import subprocess
import sys
import time
from xml.etree import ElementTree

import pytest
from conftest import RENDERS, env_with_path, files_of

# The only skip a machine without 2 GPUs may show: the tests marked gpu.
GPU_SKIP = "needs 2 CUDA devices"


def stream(run, title: str, capsys) -> str:
    """A background suite's lines on the terminal, those already written at once, then each as
    its test ends; the whole output once its process has ended."""
    process = run.process
    output = []
    try:
        with capsys.disabled(), run.output.open() as lines:
            print(f"\n--- {title} ---", flush=True)
            while True:
                start, running = lines.tell(), process.poll() is None
                line = lines.readline()
                if line.endswith("\n") or (line and not running):
                    output.append(line)
                    print("    " + line, end="", flush=True)
                elif running:  # nothing new, or half a line: wait for the rest
                    lines.seek(start)
                    time.sleep(0.2)
                else:
                    break
    finally:
        if process.poll() is None:  # the timeout: nothing it started outlives this test
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return "".join(output)


def outcomes(run) -> tuple[list[str], dict[str, str]]:
    """(every test case's name, each skipped one's -> why), from the junit report."""
    found, skipped = [], {}
    for case in ElementTree.parse(run.report).getroot().iter("testcase"):
        found.append(name := f"{case.get('classname')}.{case.get('name')}")
        for skip in case.findall("skipped"):
            skipped[name] = skip.get("message", "")
    return found, skipped


def changed_files(run) -> list[str]:
    """What the suite changed in the project: a user's `make test` leaves it as it was, with no
    config rewritten and no stray files."""
    after = files_of(run.project)
    return sorted(name for name in after.keys() | run.before.keys()
                  if after.get(name) != run.before.get(name))  # fmt: skip


def suite_passed(generated_suite, capsys) -> None:
    """The Quick start's `make test` (or `make test-full`) on its editable install, running
    from the session's start (conftest.generated_suite): it passes, skips only what needs a GPU,
    and leaves the project as it was."""
    output = stream(generated_suite, f"the generated project's tests (make {generated_suite.target})", capsys)
    assert generated_suite.process.returncode == 0, output[-20000:]
    _, skipped = outcomes(generated_suite)
    assert {name: why for name, why in skipped.items() if GPU_SKIP not in why} == {}
    assert changed_files(generated_suite) == []


@pytest.mark.timeout(1500)  # the README's testing section says how long it takes
def test_generated_projects_fast_tier_passes(generated_suite, capsys):
    suite_passed(generated_suite, capsys)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_generated_projects_full_tier_passes(generated_suite, capsys):
    suite_passed(generated_suite, capsys)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("render_id", RENDERS)
def test_each_render_passes_the_tests_that_depend_on_it(render_suites, render_id, capsys):
    """Each of RENDERS' `pytest -m render`, installed non-editably, running from the session's
    start (conftest.render_suites): config, check, k8s and project files, and its own
    manifest's launch line trained on two nodes. None fails or skips."""
    run = render_suites.run(render_id)
    assert run.error is None, run.error
    output = stream(run, f"{render_id}: pytest -m render", capsys)
    assert run.process.returncode == 0, output[-20000:]
    found, skipped = outcomes(run)
    assert skipped == {}
    modules = {name.split(".")[1] for name in found}  # tests.<module>.<test>
    assert modules == {"test_config", "test_check", "test_k8s", "test_project_files", "test_multinode"}
    flavor = RENDERS[render_id]["k8s_flavor"]
    trained = [name for name in found if ".test_the_manifests_launch_line_trains_on_two_nodes" in name]
    assert trained == [f"tests.test_multinode.test_the_manifests_launch_line_trains_on_two_nodes[{flavor}]"]
    assert changed_files(run) == []


def test_torchrun_trains_from_another_directory(installed_default, tmp_path):
    """The README's launch line, from a directory that holds no configs."""
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ddp_project.train", "trainer.max_steps=200"],
        cwd=tmp_path, env=env_with_path(installed_default), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").iterdir()
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 200 and rows[-1]["world_size"] == 2
    assert rows[-1]["loss"] < 0.7 * rows[0]["loss"]
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]
    log = (run_dir / "train.log").read_text()
    assert "NCCL environment" not in log and "TORCH_NCCL" not in log  # over gloo: no NCCL table
    assert f"ddp-project run {run_dir.name}: world size 2, backend gloo" in log


def test_plain_python_runs_a_group_of_one(installed_default, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "ddp_project.train", "trainer.max_steps=5", "hydra.run.dir=run"],
        cwd=tmp_path, env=env_with_path(installed_default), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size 1, backend gloo" in (tmp_path / "run" / "train.log").read_text()

"""The rendered project works as its image runs it: installed non-editably, launched elsewhere."""

import json
import os
import signal
import subprocess
import sys
import time
from xml.etree import ElementTree

import pytest
from conftest import env_with_path, files_of

# The only skip a machine without 2 GPUs may show: the tests marked gpu.
GPU_SKIP = "needs 2 CUDA devices"


@pytest.mark.timeout(1500)  # the README's testing section says how long it takes
def test_generated_projects_own_tests_pass_and_skip_only_gpu_tests(generated_suite, capsys):
    """The suite runs from the session's start (conftest.generated_suite); its lines stream to
    the terminal here, those already written at once, then each as its test ends."""
    process = generated_suite.process
    output = []
    try:
        with capsys.disabled(), generated_suite.output.open() as lines:
            print("\n--- the generated project's tests ---", flush=True)
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
    assert process.wait() == 0, "".join(output[-200:])
    cases = ElementTree.parse(generated_suite.report).getroot().iter("testcase")
    skipped = {
        f"{case.get('classname')}.{case.get('name')}": skip.get("message", "")
        for case in cases
        for skip in case.findall("skipped")
    }
    unexpected = {name: why for name, why in skipped.items() if GPU_SKIP not in why}
    assert unexpected == {}, unexpected
    # make test leaves the user's project as it was: no config rewritten, no stray files
    after = files_of(generated_suite.project)
    changed = sorted(name for name in after.keys() | generated_suite.before.keys()
                     if after.get(name) != generated_suite.before.get(name))  # fmt: skip
    assert changed == []


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

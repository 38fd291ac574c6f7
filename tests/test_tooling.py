"""The template's own code meets the bar it sets for generated projects."""

import subprocess

from conftest import BIN, TEMPLATE

OWN_CODE = ["hooks", "tests", "scripts", "benchmarks/loop-overhead", "local_extensions.py", "new-project"]


def test_own_python_is_ruff_clean():
    for command in (["check"], ["format", "--check"]):
        done = subprocess.run([BIN / "ruff", *command, *OWN_CODE], cwd=TEMPLATE, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_ci_runs_the_readme_test_command():
    readme = (TEMPLATE / "README.md").read_text()
    assert "make test" in readme.split("\n## ")[0]  # among the opening commands
    assert "make test" in (TEMPLATE / ".ci" / "run").read_text()

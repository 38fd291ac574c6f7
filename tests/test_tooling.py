"""The template's own code meets the bar it sets for generated projects."""

import subprocess

from conftest import BIN, TEMPLATE

OWN_CODE = [
    "hooks",
    "tests",
    "scripts",
    "benchmarks/loop-overhead",
    "benchmarks/attention",
    "benchmarks/loss",
    "benchmarks/peer",
    "local_extensions.py",
    "new-project",
]


def test_own_python_is_ruff_clean():
    for command in (["check"], ["format", "--check"]):
        done = subprocess.run([BIN / "ruff", *command, *OWN_CODE], cwd=TEMPLATE, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_ci_runs_the_readme_test_command():
    readme = (TEMPLATE / "README.md").read_text()
    assert "make test" in readme.split("\n## ")[0]  # among the opening commands
    assert "make test" in (TEMPLATE / ".ci" / "run").read_text()
    assert "export NO_SKIPS=1" in (TEMPLATE / ".ci" / "run").read_text()  # a skip fails there


def test_a_skip_fails_where_no_skips_is_set_unless_it_needs_a_gpu(pytester, monkeypatch):
    """tests/no_skips.py, which the conftest loads: in CI, a test that skipped did not run."""
    pytester.makeconftest("from no_skips import pytest_runtest_makereport  # noqa: F401\n")
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture
        def server():
            pytest.skip("no API server")

        def test_needs_a_server(server):
            pass

        @pytest.mark.gpu
        def test_needs_a_gpu():
            pytest.skip("no GPU")
        """
    )
    monkeypatch.delenv("NO_SKIPS", raising=False)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=2)
    monkeypatch.setenv("NO_SKIPS", "1")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1, skipped=1)  # a fixture's skip fails the test's setup
    result.stdout.fnmatch_lines(["*skipped where NO_SKIPS is set: *no API server*"])

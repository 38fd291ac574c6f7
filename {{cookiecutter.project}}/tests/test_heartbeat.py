"""tests/heartbeat.py: a line names the running tests every 30 s, on the
terminal, while the test's own output stays captured."""

import os
import subprocess
import sys
from pathlib import Path

from heartbeat import Heartbeat

HERE = Path(__file__).resolve().parent


def test_the_line_names_each_running_test_with_its_time_once_the_suite_is_quiet():
    beat = Heartbeat(fd=-1, every_s=30)
    beat.quiet_since = 100.0
    beat.pytest_runtest_logstart("test_a.py::test_long")
    beat.running["test_a.py::test_long"] = 90.0
    assert beat.line(now=129.0) is None  # 29 s of quiet
    assert beat.line(now=130.0) == "[heartbeat] still running: test_a.py::test_long (40 s)"
    assert beat.line(now=131.0) is None  # the next one, 30 s on
    assert beat.line(now=160.0) == "[heartbeat] still running: test_a.py::test_long (70 s)"
    beat.pytest_runtest_logfinish("test_a.py::test_long")
    assert (
        beat.line(now=beat.quiet_since + 30) == "[heartbeat] 1 test(s) ended in 30 s; between tests"
    )
    assert (
        beat.line(now=beat.quiet_since + 30)
        == "[heartbeat] no test has ended for 30 s; between tests"
    )
    # Tests that keep ending do not silence it: pytest shows their dots only a full line at a time.
    for _ in range(3):
        beat.pytest_runtest_logstart("t")
        beat.pytest_runtest_logfinish("t")
    beat.pytest_runtest_logstart("test_b.py::test_next")
    beat.running["test_b.py::test_next"] = beat.quiet_since + 28
    assert beat.line(now=beat.quiet_since + 30) == (
        "[heartbeat] 3 test(s) ended in 30 s; still running: test_b.py::test_next (2 s)"
    )
    now = beat.quiet_since + 30
    beat.running = {f"t{i}": now - 100 + i for i in range(6)}
    assert beat.line(now=now).endswith("t3 (97 s) and 2 more")


def test_a_quiet_test_gets_a_heartbeat_on_the_terminal_while_its_output_stays_captured(tmp_path):
    """pytest's fd capture points fd 1 at a file while a test runs: the line must still reach the
    terminal (here, the pipe pytest was started with)."""
    (tmp_path / "conftest.py").write_text(
        f"import sys; sys.path.insert(0, {str(HERE)!r})\n"
        "from heartbeat import Heartbeat, terminal_fd\n\n"
        "def pytest_configure(config):\n"
        "    config.pluginmanager.register(Heartbeat(terminal_fd(), every_s=1), 'heartbeat')\n"
    )
    (tmp_path / "test_quiet.py").write_text(
        "import time\n\ndef test_quiet():\n    print('captured')\n    time.sleep(3)\n"
    )
    env = {
        name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"
    }  # -n, -v...
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "test_quiet.py",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout
    assert "[heartbeat] still running: test_quiet.py::test_quiet (" in done.stdout
    assert "captured" not in done.stdout  # the test's own output: captured, as ever

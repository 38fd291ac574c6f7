"""No silence over a minute: every EVERY_S seconds with no other heartbeat, one line names the
tests still running and for how long. A CI job that kills a silent step, and a person watching a
loaded machine, both see which test is busy rather than a terminal that stopped. Tests that end
do not reset it: pytest holds its progress dots until a line of them is full (72 tests), and a
file of 1.6 s tests ran 116 s without a newline in CI.

conftest.py registers it (pytest_configure); under xdist it runs in the controller, which hears
of every test's start and end from the workers. Its line goes to the terminal pytest started on,
not to the output pytest captures from the running test.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

EVERY_S = 30.0


def terminal_fd() -> int:
    """A descriptor of the terminal pytest started on, taken at pytest_configure: fd 1 is still
    the terminal then, and becomes the capture's file (capture=fd) while each test runs."""
    return os.dup(1)


class Heartbeat:
    def __init__(self, fd: int, every_s: float = EVERY_S) -> None:
        self.fd, self.every_s = fd, every_s
        self.running: dict[str, float] = {}  # nodeid -> when it started
        self.quiet_since = time.monotonic()  # the last heartbeat
        self.ended = 0  # tests ended since then
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.beat, name="heartbeat", daemon=True)

    def pytest_sessionstart(self) -> None:
        self.quiet_since = time.monotonic()
        self.thread.start()

    def pytest_runtest_logstart(self, nodeid: str) -> None:
        with self.lock:
            self.running[nodeid] = time.monotonic()

    def pytest_runtest_logfinish(self, nodeid: str) -> None:
        with self.lock:
            self.running.pop(nodeid, None)
            self.ended += 1

    def pytest_sessionfinish(self) -> None:
        self.done.set()

    def line(self, now: float) -> str | None:
        """The heartbeat's line once EVERY_S have passed since the last one, else None."""
        with self.lock:
            if now - self.quiet_since < self.every_s:
                return None
            self.quiet_since, ended, self.ended = now, self.ended, 0
            running = sorted(self.running.items(), key=lambda item: item[1])
        so_far = f"{ended} test(s) ended in {self.every_s:.0f} s; " if ended else ""
        if not running:
            return (
                f"[heartbeat] {so_far or f'no test has ended for {self.every_s:.0f} s; '}"
                "between tests"
            )
        shown = ", ".join(f"{nodeid} ({now - started:.0f} s)" for nodeid, started in running[:4])
        more = f" and {len(running) - 4} more" if len(running) > 4 else ""
        return f"[heartbeat] {so_far}still running: {shown}{more}"

    def beat(self) -> None:
        while not self.done.wait(1.0):
            text = self.line(time.monotonic())
            if text:
                try:
                    os.write(self.fd, f"\n{text}\n".encode())
                except OSError:  # the terminal went away: nobody to tell
                    return


def register(config: pytest.Config) -> None:
    """From conftest's pytest_configure; not in xdist's workers, whose output nobody sees live."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(Heartbeat(terminal_fd()), "heartbeat")

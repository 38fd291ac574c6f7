"""Stop signals in-process with one CPU process (no process group, or a gloo group of one): how
the ranks agree on the step to stop at, how soon after the signal, and the line of a stop. The
loop's stops (a checkpoint at the stopping step, a stop before the first step) are in
test_trainer.py, whole launches in test_resume.py."""

import signal

import pytest
import torch.distributed as dist

from ddp_project.core.world import World
from ddp_project.run import stopping

ONE = World()


@pytest.fixture
def lone_group():
    """A gloo group of this process alone: the exchange runs for real, with one voice."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def stop_delay(monkeypatch, group, step_times: list[float], signal_at: int) -> float:
    """Seconds, on a fake clock, from a SIGTERM before step `signal_at` (0: the first) of a run
    resumed at step 4000 to the end of the step every rank agrees to stop at."""
    clock, signals = FakeClock(), stopping.StopSignals()
    monkeypatch.setattr(stopping, "time", clock)
    preemption = stopping.Preemption(group, World(size=2), signals)  # the exchange path
    clock.now += 3  # loading the checkpoint, starting the loader: no steps
    resumed = 4000
    assert preemption.start(resumed) is False
    try:
        for i, seconds in enumerate(step_times):
            if i == signal_at:
                signals.signum, signalled = signal.SIGTERM, clock.now
            clock.now += seconds
            if preemption.agreed(resumed + i + 1):
                return clock.now - signalled
    finally:
        preemption.close()
    raise AssertionError("never stopped")


def test_after_a_resume_a_stop_comes_within_two_exchange_periods(monkeypatch, lone_group):
    """The pace counts only steps run in this process: the old one counted every step since 0
    as just done, and after a resume at 4000 put the next exchange thousands of steps away."""
    steady = [0.005] * 5000
    delays = [stop_delay(monkeypatch, lone_group, steady, at) for at in range(0, 1500, 37)]
    assert max(delays) <= 2 * stopping.EXCHANGE_EVERY_S + 0.005


def test_a_slow_or_fast_start_misleads_the_interval_by_little(monkeypatch, lone_group):
    """Step times change as a run warms up (compile, loader workers starting) or as a GPU's
    queue fills: the interval grows at most twofold per exchange, from 1."""
    slow_start = [2.0] * 3 + [0.002] * 5000
    assert stop_delay(monkeypatch, lone_group, slow_start, 0) <= 2 * 2.0  # two slow steps
    after = [stop_delay(monkeypatch, lone_group, slow_start, at) for at in range(3, 1500, 37)]
    assert max(after) <= 2 * stopping.EXCHANGE_EVERY_S + 0.01
    fast_then_slow = [0.0001] * 300 + [0.01] * 3000
    delays = [stop_delay(monkeypatch, lone_group, fast_then_slow, at) for at in range(0, 900, 13)]
    assert max(delays) <= 2.5


def test_a_rank_that_got_no_signal_stops_for_its_peers_and_exits_with_its_code(monkeypatch):
    """Ctrl-C reached rank 1 only: rank 0 stops at the same step, and says and exits as it."""

    class Done:
        def wait(self) -> None:
            pass

    def all_reduce(tensor, op, group=None, async_op=False):  # rank 1 sends SIGINT
        tensor[0] = max(int(tensor[0]), signal.SIGINT)
        return Done() if async_op else None

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    signals = stopping.StopSignals()
    preemption = stopping.Preemption(None, World(rank=0, size=2), signals)
    try:
        assert preemption.start(40) is True
    finally:
        preemption.close()
    assert signals.name == "SIGINT" and signals.exit_code == 130


def test_the_line_of_a_stop_with_nothing_to_save_says_whether_a_step_ran(tmp_path):
    signals = stopping.StopSignals()
    signals.signum, signals.run_dir = signal.SIGINT, tmp_path
    assert signals.stopped_line() == (
        "SIGINT: stopped before the first step, nothing new to save; "
        f"to go on, relaunch with hydra.run.dir={tmp_path}"
    )
    stopping.Preemption(None, ONE, signals).agreed(1)  # a step ran
    assert signals.stopped_line().startswith("SIGINT: stopped after the last step")


def test_agreed_now_tells_every_rank_of_a_peers_signal_at_once(monkeypatch):
    """After a validation: one blocking exchange, so that a signal any rank got during it stops
    every rank at that step (agreed() might wait for steps more)."""
    signals = stopping.StopSignals()
    preemption = stopping.Preemption(None, World(rank=0, size=2), signals)
    peers = [0, signal.SIGTERM]  # what the other rank holds at each exchange

    def all_reduce(tensor, op=None, group=None, async_op=False):
        tensor.fill_(peers.pop(0))  # the MAX of this rank's 0 and the peer's flag

    monkeypatch.setattr(stopping.dist, "all_reduce", all_reduce)
    assert preemption.agreed_now() is False and not signals.requested
    assert preemption.agreed_now() is True and signals.exit_code == 143  # the peer's SIGTERM
    assert signals.stepped  # a stop now comes after a step: it saves

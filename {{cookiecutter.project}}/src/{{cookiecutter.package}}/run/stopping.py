"""Stopping on a signal: SIGTERM (Kubernetes, before SIGKILL; torchrun forwards it) and SIGINT
(Ctrl-C). The Trainer owns the stop: while steps run, a signal is a request that Preemption turns
into a step every rank agrees to stop at, where the Trainer has the Checkpointer save; before the
first step is done and after the last, with nothing new to save, the process ends at once. Either
way rank 0 says so in one line, and every rank exits 143 (SIGTERM) or 130 (SIGINT).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..core.exits import for_signal
from ..core.world import World

log = logging.getLogger(__name__)
EXCHANGE_EVERY_S = 0.25  # how often the ranks compare notes on a stop signal
MAX_INTERVAL = 10_000  # steps between exchanges, at most
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # Kubernetes and torchrun; Ctrl-C


class StopSignals:
    """SIGTERM and SIGINT, from a worker's start to its end; one per process (SIGNALS).

    While steps run (inside deferred()), a signal is a request: Preemption turns it into a step
    that every rank agrees to stop at, with a checkpoint there. Before the first step is done
    (undeferred(): it may be compiling for minutes) and after the last there is nothing new to
    save, so the process ends at once, with one line from rank 0.
    That exit comes from a thread woken by the signal itself (a wakeup fd): Python runs handlers
    in the main thread only, and that may wait in C for long (a rendezvous, the gate).
    """

    def __init__(self) -> None:
        self.signum: int | None = None  # the first stop signal received
        self.depth = 0  # deferred() nesting: > 0 while steps run
        self.stepped = False  # a step has run: a stop now comes "after the last step"
        self.said = False  # the stop's line is out
        self.settled = False  # the steps ended with a signal known: their caller stops
        self.run_dir: Path | None = None  # named in the line, once known
        self.main = True  # whether this process prints the line (global rank 0)
        self.launched = False  # under torchrun, whose launcher says a stop before logging is set up
        self.previous: dict[int, Any] | None = None
        self.previous_wakeup = -1
        self.writer: socket.socket | None = None
        self.lock = threading.Lock()
        self.received = threading.Event()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGTERM).name

    @property
    def exit_code(self) -> int:
        return for_signal(self.signum or signal.SIGTERM)

    def install(self, main: bool = True, launched: bool = False) -> bool:
        """Take SIGTERM and SIGINT (main thread only). False if they were taken already."""
        if self.previous is not None:
            return False
        reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.previous_wakeup = signal.set_wakeup_fd(self.writer.fileno(), warn_on_full_buffer=False)
        self.previous = {signum: signal.signal(signum, self.handle) for signum in STOP_SIGNALS}
        self.main, self.launched = main, launched
        watcher = threading.Thread(target=self.watch, args=(reader,), name="stop-signals")
        watcher.daemon = True
        watcher.start()
        return True

    def uninstall(self) -> None:
        """Hand the signals back (in-process users: bench, tests)."""
        if self.previous is None:
            return
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(self.previous_wakeup)
        self.previous = None
        self.writer.close()  # the watching thread reads the end and stops

    def handle(self, signum: int, frame: Any) -> None:
        """The request only, so that the step just run sees it; the signal's byte on the wakeup
        fd wakes the watching thread, which does the rest. A handler runs in the main thread
        between bytecodes, possibly while that thread holds the lock note() takes (or an
        Event's): taking one here could wait forever."""
        if self.signum is None:
            self.signum = signum

    def watch(self, reader: socket.socket) -> None:
        with reader:
            while data := reader.recv(64):  # a byte per signal; others' too (SIGCHLD)
                for signum in data:
                    if signum in STOP_SIGNALS:
                        self.note(signum)

    def note(self, signum: int) -> None:
        with self.lock:
            if self.signum is None:
                self.signum = signum
            # Steps that ended knowing of a signal leave the exit to their caller; after
            # uninstall() (bench, tests) the signal is no longer this object's to act on.
            now = self.depth == 0 and not self.settled and self.previous is not None
        self.received.set()
        if now:
            self.say(self.stopped_line())
            os._exit(self.exit_code)

    def say(self, line: str) -> None:
        """Rank 0's one line about the stop; once, whoever says it first. Before Hydra has set
        up logging (it composes first), a worker under torchrun says nothing: logging's last
        resort would print the line on stderr beside the launcher's own."""
        with self.lock:
            said, self.said = self.said, True
        if self.main and not said and (log.hasHandlers() or not self.launched):
            log.warning(line)

    def adopt(self, signum: int) -> bool:
        """The signal the ranks agreed to stop for (0: none), as this rank's own if it got none:
        every rank then reports it and exits with its code. Whether to stop."""
        if signum:
            with self.lock:
                if self.signum is None:
                    self.signum = signum
            self.received.set()
        return bool(signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """While steps run: a signal waits for the ranks to agree on a step."""
        with self.lock:
            self.depth += 1
        try:
            yield
        finally:
            with self.lock:
                self.depth -= 1
                self.settled = self.settled or (self.depth == 0 and self.signum is not None)

    @contextmanager
    def undeferred(self) -> Iterator[None]:
        """A stretch of deferred() with nothing new to save: the first step after a start or a
        resume, which torch.compile can make minutes long. A signal ends the process at once, as
        before the steps, rather than waiting past a pod's grace period to save nothing new."""
        with self.lock:
            depth, self.depth = self.depth, 0
            now = self.signum is not None and not self.settled and self.previous is not None
        if now:  # it came since the exchange before the first step
            self.say(self.stopped_line())
            os._exit(self.exit_code)
        try:
            yield
        finally:
            with self.lock:
                self.depth += depth

    def stopped_line(self) -> str:
        """For a stop with nothing new to save."""
        when = "after the last step" if self.stepped else "before the first step"
        go_on = f"; to go on, relaunch with hydra.run.dir={self.run_dir}" if self.run_dir else ""
        return f"{self.name}: stopped {when}, nothing new to save{go_on}"

    def explains(self, wait_s: float = 2.0) -> bool:
        """Whether a stop signal came, waiting up to wait_s for one: a collective that failed
        because a peer stopped for a signal that this process gets a moment later (torchrun
        signals every worker) is no failure to report."""
        return self.received.wait(timeout=wait_s)


SIGNALS = StopSignals()


class Preemption:
    """A stop signal asks to stop; agreed() makes every rank stop at the same step.

    start() asks every rank once before the first step. Then the ranks exchange the flag on a
    CPU group: an all-reduce started at one exchange is read at the next, so it runs in the
    background of the steps in between. Exchanges are `interval` steps apart, an interval agreed
    in the exchange itself, so that they come about EXCHANGE_EVERY_S apart whatever the step
    time: a stop follows the signal within about two intervals, and a short step carries no
    per-step exchange. Each rank proposes an interval from the pace of the steps it ran since
    the last exchange, never from steps a checkpoint brought in, and at most twice the steps it
    measured: the interval grows from 1 as the pace is learnt, so a slow first step (a resume,
    compile, loader workers starting) or a fast one misleads it by a factor 2 at most.
    """

    def __init__(
        self, group: dist.ProcessGroup | None, world: World, signals: StopSignals = SIGNALS
    ) -> None:
        self.group = group  # a CPU (gloo) group: the exchange costs no GPU synchronisation
        self.world, self.signals = world, signals
        self.pending: dist.Work | None = None
        self.flag = torch.zeros(2, dtype=torch.int64)
        self.next_exchange: int | None = None  # the step of the next exchange
        self.last: tuple[int, float] | None = None  # step and time of the last exchange
        self.steps: ExitStack | None = None  # while steps run: installed, deferred

    @property
    def requested(self) -> bool:
        return self.signals.requested

    def start(self, step: int) -> bool:
        """Before the first step (`step` done): whether a rank was asked to stop already, in one
        blocking exchange. From here on a signal waits for agreed()."""
        self.steps = ExitStack()
        if self.signals.install(main=self.world.main):
            self.steps.callback(self.signals.uninstall)
        self.steps.enter_context(self.signals.deferred())
        stop = self.ask_every_rank()
        self.last, self.next_exchange = (step, time.monotonic()), step + 1
        return stop

    def ask_every_rank(self) -> bool:
        """Whether any rank got a stop signal, in one blocking exchange; its signal is adopted."""
        if self.world.size == 1:
            return self.signals.requested
        flag = torch.tensor([self.signals.signum or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return self.signals.adopt(int(flag.item()))

    def agreed(self, step: int) -> bool:
        """Every rank calls this after every step; all get True at the same step."""
        self.signals.stepped = True
        if self.world.size == 1:
            return self.signals.requested
        if self.next_exchange is not None and step < self.next_exchange:
            return False
        interval = 1
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            signum, negative_interval = self.flag.tolist()
            if self.signals.adopt(signum):
                return True
            interval = -negative_interval
        # Propose the next interval from this rank's pace; the all-reduce takes the smallest
        # proposal (MAX of the negatives) and any rank's stop signal, in one message.
        now, proposal = time.monotonic(), 1
        if self.last is not None:
            last_step, last_time = self.last
            done = step - last_step
            pace = done / max(now - last_time, 1e-6)  # steps per second
            proposal = max(1, min(MAX_INTERVAL, 2 * done, math.floor(pace * EXCHANGE_EVERY_S)))
        self.last = (step, now)
        self.flag = torch.tensor([self.signals.signum or 0, -proposal], dtype=torch.int64)
        self.pending = dist.all_reduce(
            self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        self.next_exchange = step + interval
        return False

    def agreed_now(self) -> bool:
        """Like agreed(), but every rank learns of a stop signal at once, in one blocking
        exchange: after work long enough to wait for all ranks anyway (a validation), so that a
        signal during it stops the run there rather than after more steps."""
        self.signals.stepped = True
        return self.ask_every_rank()

    def close(self, wait: bool = True) -> None:
        """Finish the exchange in flight before the group is used for anything else (unless
        the run failed: a peer may never answer it); from here on a signal ends the process at
        once, with nothing left to save."""
        try:
            if self.pending is not None and wait:
                self.pending.wait()
            self.pending = None
        finally:
            if self.steps is not None:
                self.steps.close()
                self.steps = None

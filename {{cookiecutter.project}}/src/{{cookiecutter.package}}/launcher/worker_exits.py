"""How the workers ended, as the launcher's one last line says it: torchrun's failure table read for
the process whose failure is a cause, and the exit code to pass on."""

from __future__ import annotations

import logging
import re
import signal
import time

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ..core.exits import FAIL_AT_ONCE, Exit, for_signal
from ..run.oom import MemoryWatch

MEANING = {  # a worker's exit, as the launcher's last line names it
    Exit.CONFIG_ERROR: "a config error, printed above",
    Exit.COLLECTIVE_FAILED: "a collective failed: the block above says why",
    Exit.DIVERGED: "training diverged: the line above says what to do",
    Exit.CHECKPOINT_FAILED: "a checkpoint could not be written: the line above says why",
    Exit.INTERRUPTED: "stopped by SIGINT after a checkpoint",
    Exit.PREEMPTED: "stopped by SIGTERM after a checkpoint",
}
# Exits of a process that was asked to stop (Ctrl-C, SIGTERM): no failure of its own.
STOPPED = {Exit.INTERRUPTED, Exit.PREEMPTED, -signal.SIGINT, -signal.SIGTERM}
# Exits whose one line the worker printed itself: a config error, a divergence, a failed write.
SAID_ALREADY = {Exit.CONFIG_ERROR, Exit.DIVERGED, Exit.CHECKPOINT_FAILED}


# torchrun's log lines that the launcher's own last line says again: the worker processes'
# about stopping the others and about the failed one, and the elastic agent's about the stop
# signal it got, which it raises on to the launcher ("stopped by <signal>").
SAID_BELOW = ("Sending process", "failed (exitcode")
DEATH_SIGNAL = re.compile(r"Received \S+ death signal, shutting down workers$")
TORCHRUN_LOGGERS = (  # where those come from
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
)


class SaidAgainBelow(logging.Filter):
    """For TORCHRUN_LOGGERS: torchrun's lines that the launcher's own last line says again."""

    def filter(self, record: logging.LogRecord) -> bool:
        said = record.getMessage()
        return not (said.startswith(SAID_BELOW) or DEATH_SIGNAL.match(said))


# Exits that follow from another process's failure: a collective that failed because its peer
# ended, and torchrun's own SIGTERM to the survivors.
CONSEQUENCES = {Exit.COLLECTIVE_FAILED, Exit.PREEMPTED, -signal.SIGTERM}


def summary(err: ChildFailedError, memory: MemoryWatch | None = None) -> tuple[str, int]:
    """torchrun's failure table as one line, and the exit code to pass on: the process whose
    failure is a cause rather than a consequence, the earliest of those."""
    rank, failure = min(
        err.failures.items(), key=lambda item: (item[1].exitcode in CONSEQUENCES, item[1].timestamp)
    )
    if all(f.exitcode in STOPPED for f in err.failures.values()):  # they were signalled, not us
        name = signal.Signals(abs(failure.exitcode) % 128).name
        return f"stopped by {name}", for_signal(abs(failure.exitcode) % 128)
    if failure.exitcode < 0:
        if failure.exitcode == -signal.SIGKILL and memory is not None:
            said = memory.verdict(rank, failure.pid)
            if said:
                return said, 128 - failure.exitcode
        name = failure.signal_name()
        return f"rank {rank} (pid {failure.pid}) was killed by {name}", 128 - failure.exitcode
    meaning = MEANING.get(failure.exitcode, "its error is printed above")
    return (
        f"rank {rank} (pid {failure.pid}) exited with {failure.exitcode}: {meaning}",
        failure.exitcode,
    )


# A round of workers that ran this long before failing had trained: its failure (a lost peer, as
# a rule) costs a restart of a fresh --max-restarts budget, which limits failures in a row, not
# over the job's life. Shorter rounds are a crash loop that the budget ends.
HEALTHY_ROUND_S = 600


class Agent(LocalElasticAgent):
    """torchrun's agent, which restarts the workers in place on any failure (--max-restarts),
    with two rules of this project's: a failure no retry fixes (exits.FAIL_AT_ONCE: a config
    error, a divergence) is not retried, and a round that ran HEALTHY_ROUND_S gives the budget
    back."""

    round_started = 0.0

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        super()._initialize_workers(worker_group)
        self.round_started = time.monotonic()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in {WorkerState.FAILED, WorkerState.UNHEALTHY}:
            if any(f.exitcode in FAIL_AT_ONCE for f in result.failures.values()):
                self._remaining_restarts = 0  # _invoke_run stops the workers and returns
            elif time.monotonic() - self.round_started >= HEALTHY_ROUND_S:
                self._remaining_restarts = worker_group.spec.max_restarts
        return result


# In torchrun's output: its summary, the rank it blames, worker lines, and its own log lines.
SUMMARY = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
BLAMED = re.compile(
    r"^Root Cause \(first observed failure\):\n(?:.*\n)*?"
    r"\s*rank\s*: (\d+) .*\n\s*exitcode\s*: (-?\d+)",
    re.MULTILINE,
)
RANK_LINE = re.compile(r"^\[rank(\d+)\]: ?(.*)$")
EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)\b(?::.*)?$")
NOT_SAID_BY_A_WORKER = re.compile(
    r"^(?:[DIWEF]\d{4} \d\d:\d\d:\d\d|\*+$|Setting OMP_NUM_THREADS"
    r"|Traceback \(most recent call last\)|\s|$)"
)


def exception_in(lines: list[str]) -> str:
    """The first exception line, with NCCL's `Last error:` detail where it follows."""
    for i, line in enumerate(lines):
        if EXCEPTION.match(line.strip()) and SUMMARY not in line:
            following = [later.strip() for later in lines[i + 1 : i + 6]]
            if "Last error:" in following and following.index("Last error:") + 1 < len(following):
                detail = following[following.index("Last error:") + 1]
                return f"{line.strip()[:160]} ... Last error: {detail}"
            return line.strip()
    return ""


def root_cause(output: str) -> str:
    """Why a torchrun launch failed, in one line: the exception of the rank torchrun blames
    first (its own summary's tail names none), else the last thing that rank printed, else the
    signal that killed it."""
    blamed = BLAMED.search(output)
    rank, code = (int(blamed[1]), int(blamed[2])) if blamed else (None, None)
    cut = output.find(SUMMARY)
    labelled, unlabelled = [], []  # [rankN]: lines (after init_process_group), and the rest
    for line in (output[:cut] if cut >= 0 else output).splitlines():
        found = RANK_LINE.match(line)
        if found and (rank is None or int(found[1]) == rank):
            labelled.append(found[2])
        elif not found:
            unlabelled.append(line)
    who = f"rank {rank}: " if rank is not None else ""
    cause = exception_in(labelled) or exception_in(unlabelled)
    if cause:
        return (who + cause)[:400]
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} was killed by {name}"
    said = [line.strip() for line in unlabelled if not NOT_SAID_BY_A_WORKER.match(line)]
    if said:
        return (f"rank {rank} exited with {code}: " if rank is not None else "") + said[-1][:300]
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"

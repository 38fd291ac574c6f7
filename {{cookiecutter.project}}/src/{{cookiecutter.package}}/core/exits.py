"""Every exit code this project's commands end with, and what each means to Kubernetes.

The codes are a contract: a Job's (and a JobSet's) podFailurePolicy fails the whole job at once on
the codes no retry can fix (`fails_job`), and lets the others count against backoffLimit, where a
new pod may fare better. The launcher passes a worker's own code on, where torchrun reports 1.
k8s/ reads FAIL_AT_ONCE from here. The standard library only: the template's hook imports k8s/.
"""

from __future__ import annotations

import signal
import sys
import time
from enum import IntEnum
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from .world import World


class Exit(IntEnum):
    """(code, fails_job, meaning): the meaning is docs/exit-codes.md's and the Job's
    reading of it."""

    fails_job: bool
    meaning: str

    def __new__(cls, code: int, fails_job: bool, meaning: str) -> Exit:
        member = int.__new__(cls, code)
        member._value_ = code
        member.fails_job, member.meaning = fails_job, meaning
        return member

    OK = 0, False, "done"
    FAILED = 1, False, "a command could not do its work; its last line says why"
    CONFIG_ERROR = 2, True, "a bad value, option or resume: no retry fixes it"
    COLLECTIVE_FAILED = 3, False, "a collective timed out or a peer died: a new pod may fare better"
    DIVERGED = 4, True, "the loss, a gradient or a weight is not finite: no retry fixes it"
    CHECKPOINT_FAILED = 5, False, "rank 0 could not write a checkpoint (a full disk): retried"
    INTERRUPTED = 128 + signal.SIGINT, False, "SIGINT (Ctrl-C): stopped, a checkpoint if a step ran"
    PREEMPTED = 128 + signal.SIGTERM, False, "SIGTERM (eviction): stopped, with a checkpoint"


def for_signal(signum: int) -> int:
    """128 + the signal's number, as a shell reports a process the signal ended: 143, 130."""
    return 128 + signum


FAIL_AT_ONCE = [int(code) for code in Exit if code.fails_job]


def exit_with_error(message: str, world: World, grace_s: float = 60) -> NoReturn:
    """A command's end on an error every local rank finds alike (a bad config, a refused run dir):
    exit 2. Local rank 0 prints the line, once per node; the others wait for that, because
    torchrun stops all workers as soon as the first one exits. Helpers raise ConfigError; only a
    command, or a Hydra callback (where Hydra hands the train command control), calls this."""
    if world.local_rank == 0:
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(grace_s)
    sys.exit(Exit.CONFIG_ERROR)

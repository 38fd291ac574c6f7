"""`{{ cookiecutter.project }} train`: check the config, start torchrun, and end in one line.

    {{ cookiecutter.project }} train  # every local GPU (2 CPU processes without one)
    {{ cookiecutter.project }} train nccl=pcie_safe trainer.max_steps=1000
    {{ cookiecutter.project }} train --nproc-per-node 4 experiment=gpt2_small
    {{ cookiecutter.project }} train --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29500

Options before the first override are torchrun's (`torchrun --help`); without --nproc-per-node
it runs --standalone on every local GPU. A bad override or an unusable run dir stops here, in one
line, before any worker starts (exit 2), as torchtune's `tune run` does. When a worker fails,
torchrun's traceback gives way to one line naming the process that failed first (unless that
process printed its own: a config error, a divergence), and the launcher exits with that
process's code: 2 config, 3 collective failure, 4 diverged, 130 Ctrl-C, 143 SIGTERM. A process
the kernel killed for memory is named as such, with the figures and a smaller setting to try.
"""  # noqa: E501

# ruff: noqa: E402 (the imports after the signal handlers below)
from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from . import PACKAGE, PROJECT
from .core.exits import Exit, for_signal


def stopped_while_starting(signum: int, frame: object) -> NoReturn:
    """A stop while torch and Hydra import (seconds): nothing has started, nothing to undo."""
    print(f"{PROJECT} train: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    os._exit(for_signal(signum))


def timer_joined_from_itself(unraisable: Any) -> None:
    """sys.unraisablehook for the command. torch's rendezvous keep-alive timer (elastic/rendezvous/
    utils.py, _PeriodicTimer) joins its thread in a finalizer, and Python may run that finalizer
    in the timer's own thread, when the rendezvous handler it serves goes in that thread's last
    call: a launch stopped while its workers start then ends in an ignored "cannot join current
    thread" traceback after its one line. The thread is ending anyway; anything else is Python's
    to print."""
    frames = traceback.extract_tb(unraisable.exc_traceback)
    if not (
        isinstance(unraisable.exc_value, RuntimeError)
        and str(unraisable.exc_value) == "cannot join current thread"
        and any(f.name == "_stop_thread" and f.filename.endswith(TIMER_SOURCE) for f in frames)
    ):
        sys.__unraisablehook__(unraisable)


TIMER_SOURCE = os.path.join("elastic", "rendezvous", "utils.py")


# c10d's store client logs each failed try to reach the rendezvous with a C++ stack, dozens of
# lines a try, in the launcher, whose one line names the cause. Torch reads the level as it loads;
# the workers start with the environment as it was.
QUIET_CPP_LOG = "TORCH_CPP_LOG_LEVEL" not in os.environ
if __name__ == "__main__" or Path(sys.argv[0]).name == PROJECT:  # the command, not an import
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stopped_while_starting)
    sys.unraisablehook = timer_joined_from_itself
    if QUIET_CPP_LOG:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"

import torch  # after the handlers: torch's import takes seconds

if QUIET_CPP_LOG:
    os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT as C10D_PORT
from torch.distributed.elastic.rendezvous.utils import (
    _parse_rendezvous_config,
    parse_rendezvous_endpoint,
)
from torch.distributed.launcher import api as launcher_api
from torch.distributed.run import get_args_parser, run

from .config import compose as check
from .config.error import ConfigError
from .config.schema import TrainConfig
from .config.validate import check_composed
from .core.world import LAUNCHED_AT_VAR, RUN_NAME_VAR, World, launched_at, run_name_for
from .launcher.run_dir_plan import (
    explicit_run_dir,
    new_part,
    of_value,
    planned_run_dir,
    remove_empty,
)
from .launcher.store_liveness import StoreLiveness
from .launcher.torchrun_args import (
    RENDEZVOUS,
    ArgumentError,
    UsageError,
    given,
    option_problem,
    parse_error,
    processes,
    split,
)
from .launcher.worker_exits import SAID_ALREADY, TORCHRUN_LOGGERS, Agent, SaidAgainBelow, summary
from .record.startup import LAUNCHER_IMPORTED_VAR, TORCHRUN_AT_VAR
from .run import rundir
from .run.oom import MemoryWatch, children

COMMAND = PROJECT
IMPORTED_AT = time.time()  # the start-up line's "launcher imports" end here


# torchrun's c10d defaults (torch/distributed/elastic/rendezvous): read_timeout, join_timeout.
RDZV_DEFAULTS = {"read_timeout": 60, "join_timeout": 600}


def rendezvous_timeout(parsed: argparse.Namespace, key: str) -> int:
    return int(_parse_rendezvous_config(parsed.rdzv_conf).get(key, RDZV_DEFAULTS[key]))


def store_liveness(
    parsed: argparse.Namespace, one_node: bool, say: Callable[[str], None]
) -> StoreLiveness | nullcontext:
    """Bounds this node's connections to the rendezvous host (launcher/store_liveness.py): half of
    read_timeout to give a silent host up, the other half at least for its replacement."""
    if one_node or parsed.rdzv_backend != "c10d":
        return nullcontext()
    _, port = parse_rendezvous_endpoint(parsed.rdzv_endpoint, default_port=C10D_PORT)
    return StoreLiveness(port, rendezvous_timeout(parsed, "read_timeout") / 2, say)


def rendezvous_problem(parsed: argparse.Namespace, err: RendezvousError) -> str:
    """The one line for a rendezvous that never gathered this node with the others."""
    endpoint = parsed.rdzv_endpoint
    if isinstance(err, RendezvousConnectionError):
        seconds = rendezvous_timeout(parsed, "read_timeout")
        return (
            f"could not reach the rendezvous at {endpoint} within {seconds} s (--rdzv-conf "
            "read_timeout; deploy.rdzv_timeout_s in k8s/): the node that hosts it (pod 0) has "
            f"not started, or its port is closed to this node ({err.__cause__ or err})"
        )
    if isinstance(err, RendezvousTimeoutError):
        seconds = rendezvous_timeout(parsed, "join_timeout")
        return (
            f"the rendezvous at {endpoint} did not gather its {parsed.nnodes} nodes within "
            f"{seconds} s (--rdzv-conf join_timeout; deploy.rdzv_timeout_s in k8s/): a node has "
            "not started"
        )
    return f"the rendezvous failed: {err}"


class Stopped(BaseException):
    """SIGTERM or SIGHUP before torchrun's own handlers are in place (a BaseException, as
    KeyboardInterrupt is: no `except Exception` on the way, Hydra's or torchrun's, takes it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.sigval = signal.Signals(signum)


def stop(signum: int, frame: object) -> NoReturn:
    raise Stopped(signum)


def hear_stops() -> None:
    """Until torchrun's handlers take over: SIGTERM and SIGHUP raise Stopped, SIGINT
    KeyboardInterrupt."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def ignore_stops() -> None:
    """torchrun has returned or raised: how the launch ends is known and about to be said. A
    second signal (Ctrl-C pressed twice) would raise through that, torchrun's handlers still
    being in place."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


# What a worker process starts with blocked (a signal mask survives exec), until train.py's
# first lines take them: a stop that torchrun passes on while a worker's interpreter starts
# would raise KeyboardInterrupt in its site or runpy, a traceback. Pending, they come at once.
HELD_FOR_WORKERS = {signal.SIGINT, signal.SIGTERM}


@contextmanager
def stops_held_for_workers() -> Iterator[None]:
    """This thread, which starts the workers, blocks HELD_FOR_WORKERS; a thread of its own that
    does not hears them for this process (the kernel gives a process's signal to any thread not
    blocking it), and Python runs their handlers in this thread as ever."""
    done = threading.Event()
    hearing = threading.Thread(target=done.wait, name="hears-stops", daemon=True)
    hearing.start()  # before the block: a thread starts with its maker's mask
    held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_FOR_WORKERS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        done.set()


# torchrun's wait for its workers to end on a stop signal, before it SIGKILLs them.
WORKERS_END_S = 30


def end_lost_workers(signum: int) -> None:
    """Workers torchrun lost track of: a stop signal raised in it while it started them (a
    worker's Popen made, not yet recorded) leaves them unknown to its shutdown, running on to a
    traceback once this process is gone. They get the signal as torchrun sends it, then
    SIGKILL after WORKERS_END_S. The workers torchrun knew of have ended by now."""
    left = children(os.getpid())
    for pid in left:
        with suppress(OSError):  # each leads a session of its own, as torchrun starts them
            os.killpg(pid, signum)
    deadline = time.monotonic() + WORKERS_END_S
    while left := {pid for pid in left if not ended(pid)}:
        if time.monotonic() > deadline:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def ended(pid: int) -> bool:
    """Whether a child process has ended (reaping it)."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] == pid
    except ChildProcessError:  # reaped already
        return True


def main(argv: list[str] | None = None) -> int:
    hear_stops()
    os.environ.setdefault(LAUNCHED_AT_VAR, repr(launched_at()))  # this process's start
    os.environ[LAUNCHER_IMPORTED_VAR] = repr(IMPORTED_AT)
    try:
        return launch(sys.argv[1:] if argv is None else argv)
    except (KeyboardInterrupt, Stopped) as err:  # a stop before the run dir is known
        name = err.sigval.name if isinstance(err, Stopped) else "SIGINT"
        print(f"{COMMAND} train: stopped by {name}", file=sys.stderr, flush=True)
        return for_signal(signal.Signals[name])


def launch(args: list[str]) -> int:
    usage = f"usage: {COMMAND} train [torchrun options] [overrides]"
    if args[:1] != ["train"]:
        asked = args[:1] in (["-h"], ["--help"])
        print(f"{usage}  (see --help of train)", file=sys.stdout if asked else sys.stderr)
        return Exit.OK if asked else Exit.CONFIG_ERROR
    if args[1:2] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__.strip()}")
        return Exit.OK
    try:
        parsed, overrides = torchrun_command(args[1:])
    except (UsageError, ArgumentError) as err:
        print(f"{COMMAND} train: {err}", file=sys.stderr)
        return Exit.CONFIG_ERROR
    local_size, world_size = processes(parsed)
    one_node = world_size == local_size
    if one_node:  # its launch names the run (several nodes: world.run_name)
        os.environ.setdefault(RUN_NAME_VAR, run_name_for(time.time(), secrets.token_hex(3)))
    try:
        config, run_dir, new = checked(overrides, World(size=world_size, local_size=local_size))
    except check.CONFIG_ERRORS as err:
        return check.refused(err)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own choice, without its banner
    for name in TORCHRUN_LOGGERS:
        logging.getLogger(name).addFilter(SaidAgainBelow())
    # torchrun's run() makes its agent by this name: ours retries no exit in exits.FAIL_AT_ONCE.
    launcher_api.LocalElasticAgent = Agent
    return supervise(parsed, config, Planned(run_dir, new, one_node), local_size)


def torchrun_command(args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """torchrun's options as its parser reads them, with this launcher's defaults (every GPU, or
    2 CPU processes; a standalone rendezvous), and the overrides for the workers. Raises
    UsageError or ArgumentError on a bad option."""
    parser = get_args_parser()
    parser.error = parse_error  # type: ignore[method-assign]
    options, overrides = split(args, parser)
    if not given(options, "nproc-per-node"):
        local = torch.cuda.device_count() if torch.cuda.is_available() else 2
        options = ["--nproc-per-node", str(local), *options]
    if not any(given(options, name) for name in RENDEZVOUS):
        options = ["--standalone", *options]  # one node, rendezvous on a free local port
    parsed = parser.parse_args([*options, "-m", f"{PACKAGE}.train", *overrides])
    problem = option_problem(parsed, options)
    if problem:
        raise UsageError(problem)
    return parsed, overrides


class Planned(NamedTuple):
    """The run dir as this launch knows it before torchrun starts."""

    run_dir: Path | None  # None where only the workers can tell
    new: Path | None  # the part of it this launch would make (new_part), which a stop removes
    one_node: bool


def checked(overrides: list[str], world: World) -> tuple[TrainConfig, Path | None, Path | None]:
    """The config the workers will compose, composed once and checked for the launch `world`,
    and its run dir: whether it can be made and written, and its lock, where this node can tell.
    What needs a worker's imports (a resume's checkpoint, an optimizer built and stepped) the
    workers check, as their first line. Raises CONFIG_ERRORS."""
    composed = check.compose_train(overrides, None)
    config = check_composed(composed, world)
    check.check_loggers(config)
    one_node = world.size == world.local_size
    # With several nodes, the default dir's name is the rendezvous's: only an explicit one is known.
    run_dir = planned_run_dir(composed) if one_node else explicit_run_dir(overrides)
    made_here = run_dir is not None and not rundir.present(run_dir)
    new = new_part(run_dir) if made_here else None  # outputs/ too, on a first run
    # With several nodes, node 0's rank 0 may hold the run dir's lock already: the workers' own
    # guard decides then.
    problem = rundir.launch_problem(run_dir, busy=one_node) if run_dir else None
    if new:  # made to check it: the workers make it (a stop before they do leaves none)
        remove_empty(run_dir, new)  # empty only: another node's workers may be writing there
    if problem:
        raise ConfigError(problem)
    return config, run_dir, new


def supervise(
    parsed: argparse.Namespace, config: TrainConfig, planned: Planned, local_size: int
) -> int:
    """torchrun's run, watched: its workers' memory, the rendezvous host, the stop signals; a
    lost rendezvous host joined again; and how the launch ended, in one line and its exit code."""
    run_dir, new, one_node = planned

    def stopped(name: str) -> str:
        """The stop's line; a run dir this launch made and left with nothing of value goes."""
        said = f"stopped by {name}"
        if new and one_node and run_dir.is_dir() and not of_value(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            said += f" before any step was saved or logged; removed {run_dir}"
        if new:  # outputs/ too, if this launch made it and nothing else is there
            remove_empty(run_dir, new)
        return said

    def say(line: str) -> None:
        print(f"{COMMAND} train{line}", file=sys.stderr, flush=True)

    with (
        MemoryWatch(config, local_size) as memory,
        store_liveness(parsed, one_node, say),
        stops_held_for_workers(),
    ):
        while True:
            seen = set(memory.last)
            try:
                try:
                    os.environ[TORCHRUN_AT_VAR] = repr(time.time())  # its workers' start-up line
                    run(parsed)
                finally:
                    ignore_stops()
            except RendezvousConnectionError as err:
                # The store lives in pod 0's torchrun. Once this node has trained with it, losing
                # it means pod 0 was lost (preempted, evicted): its controller starts a
                # replacement, which hosts a new store. Joining that, in this pod, costs no
                # failure under any flavor's policy; exiting would cost one per node.
                if one_node or not set(memory.last) - seen:
                    say(f": {rendezvous_problem(parsed, err)}")
                    return Exit.FAILED
                seconds = rendezvous_timeout(parsed, "read_timeout")
                say(
                    f": lost the rendezvous at {parsed.rdzv_endpoint}, which this node trained "
                    f"with: its host (pod 0) is gone; joining its replacement's, for up to "
                    f"{seconds} s"
                )
                hear_stops()
            except RendezvousError as err:
                say(f": {rendezvous_problem(parsed, err)}")
                return Exit.FAILED
            except ChildFailedError as err:
                line, code = summary(err, memory)
                if line.startswith("stopped by"):
                    say(f": {stopped(line.split()[-1])}")
                elif code not in SAID_ALREADY:
                    say(f" failed: {line}")
                return code
            except (SignalException, Stopped, KeyboardInterrupt) as err:
                name = "SIGINT" if isinstance(err, KeyboardInterrupt) else err.sigval.name
                end_lost_workers(signal.Signals[name])
                say(f": {stopped(name)}")
                return for_signal(signal.Signals[name])
            else:
                return Exit.OK


if __name__ == "__main__":
    sys.exit(main())

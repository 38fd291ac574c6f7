"""`{{ cookiecutter.project }} train`: check the config, start torchrun, and end in one line.

    {{ cookiecutter.project }} train                                  # every local GPU (2 CPU processes without one)
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
"""

# ruff: noqa: E402 (the imports after the signal handlers below)
from __future__ import annotations

import argparse
import logging
import math
import os
import re
import secrets
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from . import PROJECT
from .exits import Exit, for_signal


def stopped_while_starting(signum: int, frame: object) -> NoReturn:
    """A stop while torch and Hydra import (seconds): nothing has started, nothing to undo."""
    print(f"{PROJECT} train: stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    os._exit(for_signal(signum))


# c10d's store client logs each failed try to reach the rendezvous with a C++ stack, dozens of
# lines a try, in the launcher, whose one line names the cause. Torch reads the level as it loads;
# the workers start with the environment as it was.
QUIET_CPP_LOG = "TORCH_CPP_LOG_LEVEL" not in os.environ
if __name__ == "__main__" or Path(sys.argv[0]).name == PROJECT:  # the command, not an import
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stopped_while_starting)
    if QUIET_CPP_LOG:
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"

import torch  # after the handlers: torch's import takes seconds

if QUIET_CPP_LOG:
    os.environ.pop("TORCH_CPP_LOG_LEVEL", None)
from hydra import compose
from hydra.core.override_parser.overrides_parser import OverridesParser
from torch.distributed.elastic.multiprocessing.api import SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.utils import (
    _parse_rendezvous_config,
    parse_rendezvous_endpoint,
)
from torch.distributed.run import get_args_parser, run

from . import check, checkpoint, rundir
from .config import TrainConfig, register_configs
from .overrides import exit_with_error, hydra_overrides
from .world import RUN_NAME_VAR, run_name_for

PACKAGE = __package__
COMMAND = PROJECT
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
# torchrun's own ways to name the program: the launcher always runs -m <package>.train.
PROGRAM_OPTIONS = {"-m", "--module", "--no-python", "--no_python", "--run-path", "--run_path"}


class UsageError(Exception):
    """A launcher argument that cannot work; the message is the one line to print."""


def split(args: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """torchrun's options, then Hydra overrides: the options are read with torchrun's own parser,
    so an option's value is never taken for an override."""
    options = parser._option_string_actions  # argparse's table of option strings
    i = 0
    while i < len(args) and args[i].startswith("-"):
        name = args[i].split("=", 1)[0]
        if name in PROGRAM_OPTIONS:
            raise UsageError(f"{name}: the launcher runs -m {PACKAGE}.train itself")
        if name not in options:
            raise UsageError(
                f"{name}: not a torchrun option; Hydra's own flags (--cfg, --help, -m) go to "
                f"python -m {PACKAGE}.train"
            )
        takes_value = options[name].nargs != 0 and "=" not in args[i]
        i += 2 if takes_value else 1
    return args[:i], args[i:]


# torchrun options that describe a rendezvous across nodes (or name it): no --standalone then.
RENDEZVOUS = ("standalone", "nnodes", "rdzv-endpoint", "rdzv-backend", "master-addr", "node-rank")


def given(options: list[str], name: str) -> bool:
    """Whether an option is given on the command line, or in the PET_* variable through which
    operators (Kubeflow's, Trainer's) pass torchrun its options."""
    spellings = {f"--{name}", f"--{name.replace('-', '_')}"}
    on_line = any(option.split("=", 1)[0] in spellings for option in options)
    return on_line or f"PET_{name.replace('-', '_').upper()}" in os.environ


def processes(parsed: argparse.Namespace) -> tuple[int, int]:
    """(processes per node, world size) as torchrun will start them (options checked already)."""
    nproc = parsed.nproc_per_node
    if nproc in ("gpu", "auto"):
        nproc = torch.cuda.device_count() or os.cpu_count() or 1
    elif nproc == "cpu":
        nproc = os.cpu_count() or 1
    nodes = int(str(parsed.nnodes).split(":")[-1])
    return int(nproc), int(nproc) * nodes


SHORT = {"redirects": ("-r",), "tee": ("-t",)}  # torchrun's one-letter spellings
MAX_NPROC = 1024  # per node: beyond any node's GPUs; on CPU, each process is a copy of the model


def whole(text: str, low: int, high: float = math.inf) -> bool:
    return re.fullmatch(r"\s*[+-]?\d+\s*", text) is not None and low <= int(text) <= high


def option_problem(parsed: argparse.Namespace, options: list[str]) -> str | None:
    """The first torchrun option (or PET_* variable) that torchrun would refuse with a traceback
    or a nonsense world, as `NAME=value: what is allowed`; None when all can work."""

    def named(name: str, value: object) -> str:
        """The option as the user gave it: on the line, or in its PET_* variable."""
        line = {f"--{name}", f"--{name.replace('-', '_')}", *SHORT.get(name, ())}
        on_line = any(option.split("=", 1)[0] in line for option in options)
        spelled = f"--{name}" if on_line else f"PET_{name.replace('-', '_').upper()}"
        return f"{spelled}={value}" if value != "" else f"{spelled}=''"

    nproc = str(parsed.nproc_per_node)
    if nproc == "gpu" and not torch.cuda.is_available():
        return f"{named('nproc-per-node', nproc)}: no CUDA device is visible; give a number of processes"
    if nproc not in ("gpu", "cpu", "auto") and not whole(nproc, 1, MAX_NPROC):
        return (
            f"{named('nproc-per-node', nproc)}: must be a number of processes from 1 to "
            f"{MAX_NPROC}, or gpu, cpu or auto"
        )
    nnodes = str(parsed.nnodes)
    bounds = nnodes.split(":")
    if not (
        len(bounds) in (1, 2)
        and all(whole(bound, 1) for bound in bounds)
        and int(bounds[0]) <= int(bounds[-1])
    ):
        return (
            f"{named('nnodes', nnodes)}: must be a number of nodes (1 or more), or MIN:MAX with "
            "1 <= MIN <= MAX for an elastic job"
        )
    max_nodes = int(bounds[-1])
    if parsed.standalone and max_nodes > 1:
        return (
            f"{named('nnodes', nnodes)}: --standalone runs one node; several need "
            "--rdzv-backend c10d --rdzv-endpoint HOST:PORT"
        )
    if parsed.max_restarts < 0:
        return f"{named('max-restarts', parsed.max_restarts)}: must be 0 or more"
    if parsed.node_rank < 0 or (parsed.rdzv_backend == "static" and parsed.node_rank >= max_nodes):
        return (
            f"{named('node-rank', parsed.node_rank)}: must be from 0 to {max_nodes - 1}: one rank "
            f"per node of --nnodes={nnodes}"
        )
    if not (math.isfinite(parsed.monitor_interval) and parsed.monitor_interval > 0):
        return f"{named('monitor-interval', parsed.monitor_interval)}: must be a number of seconds above 0"
    if parsed.master_port is not None and not 1 <= parsed.master_port <= 65535:
        return f"{named('master-port', parsed.master_port)}: must be a port, 1 to 65535"
    backends = sorted(rendezvous_handler_registry._registry)  # torchrun's own table
    if not parsed.standalone and parsed.rdzv_backend not in backends:
        return f"{named('rdzv-backend', parsed.rdzv_backend)}: no such backend; allowed: {', '.join(backends)}"
    try:
        parse_rendezvous_endpoint(parsed.rdzv_endpoint, default_port=29400)
    except ValueError as err:
        return f"{named('rdzv-endpoint', parsed.rdzv_endpoint)}: must be HOST or HOST:PORT ({err})"
    try:
        conf = _parse_rendezvous_config(parsed.rdzv_conf)
    except ValueError:
        conf = None
    bad = conf is None or any(
        key.endswith("timeout") and not whole(str(value), 1) for key, value in conf.items()
    )
    if bad:
        return (
            f"{named('rdzv-conf', parsed.rdzv_conf)}: must be KEY=VALUE pairs separated by commas, "
            "each *timeout a whole number of seconds, e.g. join_timeout=900"
        )
    for name in ("redirects", "tee"):
        try:
            Std.from_str(getattr(parsed, name))
        except ValueError:
            return (
                f"{named(name, getattr(parsed, name))}: must be 0 (none), 1 (stdout), 2 (stderr) "
                "or 3 (both), or LOCAL_RANK:N pairs such as 0:3,1:0"
            )
    ranks = parsed.local_ranks_filter
    if ranks and not all(whole(rank, 0) for rank in ranks.split(",")):
        return f"{named('local-ranks-filter', ranks)}: must be local ranks separated by commas, e.g. 0,1"
    return None


class ArgumentError(Exception):
    """argparse's own complaint about an option (a bad int, a missing value)."""


def parse_error(message: str) -> NoReturn:
    """argparse's error(), which prints the usage and exits, as one line instead."""
    found = re.match(r"argument (-[^/:]+)[^:]*: (.*)", message)
    if found:
        option, reason = found.groups()
        value = re.match(r"invalid (int|float) value: (.*)", reason)
        if value:
            kind = "a whole number" if value.group(1) == "int" else "a number"
            raise ArgumentError(f"{option}={value.group(2)}: must be {kind}")
        if reason.startswith("expected one argument"):
            raise ArgumentError(f"{option}: needs a value, e.g. {option} 2")
        raise ArgumentError(f"{option}: {reason}")
    raise ArgumentError(message)


class SaidBelow(logging.Filter):
    """torchrun's log lines about stopping the other workers and about the failed one: the
    launcher's own last line says the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("Sending process", "failed (exitcode"))


def explicit_run_dir(overrides: list[str]) -> Path | None:
    """hydra.run.dir when given as a plain path, read as Hydra reads it (quotes and escapes
    removed); a default dir is new for every launch."""
    for override in overrides:
        try:
            (parsed,) = OverridesParser.create().parse_overrides([override])
        except Exception:  # the config check has named it already
            continue
        if parsed.key_or_group == "hydra.run.dir" and not parsed.is_delete():
            value = parsed.value()
            problem = rundir.empty(value, "hydra.run.dir")
            if problem:
                exit_with_error(f"config error: {problem}")
            if isinstance(value, (str, int, float)) and "${" not in str(value):
                return Path(str(value))
    return None


def planned_run_dir(overrides: list[str]) -> Path | None:
    """The run dir the workers will use, as Hydra composes it (the launcher named the run), or
    None where it cannot tell."""
    try:
        register_configs()
        with check.configs_at(None):
            cfg = compose(
                config_name="train", overrides=hydra_overrides(overrides), return_hydra_config=True
            )
        value = cfg.hydra.run.dir
    except Exception:  # an interpolation only a worker can resolve: the workers' guard decides
        return None
    problem = rundir.empty(value, "hydra.run.dir")
    if problem:
        exit_with_error(f"config error: {problem}")
    return Path(value)


def new_part(path: Path) -> Path:
    """The topmost of path and its parents that does not exist yet."""
    while not rundir.present(path.parent) and path.parent != path:
        path = path.parent
    return path


def remove_empty(path: Path, top: Path) -> None:
    """path and its parents up to top, each if empty (this launch made them)."""
    for folder in (path, *path.parents):
        if not folder.is_relative_to(top):
            return
        try:
            folder.rmdir()
        except OSError:  # not empty, gone, or a name that cannot exist
            if rundir.present(folder):
                return


def of_value(run_dir: Path) -> bool:
    """Whether a run dir holds anything a run made: a checkpoint, a metrics row, or a
    logger's files (TensorBoard, W&B, MLflow) written before the first row; not the start-up log."""
    rows = run_dir / "metrics.jsonl"
    if checkpoint.checkpoint_paths(run_dir) or (rows.exists() and rows.stat().st_size > 0):
        return True
    made_at_start = {
        ".hydra",
        ".lock",
        "train.log",
        "metrics.jsonl",
        "metrics.csv",
        "config.yaml",
        "nccl",
    }
    return any(
        path.name not in made_at_start
        and (any(path.iterdir()) if path.is_dir() else path.stat().st_size > 0)
        for path in run_dir.iterdir()
    )


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


def gib(size: float) -> str:
    return f"{size / 2**30:.1f} GiB"


def read_counter(path: Path, name: str) -> int | None:
    """`name N` from a kernel stats file (memory.events, memory.oom_control, /proc/vmstat)."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def cgroup_dirs() -> list[Path]:
    """This process's memory cgroup: v2's unified dir and v1's memory dir, where mounted (inside
    a container the mount is usually the group itself)."""
    found = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return found
    root = Path("/sys/fs/cgroup")
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2
            found += [root / path.lstrip("/"), root]
        elif "memory" in controllers.split(","):  # v1
            found += [root / "memory" / path.lstrip("/"), root / "memory"]
    return [folder for folder in found if folder.is_dir()]


def oom_kills() -> dict[str, int]:
    """The kernel's counts of processes killed for memory: this cgroup's, or the machine's where
    no cgroup counts them. /proc/vmstat counts every container of a node: on Kubernetes another
    pod's kill would pass for this one's."""
    counts = {}
    for path in [
        folder / file
        for folder in cgroup_dirs()
        for file in ("memory.events", "memory.oom_control")
    ]:
        value = read_counter(path, "oom_kill")
        if value is not None:
            counts[str(path)] = value
    if not counts:
        value = read_counter(Path("/proc/vmstat"), "oom_kill")
        if value is not None:
            counts["/proc/vmstat"] = value
    return counts


def memory_limit() -> tuple[int, str] | None:
    """The memory this launch may use: the machine's, or its cgroup's limit when lower."""
    limits = []
    total = read_counter(Path("/proc/meminfo"), "MemTotal:")
    if total is None:
        try:
            total = int(Path("/proc/meminfo").read_text().split()[1])
        except (OSError, ValueError, IndexError):
            total = None
    if total is not None:
        limits.append((total * 1024, "this machine has"))
    for folder in cgroup_dirs():
        for file in ("memory.max", "memory.limit_in_bytes"):
            try:
                limit = int((folder / file).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # "max": no limit
            if limit < 2**60:
                limits.append((limit, "its cgroup (container) allows"))
    return min(limits) if limits else None


def resident(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def children(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found.update(int(child) for child in (task / "children").read_text().split())
    except (OSError, ValueError):
        pass
    return found


# A process SIGKILLed while its processes held this share of the limit was killed for memory.
NEAR_LIMIT = 0.9


class MemoryWatch:
    """Samples the workers' resident memory while they run (a thread, twice a second), so that
    a worker the kernel kills for memory can be named as such, with the figures."""

    def __init__(self, config: TrainConfig, local_size: int, interval_s: float = 0.5) -> None:
        self.config, self.local_size, self.interval_s = config, local_size, interval_s
        self.last: dict[int, int] = {}  # pid -> its resident bytes when last seen
        self.total_with: dict[int, int] = {}  # pid -> all workers' bytes when it was last seen
        self.kills_before = oom_kills()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="memory-watch", daemon=True)

    def __enter__(self) -> MemoryWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()

    def sample(self) -> None:
        sizes = {pid: size for pid in children(os.getpid()) if (size := resident(pid))}
        total = sum(sizes.values())
        for pid, size in sizes.items():
            self.last[pid], self.total_with[pid] = size, total

    def watch(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.sample()

    def verdict(self, rank: int, pid: int) -> str | None:
        """The line for a worker killed by SIGKILL, when there is evidence it was for memory."""
        now = oom_kills()
        counted = any(now.get(path, 0) > before for path, before in self.kills_before.items())
        limit = memory_limit()
        held, total = self.last.get(pid), self.total_with.get(pid)
        near = limit is not None and total is not None and total >= NEAR_LIMIT * limit[0]
        evidence = counted or near
        return memory_line(rank, pid, held, total, limit, evidence, self.config, self.local_size)


def memory_line(
    rank: int, pid: int, held: int | None, total: int | None, limit: tuple[int, str] | None,
    evidence: bool, config: TrainConfig, local_size: int,
) -> str | None:  # fmt: skip
    """`rank R was killed for memory: the figures; try a smaller setting`, or None without
    evidence (a kernel OOM kill counted, or the workers at the limit when last seen)."""
    if not evidence:
        return None
    line = f"rank {rank} (pid {pid}) was killed for memory"
    if held is not None:
        line += f": it held {gib(held)}"
        if total is not None and local_size > 1:
            line += f" (this node's {local_size} processes {gib(total)})"
        if limit is not None:
            line += f" of the {gib(limit[0])} {limit[1]}"
    elif limit is not None:
        line += f": {limit[1]} {gib(limit[0])}"
    tries = []
    if config.data.batch_size > 1:
        tries.append(f"data.batch_size={config.data.batch_size // 2}")
    if local_size > 1:
        tries.append(f"--nproc-per-node {local_size // 2}")
    if tries:
        line += f"; try {' or '.join(tries)}"
    return line


# torchrun's c10d defaults (torch/distributed/elastic/rendezvous): read_timeout, join_timeout.
RDZV_DEFAULTS = {"read_timeout": 60, "join_timeout": 600}


def rendezvous_timeout(parsed: argparse.Namespace, key: str) -> int:
    return int(_parse_rendezvous_config(parsed.rdzv_conf).get(key, RDZV_DEFAULTS[key]))


def rendezvous_problem(parsed: argparse.Namespace, err: RendezvousError) -> str:
    """The one line for a rendezvous that never gathered this node with the others."""
    endpoint = parsed.rdzv_endpoint
    if isinstance(err, RendezvousConnectionError):
        seconds = rendezvous_timeout(parsed, "read_timeout")
        return (f"could not reach the rendezvous at {endpoint} within {seconds} s (--rdzv-conf "
                "read_timeout; deploy.rdzv_timeout_s in k8s/): the node that hosts it (pod 0) has "
                f"not started, or its port is closed to this node ({err.__cause__ or err})")  # fmt: skip
    if isinstance(err, RendezvousTimeoutError):
        seconds = rendezvous_timeout(parsed, "join_timeout")
        return (f"the rendezvous at {endpoint} did not gather its {parsed.nnodes} nodes within "
                f"{seconds} s (--rdzv-conf join_timeout; deploy.rdzv_timeout_s in k8s/): a node has "
                "not started")  # fmt: skip
    return f"the rendezvous failed: {err}"


class Stopped(BaseException):
    """SIGTERM or SIGHUP before torchrun's own handlers are in place (a BaseException, as
    KeyboardInterrupt is: no `except Exception` on the way, Hydra's or torchrun's, takes it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.sigval = signal.Signals(signum)


def stop(signum: int, frame: object) -> NoReturn:
    raise Stopped(signum)


def main(argv: list[str] | None = None) -> int:
    for signum in (signal.SIGTERM, signal.SIGHUP):  # until torchrun's handlers take over
        signal.signal(signum, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # KeyboardInterrupt
    try:
        return launch(sys.argv[1:] if argv is None else argv)
    except (KeyboardInterrupt, Stopped) as err:  # a stop before the run dir is known
        name = err.sigval.name if isinstance(err, Stopped) else "SIGINT"
        print(f"{COMMAND} train: stopped by {name}", file=sys.stderr, flush=True)
        return for_signal(signal.Signals[name])


def launch(args: list[str]) -> int:
    if args[:1] != ["train"]:
        print(f"usage: {COMMAND} train [torchrun options] [overrides]  (see --help of train)",
              file=sys.stderr)  # fmt: skip
        return Exit.CONFIG_ERROR if args[:1] not in (["-h"], ["--help"]) else Exit.OK
    if args[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return Exit.OK
    parser = get_args_parser()
    parser.error = parse_error  # type: ignore[method-assign]
    try:
        options, overrides = split(args[1:], parser)
        if not given(options, "nproc-per-node"):
            local = torch.cuda.device_count() if torch.cuda.is_available() else 2
            options = ["--nproc-per-node", str(local), *options]
        if not any(given(options, name) for name in RENDEZVOUS):
            options = ["--standalone", *options]  # one node, rendezvous on a free local port
        parsed = parser.parse_args([*options, "-m", f"{PACKAGE}.train", *overrides])
        problem = option_problem(parsed, options)
        if problem:
            raise UsageError(problem)
    except (UsageError, ArgumentError) as err:
        print(f"{COMMAND} train: {err}", file=sys.stderr)
        return Exit.CONFIG_ERROR
    local_size, world_size = processes(parsed)
    one_node = world_size == local_size
    if one_node:  # its launch names the run (several nodes: config.run_name)
        os.environ.setdefault(RUN_NAME_VAR, run_name_for(time.time(), secrets.token_hex(3)))
    os.environ["LOCAL_WORLD_SIZE"], os.environ["WORLD_SIZE"] = str(local_size), str(world_size)
    config = check.compose_and_check_or_exit(overrides)  # as the workers will compose it
    # With several nodes, the default dir's name is the rendezvous's: only an explicit one is known.
    run_dir = planned_run_dir(overrides) if one_node else explicit_run_dir(overrides)
    made_here = run_dir is not None and not rundir.present(run_dir)
    new = new_part(run_dir) if made_here else None  # outputs/ too, on a first run
    # With several nodes, node 0's rank 0 may hold the run dir's lock already: the workers' own
    # guard decides then.
    problem = rundir.problem(run_dir, config, busy=one_node) if run_dir else None
    if new:  # made to check it: the workers make it (a stop before they do leaves none)
        remove_empty(run_dir, new)  # empty only: another node's workers may be writing there
    if problem:
        exit_with_error(f"config error: {problem}")
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):  # torchrun sets them per worker
        del os.environ[name]
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own choice, without its banner
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(SaidBelow())

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

    with MemoryWatch(config, local_size) as memory:
        while True:
            seen = set(memory.last)
            try:
                run(parsed)
            except RendezvousConnectionError as err:
                # The store lives in pod 0's torchrun. Once this node has trained with it, losing
                # it means pod 0 was lost (preempted, evicted): its controller starts a
                # replacement, which hosts a new store. Joining that, in this pod, costs no
                # failure under any flavor's policy; exiting would cost one per node.
                if one_node or not set(memory.last) - seen:
                    say(f": {rendezvous_problem(parsed, err)}")
                    return Exit.FAILED
                seconds = rendezvous_timeout(parsed, "read_timeout")
                say(f": lost the rendezvous at {parsed.rdzv_endpoint}, which this node trained with: "
                    f"its host (pod 0) is gone; joining its replacement's, for up to {seconds} s")  # fmt: skip
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
                say(f": {stopped(name)}")
                return for_signal(signal.Signals[name])
            else:
                return Exit.OK


if __name__ == "__main__":
    sys.exit(main())

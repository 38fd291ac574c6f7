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
process's code: 2 config, 3 collective failure, 4 diverged, 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.run import get_args_parser, run

from {{ cookiecutter.package }} import PROJECT, check, rundir
from {{ cookiecutter.package }}.config import RUN_NAME_VAR, exit_with_error, run_name_for

PACKAGE = __package__
COMMAND = PROJECT
MEANING = {
    check.EXIT_CONFIG_ERROR: "a config error, printed above",
    3: "a collective failed: the block above says why",
    4: "training diverged: the line above says what to do",
    128 + signal.SIGTERM: "stopped by SIGTERM after a checkpoint",
}
# Exits whose one line the worker printed itself: a config error, a divergence.
SAID_ALREADY = {check.EXIT_CONFIG_ERROR, 4}
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
    """(processes per node, world size) as torchrun will start them."""
    nproc = parsed.nproc_per_node
    if nproc in ("gpu", "auto"):
        nproc = torch.cuda.device_count() or os.cpu_count() or 1
    elif nproc == "cpu":
        nproc = os.cpu_count() or 1
    nodes = int(str(parsed.nnodes).split(":")[-1])
    return int(nproc), int(nproc) * nodes


class SaidBelow(logging.Filter):
    """torchrun's log lines about stopping the other workers and about the failed one: the
    launcher's own last line says the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("Sending process", "failed (exitcode"))


def explicit_run_dir(overrides: list[str]) -> Path | None:
    """hydra.run.dir when given as a plain path; a default dir is new for every launch."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "hydra.run.dir" and "${" not in value:
            return Path(value)
    return None


# Exits that follow from another process's failure: a collective that failed because its peer
# ended (3), and torchrun's own SIGTERM to the survivors.
CONSEQUENCES = {3, 128 + signal.SIGTERM, -signal.SIGTERM}


def summary(err: ChildFailedError) -> tuple[str, int]:
    """torchrun's failure table as one line, and the exit code to pass on: the process whose
    failure is a cause rather than a consequence, the earliest of those."""
    rank, failure = min(
        err.failures.items(), key=lambda item: (item[1].exitcode in CONSEQUENCES, item[1].timestamp)
    )
    if failure.exitcode < 0:
        name = failure.signal_name()
        return f"rank {rank} (pid {failure.pid}) was killed by {name}", 128 - failure.exitcode
    meaning = MEANING.get(failure.exitcode, "its error is printed above")
    return (
        f"rank {rank} (pid {failure.pid}) exited with {failure.exitcode}: {meaning}",
        failure.exitcode,
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["train"]:
        print(f"usage: {COMMAND} train [torchrun options] [overrides]  (see --help of train)",
              file=sys.stderr)  # fmt: skip
        return 2 if args[:1] not in (["-h"], ["--help"]) else 0
    if args[1:2] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    parser = get_args_parser()
    try:
        options, overrides = split(args[1:], parser)
    except UsageError as err:
        print(f"{COMMAND} train: {err}", file=sys.stderr)
        return 2
    if not given(options, "nproc-per-node"):
        local = torch.cuda.device_count() if torch.cuda.is_available() else 2
        options = ["--nproc-per-node", str(local), *options]
    if not any(given(options, name) for name in RENDEZVOUS):
        options = ["--standalone", *options]  # one node, rendezvous on a free local port
    parsed = parser.parse_args([*options, "-m", f"{PACKAGE}.train", *overrides])
    local_size, world_size = processes(parsed)
    os.environ["LOCAL_WORLD_SIZE"], os.environ["WORLD_SIZE"] = str(local_size), str(world_size)
    config = check.load_or_exit(overrides)  # as the workers will compose it
    run_dir = explicit_run_dir(overrides)
    # With several nodes, node 0's rank 0 may hold the run dir's lock already: the workers' own
    # guard decides then.
    problem = rundir.problem(run_dir, config, busy=world_size == local_size) if run_dir else None
    if problem:
        exit_with_error(f"config error: {problem}")
    for name in ("LOCAL_WORLD_SIZE", "WORLD_SIZE"):  # torchrun sets them per worker
        del os.environ[name]
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own choice, without its banner
    if world_size == local_size:  # one node: its launch names the run (several: config.run_name)
        os.environ.setdefault(RUN_NAME_VAR, run_name_for(time.time(), secrets.token_hex(3)))
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(SaidBelow())
    try:
        run(parsed)
    except ChildFailedError as err:
        line, code = summary(err)
        if code not in SAID_ALREADY:
            print(f"{COMMAND} train failed: {line}", file=sys.stderr, flush=True)
        return code
    except SignalException as err:
        print(f"{COMMAND} train: stopped by {err.sigval.name}", file=sys.stderr, flush=True)
        return 128 + err.sigval
    except RendezvousError as err:
        print(f"{COMMAND} train: the rendezvous failed: {err}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

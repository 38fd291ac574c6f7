"""torchrun's options as `<project> train` takes them: split from the Hydra overrides, completed
(--nproc-per-node, --standalone) and checked, so that a bad one is one line,
not torchrun's traceback."""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import NoReturn

import torch
from torch.distributed.elastic.multiprocessing.api import Std
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.utils import (
    _parse_rendezvous_config,
    parse_rendezvous_endpoint,
)

from .. import PACKAGE

# torchrun's own ways to name the program: the launcher always runs -m <package>.train.
PROGRAM_OPTIONS = {"--module", "--no-python", "--no_python", "--run-path", "--run_path"}
# Hydra's sweep flag (-m is torchrun's --module too), and the overrides that make a sweep.
SWEEP_FLAGS = {"-m", "--multirun"}
SWEEP_KEYS = {"hparams_search": "null", "hydra.mode": "RUN"}  # each with its value of no sweep


def sweep_refused(given: str) -> str:
    return (
        f"{given}: a sweep runs in one process per trial, python -m {PACKAGE}.train -m ..., or "
        "one Kubernetes Job per trial (docs/sweeps.md); the launcher starts one run"
    )


class UsageError(Exception):
    """A launcher argument that cannot work; the message is the one line to print."""


def split(args: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """torchrun's options, then Hydra overrides: the options are read with torchrun's own parser,
    so an option's value is never taken for an override."""
    options = parser._option_string_actions  # argparse's table of option strings
    i = 0
    while i < len(args) and args[i].startswith("-"):
        name = args[i].split("=", 1)[0]
        if name in SWEEP_FLAGS:
            raise UsageError(sweep_refused(name))
        if name in PROGRAM_OPTIONS:
            raise UsageError(f"{name}: the launcher runs -m {PACKAGE}.train itself")
        if name not in options:
            raise UsageError(
                f"{name}: not a torchrun option; Hydra's own flags (--cfg, --help, -m) go to "
                f"python -m {PACKAGE}.train"
            )
        takes_value = options[name].nargs != 0 and "=" not in args[i]
        i += 2 if takes_value else 1
    for override in args[i:]:
        key, _, value = override.lstrip("+").partition("=")
        if key in SWEEP_KEYS and value not in (SWEEP_KEYS[key], "") and override[:1] != "~":
            raise UsageError(sweep_refused(override))
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
        return (
            f"{named('nproc-per-node', nproc)}: no CUDA device is visible; "
            "give a number of processes"
        )
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
        return (
            f"{named('monitor-interval', parsed.monitor_interval)}: "
            "must be a number of seconds above 0"
        )
    if parsed.master_port is not None and not 1 <= parsed.master_port <= 65535:
        return f"{named('master-port', parsed.master_port)}: must be a port, 1 to 65535"
    backends = sorted(rendezvous_handler_registry._registry)  # torchrun's own table
    if not parsed.standalone and parsed.rdzv_backend not in backends:
        return (
            f"{named('rdzv-backend', parsed.rdzv_backend)}: no such backend; "
            f"allowed: {', '.join(backends)}"
        )
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
        return (
            f"{named('local-ranks-filter', ranks)}: "
            "must be local ranks separated by commas, e.g. 0,1"
        )
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

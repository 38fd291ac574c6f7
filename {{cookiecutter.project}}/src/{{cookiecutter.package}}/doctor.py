"""Preflight for a node: what NCCL will find here, and which profile works fastest.

    python -m {{ cookiecutter.package }}.doctor                    # report, then a recommendation
    python -m {{ cookiecutter.package }}.doctor --json             # the same, for machines
    python -m {{ cookiecutter.package }}.doctor --profiles auto pcie_safe --timeout-s 120

It prints the GPU links and a P2P matrix (what the driver claims, what a real peer copy does),
InfiniBand, /dev/shm, network interfaces and versions. Then it runs a short all-reduce under each
profile, each in its own process group under a hard timeout, and recommends the fastest profile
that works. With one GPU (or --nproc 1) there is nothing between GPUs to test: it checks the node's
facts and one process's NCCL init under each profile instead. Exit status: 0 when some profile
works, 1 when none does, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NoReturn

import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from . import nccl, probe
from .config import TrainConfig, register_configs
from .exits import Exit

PACKAGE = __package__
PROFILES = ["auto", "nccl_default", "pcie_safe", "socket"]  # one node: infiniband acts as auto
GPU_SIZES_MIB = [1, 64, 1024]
CPU_SIZES_MIB = [1, 64]
ALLREDUCE_LINE = re.compile(r"^ALLREDUCE (\{.*\})$", re.MULTILINE)
# In torchrun's output: its summary, the rank it blames, worker lines, and its own log lines.
SUMMARY = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
BLAMED = re.compile(
    r"^Root Cause \(first observed failure\):\n(?:.*\n)*?\s*rank\s*: (\d+) .*\n\s*exitcode\s*: (-?\d+)",
    re.MULTILINE,
)
RANK_LINE = re.compile(r"^\[rank(\d+)\]: ?(.*)$")
EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt)\b(?::.*)?$")
NOT_SAID_BY_A_WORKER = re.compile(
    r"^(?:[DIWEF]\d{4} \d\d:\d\d:\d\d|\*+$|Setting OMP_NUM_THREADS|Traceback \(most recent call last\)|\s|$)"
)


@dataclass
class ProfileResult:
    profile: str
    env: dict[str, str]
    result: str  # works | fails | hangs
    init_s: float | None = None
    busbw_gbps: dict[str, float] = field(default_factory=dict)
    error: str = ""


def versions() -> dict[str, str]:
    found = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "nccl": "none",
        "driver": "none",
    }
    if torch.cuda.is_available():
        found["nccl"] = ".".join(str(part) for part in torch.cuda.nccl.version())
        smi = probe.run_with_hard_timeout(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], 10, capture=True
        )
        if smi.status == "ok":
            found["driver"] = smi.output.splitlines()[0].strip()
    return found


def interfaces(sys_net: Path = Path("/sys/class/net")) -> dict[str, str]:
    """Network interfaces and their state: NCCL_SOCKET_IFNAME must name one that is up."""
    return {
        name: (sys_net / name / "operstate").read_text().strip()
        if (sys_net / name).exists()
        else "unknown"
        for _, name in socket.if_nameindex()
    }


def profile_configs(names: list[str]) -> dict[str, TrainConfig]:
    """Each profile as training would compose it, from the project's own configs/."""
    register_configs()
    with initialize_config_module(config_module=f"{PACKAGE}.configs", version_base="1.3"):
        return {
            name: OmegaConf.to_object(compose("train", overrides=[f"nccl={name}"]))
            for name in names
        }


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


def run_profile(
    name: str, env: dict[str, str], nproc: int, sizes: list[int], timeout_s: float
) -> ProfileResult:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", f"{PACKAGE}.allreduce", "--sizes-mib", *map(str, sizes)]  # fmt: skip
    outcome = probe.run_with_hard_timeout(
        command, timeout_s, env={**os.environ, **env}, capture=True
    )
    found = ALLREDUCE_LINE.search(outcome.output)
    if outcome.status == "ok" and found:
        measured = json.loads(found.group(1))
        return ProfileResult(name, env, "works", measured["init_s"], measured["busbw_gbps"])
    if outcome.status == "hang":
        return ProfileResult(name, env, "hangs", error=f"no result within {timeout_s:g} s")
    return ProfileResult(name, env, "fails", error=root_cause(outcome.output))


def recommend(results: list[ProfileResult], largest: str) -> ProfileResult | None:
    working = [r for r in results if r.result == "works" and largest in r.busbw_gbps]
    return max(working, key=lambda r: r.busbw_gbps[largest], default=None)


class Refused(Exception):
    """A bad argument for this node; one line."""


def diagnose(names: list[str], nproc: int | None, timeout_s: float) -> dict:
    gpus = probe.gpu_count()
    if nproc is None:
        nproc = gpus or 2  # gloo on CPU: two processes share the cores
    if not gpus and nproc < 2:
        raise Refused(
            f"--nproc {nproc}: without a GPU the doctor checks gloo between processes; use 2 or more"
        )
    if gpus and nproc > gpus:
        raise Refused(
            f"--nproc {nproc}: {gpus} GPU(s) visible here, and NCCL needs a GPU per process; "
            f"use at most {gpus}"
        )
    between = nproc > 1  # one NCCL process: no link between GPUs is used
    # The decision as training on this one node would make it, with one process per GPU.
    os.environ.setdefault("WORLD_SIZE", str(nproc))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(nproc))
    links = probe.topology(gpus)
    pairs = [(i, j) for i in range(gpus) for j in range(i + 1, gpus)]
    tested = probe.peer_copy_tests(pairs)  # every pair here, NVLink ones too: claimed vs tested
    pcie_tests = {pair: result for pair, result in tested.items() if pair not in links.nvlink_pairs}
    facts = replace(probe.basic_facts(), nvlink_pairs=links.nvlink_pairs, p2p_tests=pcie_tests)
    report = {
        "versions": versions(),
        "gpus": gpus,
        "nproc": nproc,
        "between_gpus": between,
        "links_from": links.source,
        "p2p": [
            {
                "pair": f"GPU{i}-GPU{j}",
                "link": "NVLink" if (i, j) in links.nvlink_pairs else "PCIe",
                "claimed": links.claimed_p2p.get((i, j)),
                "tested": tested[(i, j)],
            }
            for i, j in pairs
        ],
        "infiniband_active_ports": facts.ib_active_ports,
        "dev_shm_bytes": facts.shm_bytes,
        "interfaces": interfaces(),
    }
    if gpus == 0:
        report["note"] = (
            "no CUDA device is visible: NCCL cannot run here; checked gloo on CPU instead"
        )
        sizes = CPU_SIZES_MIB
        results = [run_profile("gloo (CPU)", {}, nproc, sizes, timeout_s)]
    else:
        decisions = {
            name: nccl.decide(cfg.nccl, facts, os.environ)
            for name, cfg in profile_configs(names).items()
        }
        if "auto" in decisions:
            report["auto_decision"] = decisions["auto"].report(only_nccl=True)
        sizes = GPU_SIZES_MIB if between else []
        if not between:
            report["note"] = (
                f"{'One GPU' if gpus == 1 else f'--nproc 1 of {gpus} GPUs'}: nothing between GPUs "
                "to test (NCCL needs a GPU per process); checked the node's facts above and one "
                "process's NCCL init under each profile"
            )
        results = [
            run_profile(name, decisions[name].env, nproc, sizes, timeout_s) for name in names
        ]
    report["sizes"] = [f"{mib}MiB" for mib in sizes]
    report["profiles"] = [asdict(r) for r in results]
    report["ok"] = any(r.result == "works" for r in results)
    best = recommend(results, report["sizes"][-1]) if sizes else None
    report["recommended"] = best.profile if best else None
    if best and gpus:
        report["pin"] = (
            f"- nccl: {best.profile}    # in the defaults list of configs/train.yaml; or override nccl={best.profile}"
        )
    return report


def gbps(value: float | None) -> str:
    return f"{value:8.1f}" if value is not None else "       -"


def render(report: dict) -> str:
    v = report["versions"]
    lines = [
        f"torch {v['torch']}, CUDA {v['cuda']}, NCCL {v['nccl']}, driver {v['driver']}",
        f"GPUs: {report['gpus']}, links from {report['links_from']}; testing with {report['nproc']} process{'es' if report['nproc'] > 1 else ''}",
    ]
    if report["p2p"]:
        lines += ["", "P2P matrix       link     claimed  peer copy"]
        for row in report["p2p"]:
            claimed = {True: "yes", False: "no", None: "?"}[row["claimed"]]
            lines.append(f"  {row['pair']:<14} {row['link']:<8} {claimed:<8} {row['tested']}")
    shm = report["dev_shm_bytes"]
    lines += [
        "",
        f"InfiniBand: {report['infiniband_active_ports']} active port(s)",
        f"/dev/shm: {shm / 2**20:.0f} MiB" if shm is not None else "/dev/shm: unknown",
        "Interfaces: "
        + ", ".join(f"{name} ({state})" for name, state in report["interfaces"].items()),
    ]
    if "note" in report:
        lines += ["", report["note"]]
    if "auto_decision" in report:
        lines += ["", "nccl=auto decides here:", report["auto_decision"]]
    sizes = report["sizes"]
    lines += [
        "",
        f"{'profile':<14}{'result':<8}{'init':>7}"
        + "".join(f"{s:>9}" for s in sizes)
        + ("   (bus GB/s)" if sizes else ""),
    ]
    for r in report["profiles"]:
        init = f"{r['init_s']:6.1f}s" if r["init_s"] is not None else "      -"
        row = f"{r['profile']:<14}{r['result']:<8}{init}" + "".join(
            gbps(r["busbw_gbps"].get(s)) + " " for s in sizes
        )
        lines.append(row.rstrip() + (f"   {r['error']}" if r["error"] else ""))
    if report.get("pin"):
        lines += ["", f"Recommended: nccl={report['recommended']}, the fastest profile that works here. Pin it:",
                  f"  {report['pin']}"]  # fmt: skip
        results = {
            r["profile"]: r["busbw_gbps"] for r in report["profiles"] if r["result"] == "works"
        }
        largest = report["sizes"][-1]
        if report["recommended"] != "auto" and "auto" in results:
            share = results["auto"][largest] / results[report["recommended"]][largest]
            lines.append(f"  (nccl=auto, the default, reaches {share:.0%} of it at {largest})")
    elif report["recommended"]:
        lines += ["", "gloo works on CPU."]
    elif not report["between_gpus"]:
        works = [r["profile"] for r in report["profiles"] if r["result"] == "works"]
        lines += ["", f"Nothing between GPUs to test here. One process's NCCL init works under "
                      f"{', '.join(works)}; training on one GPU needs no profile choice."
                  if works else "One process's NCCL init fails under every profile: read the "
                  "errors above; NCCL_DEBUG=INFO shows more."]  # fmt: skip
    else:
        lines += ["", "No profile works. Read the errors above; NCCL_DEBUG=INFO shows more."]
    return "\n".join(lines)


class Parser(argparse.ArgumentParser):
    """A bad argument is one line, without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(Exit.CONFIG_ERROR, f"{self.prog}: {message}\n")


def at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(
                f"must be a whole number, at least {low}; got {text!r}"
            )
        return value

    return parse


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0; got {text!r}")
    return value


def main() -> int:
    parser = Parser(
        prog=f"{PACKAGE}.doctor", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the report"
    )
    parser.add_argument("--profiles", nargs="+", choices=PROFILES, default=PROFILES)
    parser.add_argument(
        "--nproc", type=at_least(1), help="processes to test with (default: all GPUs, or 2 on CPU)"
    )
    parser.add_argument(
        "--timeout-s", type=seconds, default=90, help="per profile; past it the profile 'hangs'"
    )
    args = parser.parse_args()
    try:
        report = diagnose(args.profiles, args.nproc, args.timeout_s)
    except Refused as err:
        parser.exit(Exit.CONFIG_ERROR, f"{parser.prog}: {err}\n")
    print(json.dumps(report, indent=2) if args.json else render(report))
    return Exit.OK if report["ok"] else Exit.FAILED


if __name__ == "__main__":
    sys.exit(main())

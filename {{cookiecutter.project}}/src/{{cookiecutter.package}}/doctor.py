"""Preflight for a node: what NCCL will find here, and which profile works fastest.

    python -m {{ cookiecutter.package }}.doctor           # report, then a recommendation
    python -m {{ cookiecutter.package }}.doctor --json    # the same, for machines
    python -m {{ cookiecutter.package }}.doctor --profiles auto pcie_safe --timeout-s 120

It prints the GPU links and a P2P matrix (what the driver claims, what a real peer copy does),
InfiniBand, /dev/shm, network interfaces and versions. Then it runs a short all-reduce under each
profile, each in its own process group under a hard timeout, and recommends the fastest profile
that works. With one GPU (or --nproc 1) there is nothing between GPUs to test: it checks the node's
facts and one process's NCCL init under each profile instead. Exit status: 0 when some profile
works, 1 when none does, 2 for a bad argument.

Several nodes (`make k8s-doctor` runs this in an Indexed Job of the training pods' spec):

    python -m {{ cookiecutter.package }}.doctor --nnodes 2 --node-rank 0 \\
        --master-addr localhost --master-port 29500 \\
        --training-profile auto --training-vars NCCL_IB_DISABLE

Every node's doctor joins node 0's at --master-addr:--master-port; then, one profile at a time and
all nodes together, one torchrun per node (static rendezvous at --master-port + 1) all-reduces
between every process of every node. The infiniband profile gets a row. Training's own profile runs
first, in the environment the pod has (the manifest's env, as training gets it); the other profiles
run without the variables --training-vars names, which the manifest set for training's profile.
Node 0 prints the table. Every node exits with node 0's verdict: 0 when training's profile works
across all nodes (start training), 1 when it fails or hangs there, or a node did not join (the
report names the fastest profile that works as the remedy), 2 for a bad argument.
"""

# ruff: noqa: E402 (the imports after the start-up handler below)
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NoReturn

from . import PACKAGE
from .core.cli import Parser, at_least, seconds
from .core.exits import Exit
from .core.world import World
from .launcher.worker_exits import root_cause

STOPPED = "stopped by SIGINT; nothing was measured to the end"


def stopped_while_starting(signum: int, frame: object) -> NoReturn:
    """Ctrl-C while torch and Hydra import (seconds): nothing has started, one line all the same
    (a KeyboardInterrupt inside an import leaves a traceback, or a half-imported module)."""
    print(f"{PACKAGE}.doctor: {STOPPED}", file=sys.stderr, flush=True)
    os._exit(Exit.INTERRUPTED)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, stopped_while_starting)

import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from .config.error import ConfigError
from .config.schema import TrainConfig, register_configs
from .nccl import decision as nccl
from .nccl import probe

PROFILES = ["auto", "nccl_default", "pcie_safe", "socket"]  # one node: infiniband acts as auto
NODES_PROFILES = [*PROFILES, "infiniband"]  # between nodes it differs: IB on, whatever auto finds
GPU_SIZES_MIB = [1, 64, 1024]
CPU_SIZES_MIB = [1, 64]
ALLREDUCE_LINE = re.compile(r"^ALLREDUCE (\{.*\})$", re.MULTILINE)


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


def run_profile(
    name: str,
    env: dict[str, str],
    nproc: int,
    sizes: list[int],
    timeout_s: float,
    rendezvous: tuple[str, ...] = ("--standalone",),
    measures: bool = True,
    base: Mapping[str, str] | None = None,
) -> ProfileResult:
    """One torchrun of allreduce under `env` on top of `base` (default: this environment);
    `measures`: it holds rank 0, which prints the result."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rendezvous,
        "--nproc-per-node",
        str(nproc),
        "-m",
        f"{PACKAGE}.nccl.allreduce",
        "--sizes-mib",
        *map(str, sizes),
    ]
    outcome = probe.run_with_hard_timeout(
        command, timeout_s, env={**(os.environ if base is None else base), **env}, capture=True
    )
    found = ALLREDUCE_LINE.search(outcome.output)
    if outcome.status == "ok" and found:
        measured = json.loads(found.group(1))
        return ProfileResult(name, env, "works", measured["init_s"], measured["busbw_gbps"])
    if outcome.status == "ok" and not measures:
        return ProfileResult(name, env, "works")  # rank 0, on node 0, reports the measurement
    if outcome.status == "hang":
        return ProfileResult(name, env, "hangs", error=f"no result within {timeout_s:g} s")
    return ProfileResult(name, env, "fails", error=root_cause(outcome.output))


def recommend(results: list[ProfileResult], largest: str) -> ProfileResult | None:
    working = [r for r in results if r.result == "works" and largest in r.busbw_gbps]
    return max(working, key=lambda r: r.busbw_gbps[largest], default=None)


class Refused(Exception):
    """A bad argument for this node; one line."""


def node_report(gpus: int, nproc: int, between: bool, world: World) -> tuple[dict, nccl.NodeFacts]:
    """This node's facts (links, a peer copy per pair, InfiniBand, /dev/shm, interfaces) as the
    report's first part, and as `auto` decides from them for a launch of `world`."""
    links = probe.topology(gpus)
    pairs = [(i, j) for i in range(gpus) for j in range(i + 1, gpus)]
    tested = probe.peer_copy_tests(pairs)  # every pair here, NVLink ones too: claimed vs tested
    pcie_tests = {pair: result for pair, result in tested.items() if pair not in links.nvlink_pairs}
    facts = replace(probe.basic_facts(world), nvlink_pairs=links.nvlink_pairs, p2p_tests=pcie_tests)
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
    return report, facts


def diagnose(names: list[str], nproc: int | None, timeout_s: float) -> dict:
    gpus = probe.gpu_count()
    if nproc is None:
        nproc = gpus or 2  # gloo on CPU: two processes share the cores
    if not gpus and nproc < 2:
        raise Refused(
            f"--nproc {nproc}: without a GPU the doctor checks gloo between processes; "
            "use 2 or more"
        )
    if gpus and nproc > gpus:
        raise Refused(
            f"--nproc {nproc}: {gpus} GPU(s) visible here, and NCCL needs a GPU per process; "
            f"use at most {gpus}"
        )
    between = nproc > 1  # one NCCL process: no link between GPUs is used
    # The decision as training on this one node would make it, with one process per GPU.
    report, facts = node_report(gpus, nproc, between, World(size=nproc, local_size=nproc))
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
            f"- nccl: {best.profile}    # in the defaults list of configs/train.yaml; "
            f"or override nccl={best.profile}"
        )
    return report


def gbps(value: float | None) -> str:
    return f"{value:8.1f}" if value is not None else "       -"


def render(report: dict) -> str:
    v = report["versions"]
    lines = [
        f"torch {v['torch']}, CUDA {v['cuda']}, NCCL {v['nccl']}, driver {v['driver']}",
        f"GPUs: {report['gpus']}, links from {report['links_from']}; "
        f"testing with {report['nproc']} process{'es' if report['nproc'] > 1 else ''}",
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
        lines += [
            "",
            f"Recommended: nccl={report['recommended']}, the fastest profile "
            "that works here. Pin it:",
            f"  {report['pin']}",
        ]
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
        lines += [
            "",
            f"Nothing between GPUs to test here. One process's NCCL init works under "
            f"{', '.join(works)}; training on one GPU needs no profile choice."
            if works
            else "One process's NCCL init fails under every profile: read the "
            "errors above; NCCL_DEBUG=INFO shows more.",
        ]
    else:
        lines += ["", "No profile works. Read the errors above; NCCL_DEBUG=INFO shows more."]
    return "\n".join(lines)


# ------------------------------------------------------------------ several nodes


@dataclass(frozen=True)
class Nodes:
    """The doctor on several nodes: this node's rank, and where node 0's doctor listens (its
    torchruns' static rendezvous takes the next port)."""

    count: int
    rank: int
    master_addr: str
    master_port: int
    join_timeout_s: float
    training_profile: str
    training_vars: tuple[str, ...]


class Control:
    """The doctors' own store on node 0: every node starts each profile together with the others
    (a torchrun of the last profile must not meet one of this), and node 0 gathers the results."""

    def __init__(self, nodes: Nodes) -> None:
        from datetime import timedelta

        from torch.distributed import TCPStore

        self.nodes = nodes
        # Waits in Python, not in TCPStore's C++: Ctrl-C stops them, and a node 0 that is late
        # (an image pull) is no wall of C++ retry logs on the others.
        if nodes.rank > 0:
            self.reachable(time.monotonic() + nodes.join_timeout_s)
        try:
            self.store = TCPStore(
                nodes.master_addr,
                nodes.master_port,
                world_size=nodes.count,
                is_master=nodes.rank == 0,
                timeout=timedelta(seconds=nodes.join_timeout_s),
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as err:  # DistStoreError is a RuntimeError
            raise NotJoined(self.not_met(str(err).splitlines()[0][:200])) from None
        self.together("joined", nodes.join_timeout_s)

    def not_met(self, why: str) -> str:
        n = self.nodes
        return (
            f"node {n.rank}: the doctors of {n.count} nodes did not meet at {n.master_addr}:"
            f"{n.master_port} within {n.join_timeout_s:g} s ({why})"
        )

    def reachable(self, deadline: float) -> None:
        while True:
            try:
                with socket.create_connection(
                    (self.nodes.master_addr, self.nodes.master_port), timeout=2
                ):
                    return
            except OSError as err:
                if time.monotonic() > deadline:
                    raise NotJoined(
                        self.not_met(f"node 0's doctor is not listening: {err}")
                    ) from None
            time.sleep(0.5)

    def together(self, key: str, within_s: float) -> None:
        """Returns once every node has reached `key`."""
        self.store.add(key, 1)
        deadline = time.monotonic() + within_s
        while self.store.add(key, 0) < self.nodes.count:
            if time.monotonic() > deadline:
                raise NotJoined(
                    self.not_met("not every node came")
                    if key == "joined"
                    else (
                        f"node {self.nodes.rank}: not every node reached {key} "
                        f"within {within_s:g} s"
                    )
                )
            time.sleep(0.05)

    def publish(self, key: str, value: dict | int) -> None:
        self.store.set(f"{key}/{self.nodes.rank}", json.dumps(value))

    def gather(self, key: str) -> list:
        return [json.loads(self.store.get(f"{key}/{rank}")) for rank in range(self.nodes.count)]


class NotJoined(Exception):
    """The nodes could not run the doctor together; one line."""


def across_nodes(results: list[dict], count: int) -> ProfileResult:
    """One profile's row from every node's: it works only where it worked on every node; the
    bandwidth is rank 0's (node 0's), which measured the all-reduce of every process."""
    first = ProfileResult(**results[0])
    for result in ("fails", "hangs"):
        bad = [(rank, r) for rank, r in enumerate(results) if r["result"] == result]
        if bad:
            rank, found = bad[0]
            where = f"node {rank}: " if count > 1 else ""
            return replace(first, result=result, busbw_gbps={}, error=where + found["error"])
    return first


def diagnose_nodes(
    names: list[str], nproc: int | None, timeout_s: float, nodes: Nodes
) -> dict | None:
    """The doctor on node `nodes.rank`: the report on node 0, None on the others."""
    gpus = probe.gpu_count()
    nproc = nproc or gpus or 1  # several nodes: one CPU process per node already makes a world
    if gpus and nproc > gpus:
        raise Refused(
            f"--nproc {nproc}: {gpus} GPU(s) visible here, and NCCL needs a GPU per process; "
            f"use at most {gpus}"
        )
    # The decision as training across these nodes would make it (auto reads the node count).
    world = World(size=nproc * nodes.count, local_size=nproc)
    report, facts = node_report(gpus, nproc, True, world)
    control = Control(nodes)
    control.publish("facts", {"gpus": gpus, "ib": facts.ib_active_ports, "shm": facts.shm_bytes})
    # Training's profile first, in the pod's env as the manifest set it; the others without what
    # the manifest set for training's profile, as each of them would be rendered.
    others = {k: v for k, v in os.environ.items() if k not in nodes.training_vars}
    rows = [nodes.training_profile, *(n for n in names if n != nodes.training_profile)]
    configs = profile_configs(rows)
    sizes = GPU_SIZES_MIB if gpus else CPU_SIZES_MIB
    rendezvous = (
        "--nnodes",
        str(nodes.count),
        "--node-rank",
        str(nodes.rank),
        "--master-addr",
        nodes.master_addr,
        "--master-port",
        str(nodes.master_port + 1),
    )
    results = []
    for index, name in enumerate(rows):
        inherited = os.environ if name == nodes.training_profile else others
        decision = nccl.decide(configs[name].nccl, facts, inherited)
        # a node that lost its profile's torchrun to the timeout catches up here, before the next
        control.together(f"start/{index}", within_s=timeout_s + 120)
        own = run_profile(
            name, decision.env, nproc, sizes, timeout_s, rendezvous, nodes.rank == 0, base=inherited
        )
        control.publish(f"result/{index}", asdict(own))
        if nodes.rank == 0:
            results.append(across_nodes(control.gather(f"result/{index}"), nodes.count))
    verdict = None
    if nodes.rank == 0:
        report |= {
            "nodes": nodes.count,
            "node_facts": control.gather("facts"),
            "training_profile": nodes.training_profile,
            "sizes": [f"{mib}MiB" for mib in sizes],
            "profiles": [asdict(r) for r in results],
        }
        if not gpus:
            report["note"] = (
                "no CUDA device is visible: each profile's row is gloo on CPU (NCCL's variables do "
                "nothing there; GLOO_* do)"
            )
        report["ok"] = results[0].result == "works"
        best = recommend(results, report["sizes"][-1])
        report["recommended"] = best.profile if best else None
        verdict = Exit.OK if report["ok"] else Exit.FAILED
        control.store.set("verdict", str(int(verdict)))
    if nodes.rank > 0:
        verdict = int(control.store.get("verdict"))
        control.store.add("read", 1)  # this node's last word to the store: node 0 may go now
        return {"verdict": verdict}
    # node 0's store lives until every other node has read the verdict
    deadline = time.monotonic() + 60
    while control.store.add("read", 0) < nodes.count - 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return report


def render_nodes(report: dict) -> str:
    """Node 0's table: every node's facts, each profile's all-reduce between all nodes' processes,
    and the verdict on training's profile."""
    v = report["versions"]
    count, nproc = report["nodes"], report["nproc"]
    lines = [
        f"torch {v['torch']}, CUDA {v['cuda']}, NCCL {v['nccl']}, driver {v['driver']}",
        f"{count} node(s), {nproc} process(es) each: "
        f"every all-reduce spans {count * nproc} process(es)",
    ]
    for rank, node in enumerate(report["node_facts"]):
        shm = f"{node['shm'] / 2**20:.0f} MiB" if node["shm"] is not None else "unknown"
        lines.append(
            f"  node {rank}: {node['gpus']} GPU(s), InfiniBand {node['ib']} active port(s), "
            f"/dev/shm {shm}"
        )
    if "note" in report:
        lines += ["", report["note"]]
    sizes = report["sizes"]
    lines += [
        "",
        f"{'profile':<14}{'result':<8}{'init':>7}"
        + "".join(f"{s:>9}" for s in sizes)
        + "   (bus GB/s)",
    ]
    for r in report["profiles"]:
        init = f"{r['init_s']:6.1f}s" if r["init_s"] is not None else "      -"
        mark = " *" if r["profile"] == report["training_profile"] else ""
        row = f"{r['profile'] + mark:<14}{r['result']:<8}{init}" + "".join(
            gbps(r["busbw_gbps"].get(s)) + " " for s in sizes
        )
        lines.append(row.rstrip() + (f"   {r['error']}" if r["error"] else ""))
    training, best = report["training_profile"], report["recommended"]
    lines += [
        "",
        f"* training's profile (nccl={training}), run in the pod's env as the manifest sets it",
    ]
    if report["ok"]:
        lines.append(
            f"Verdict: nccl={training} works across {count} nodes: start training (exit 0)."
        )
    elif best:
        lines.append(
            f"Verdict: nccl={training} does not work across {count} nodes: do not start training "
            f"(exit 1). nccl={best} works, the fastest that does: make k8s-render ARGS=nccl={best}"
        )
    else:
        lines.append(
            f"Verdict: no profile works across {count} nodes: do not start training (exit 1). "
            "Read the errors above; NCCL_DEBUG=INFO shows more."
        )
    return "\n".join(lines)


def host(text: str) -> str:
    """A host name or address for --master-addr: one word of at most 253 characters (DNS)."""
    if not text or len(text) > 253 or any(c.isspace() or not c.isprintable() for c in text):
        raise argparse.ArgumentTypeError(f"must be a host name or address, one word; got {text!r}")
    return text


def port(text: str) -> int:
    value = at_least(1)(text)
    if value > 65534:  # the next port is the torchruns' rendezvous
        raise argparse.ArgumentTypeError(
            f"must be 1 to 65534 (the next port is used too); got {text!r}"
        )
    return value


def variable(text: str) -> str:
    if not nccl.TRACKED_VAR.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"must name an NCCL_*, TORCH_NCCL_* or GLOO_* variable; got {text!r}"
        )
    return text


NODES_ONLY = (
    "node_rank",
    "master_addr",
    "master_port",
    "join_timeout_s",
    "training_profile",
    "training_vars",
)


def nodes_of(args: argparse.Namespace) -> Nodes | None:
    """--nnodes and its companions, checked together; None for the node report of one node.
    --training-profile asks for the verdict on it, on one node too (make k8s-doctor's one pod)."""
    given = [f"--{k.replace('_', '-')}" for k in NODES_ONLY if getattr(args, k) is not None]
    if args.profiles and "infiniband" in args.profiles and args.nnodes == 1:
        raise Refused(
            "--profiles infiniband: on one node it acts as auto; it differs between "
            "nodes (--nnodes 2 or more)"
        )
    if args.nnodes == 1 and args.training_profile is None:
        if given:
            raise Refused(
                f"{', '.join(given)}: only with --nnodes 2 or more, or --training-profile"
            )
        return None
    missing = [
        f"--{k.replace('_', '-')}"
        for k in ("master_addr", "master_port")
        if getattr(args, k) is None
    ]
    if missing:
        raise Refused(
            f"--nnodes {args.nnodes}: {' and '.join(missing)} must say "
            "where node 0's doctor listens"
        )
    rank = args.node_rank or 0
    if rank >= args.nnodes:
        raise Refused(f"--node-rank {rank}: must be below --nnodes {args.nnodes}")
    training = args.training_profile or default_profile()
    return Nodes(
        args.nnodes,
        rank,
        args.master_addr,
        args.master_port,
        args.join_timeout_s or 300.0,
        training,
        tuple(args.training_vars or ()),
    )


def default_profile() -> str:
    """The profile configs/train.yaml composes: training's, unless an override says otherwise."""
    register_configs()
    with initialize_config_module(config_module=f"{PACKAGE}.configs", version_base="1.3"):
        return str(compose("train").nccl.profile)


def main() -> int:
    signal.signal(
        signal.SIGINT, signal.default_int_handler
    )  # the imports are done: KeyboardInterrupt
    parser = Parser(
        prog=f"{PACKAGE}.doctor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the report"
    )
    parser.add_argument(
        "--profiles",
        nargs="+",
        choices=NODES_PROFILES,
        help=f"default: {' '.join(PROFILES)}; with --nnodes 2 or more, infiniband too",
    )
    parser.add_argument(
        "--nproc", type=at_least(1), help="processes to test with (default: all GPUs, or 2 on CPU)"
    )
    parser.add_argument(
        "--timeout-s", type=seconds, default=90, help="per profile; past it the profile 'hangs'"
    )
    nodes = parser.add_argument_group("several nodes (make k8s-doctor's pods)")
    nodes.add_argument(
        "--nnodes", type=at_least(1), default=1, help="nodes that run the doctor together"
    )
    nodes.add_argument("--node-rank", type=at_least(0), help="this node's rank, 0 to --nnodes - 1")
    nodes.add_argument("--master-addr", type=host, help="node 0 (node 0 itself: localhost)")
    nodes.add_argument(
        "--master-port", type=port, help="node 0's doctor; the next port: its torchruns"
    )
    nodes.add_argument(
        "--join-timeout-s",
        type=seconds,
        help="how long the nodes wait for each other (default 300)",
    )
    nodes.add_argument(
        "--training-profile",
        choices=NODES_PROFILES,
        help="training's NCCL profile: the verdict (default: configs/train.yaml's)",
    )
    nodes.add_argument(
        "--training-vars",
        nargs="*",
        type=variable,
        metavar="VAR",
        help="the variables the manifest sets for training's profile",
    )
    args = parser.parse_args()
    try:
        several = nodes_of(args)
        if several is None:
            report = diagnose(args.profiles or PROFILES, args.nproc, args.timeout_s)
        else:
            report = diagnose_nodes(
                args.profiles or (NODES_PROFILES if several.count > 1 else PROFILES),
                args.nproc,
                args.timeout_s,
                several,
            )
    except Refused as err:
        parser.exit(Exit.CONFIG_ERROR, f"{parser.prog}: {err}\n")
    except ConfigError as err:  # an option of model.py or data.py registered twice (registry)
        parser.exit(Exit.CONFIG_ERROR, f"config error: {err}\n")
    except NotJoined as err:
        parser.exit(
            Exit.FAILED,
            f"{parser.prog}: {err}; do not start training: "
            "the nodes could not all-reduce together\n",
        )
    except KeyboardInterrupt:
        parser.exit(Exit.INTERRUPTED, f"{parser.prog}: {STOPPED}\n")
    if several is not None and several.rank > 0:
        print(
            f"node {several.rank}: results sent to node 0, which prints the table; "
            f"its verdict: exit {report['verdict']}"
        )
        return report["verdict"]
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report) if several is None else render_nodes(report))
    return Exit.OK if report["ok"] else Exit.FAILED


if __name__ == "__main__":
    sys.exit(main())

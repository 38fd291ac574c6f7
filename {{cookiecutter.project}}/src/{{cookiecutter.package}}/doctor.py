"""Preflight for a node: what NCCL will find here, and which profile works fastest.

    python -m {{ cookiecutter.package }}.doctor                    # report, then a recommendation
    python -m {{ cookiecutter.package }}.doctor --json             # the same, for machines
    python -m {{ cookiecutter.package }}.doctor --profiles auto pcie_safe --timeout-s 120

It prints the GPU links and a P2P matrix (what the driver claims, what a real peer copy does),
InfiniBand, /dev/shm, network interfaces and versions. Then it runs a short all-reduce under each
profile, each in its own process group under a hard timeout, and recommends the fastest profile
that works. Exit status: 0 when some profile works, 1 when none does.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from {{ cookiecutter.package }} import nccl, probe
from {{ cookiecutter.package }}.config import TrainConfig, register_configs

PACKAGE = __package__
PROFILES = ["auto", "nccl_default", "pcie_safe", "socket"]  # one node: infiniband acts as auto
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
    last = [line for line in outcome.output.splitlines() if line.strip()][-3:]
    return ProfileResult(name, env, "fails", error=" | ".join(last)[-400:])


def recommend(results: list[ProfileResult], largest: str) -> ProfileResult | None:
    working = [r for r in results if r.result == "works" and largest in r.busbw_gbps]
    return max(working, key=lambda r: r.busbw_gbps[largest], default=None)


def diagnose(names: list[str], nproc: int | None, timeout_s: float) -> dict:
    gpus = probe.gpu_count()
    nproc = nproc or (gpus if gpus >= 2 else 2)
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
        sizes = GPU_SIZES_MIB
        results = [
            run_profile(name, decisions[name].env, nproc, sizes, timeout_s) for name in names
        ]
    report["sizes"] = [f"{mib}MiB" for mib in sizes]
    report["profiles"] = [asdict(r) for r in results]
    best = recommend(results, report["sizes"][-1])
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
        f"GPUs: {report['gpus']}, links from {report['links_from']}; testing with {report['nproc']} processes",
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
        + "   (bus GB/s)",
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
    else:
        lines += ["", "No profile works. Read the errors above; NCCL_DEBUG=INFO shows more."]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of the report"
    )
    parser.add_argument("--profiles", nargs="+", choices=PROFILES, default=PROFILES)
    parser.add_argument(
        "--nproc", type=int, help="processes to test with (default: all GPUs, or 2 on CPU)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=90, help="per profile; past it the profile 'hangs'"
    )
    args = parser.parse_args()
    report = diagnose(args.profiles, args.nproc, args.timeout_s)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["recommended"] else 1


if __name__ == "__main__":
    sys.exit(main())

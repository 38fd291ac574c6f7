"""The manifests' own launch lines, run as 2 nodes on this machine (CPU, gloo).

Each "node" is a process tree started with the trainer container's command, args and env from a
fresh render of k8s/, plus what Kubernetes adds: the pod's hostname, JOB_COMPLETION_INDEX and
POD_IP for a Job or JobSet, the training operator's PET_* variables for a PyTorchJob, and Trainer's
for a TrainJob. Two network namespaces joined by a veth pair act as two hosts, each with an
/etc/hosts that holds the pods' DNS names; where namespaces cannot be made, private mount and UTS
namespaces give each node its own loopback address and hostname instead. As in the pods, the
root filesystem is read-only: only /tmp (which holds the run dir here) and /dev/shm are writable.
"""

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import yaml
from conftest import deploy_defaults, launcher_bin, read_metrics, trainer_container, worker_pids
from torch.distributed.run import config_from_args

from ddp_project import launch
from ddp_project.config import compose as check
from ddp_project.k8s import render
from ddp_project.k8s.flavors import FLAVORS
from ddp_project.k8s.pods import nccl_env
from ddp_project.launch import COMMAND
from ddp_project.run.checkpoint import checkpoint_paths

NODES, GPUS = 2, 2
SUBNET = "10.231.7"  # host i is SUBNET.(i + 1)
# The kill comes at the first checkpoint: the 300 steps after it (seconds, even on a loaded
# machine) keep the run from finishing first, and are all the restart has to train. The restart
# tests run 1 process per node: what they test is each node's torchrun, and every process costs
# seconds of CPU at each start.
STEPS = ("trainer.max_steps=400", "trainer.log_every=50", "trainer.checkpoint_every=100")
# Two failures in one run: the second (at the checkpoint after the first's resume) has as many
# steps after it as the first.
LONGER_STEPS = ("trainer.max_steps=500", *STEPS[1:])
# What the pods of each flavor are called, and the DNS name of pod i (Kubernetes' naming).
POD_NAMES = {
    "job": lambda name, i: (f"{name}-{i}", f"{name}-{i}.{name}"),
    "jobset": lambda name, i: (f"{name}-node-0-{i}", f"{name}-node-0-{i}.{name}"),
    "pytorchjob": lambda name, i: (f"{name}-worker-{i}",),  # the operator's Service per pod
    "trainjob": lambda name, i: (f"{name}-node-0-{i}", f"{name}-node-0-{i}.{name}"),  # a JobSet's
}
# This project's own flavor's launch line trains on two nodes: the short training the template
# runs for each of its renders too (pytest -m render: tests/conftest.py). Each other flavor's
# launch line is resolved, node by node, to the torchrun launch it makes, and compared with the
# own flavor's (a launch costs seconds of CPU per process).
OWN_FLAVOR = deploy_defaults()["flavor"]
OTHER_FLAVORS = [flavor for flavor in FLAVORS if flavor != OWN_FLAVOR]  # each needs its POD_NAMES
# The pod's hostname, and its read-only root filesystem (readOnlyRootFilesystem) with /tmp, its
# emptyDir, still writable; /dev/shm is a mount of its own.
AS_A_POD = 'hostname "$0" && mount --bind /tmp /tmp && mount -o remount,bind,ro / && exec "$@"'


class Host(NamedTuple):
    prefix: list[str]  # runs a command on this host, under its pod's hostname
    address: str  # the pod IP


def allowed(*command: str) -> bool:
    return (
        shutil.which(command[0]) is not None
        and subprocess.run(command, capture_output=True).returncode == 0
    )


def hosts_file(names: list[tuple[str, ...]], addresses: list[str]) -> str:
    lines = ["127.0.0.1 localhost"] + [
        f"{address} {' '.join(aliases)}" for address, aliases in zip(addresses, names, strict=True)
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")  # not module: that would put these tests on one xdist worker
def hosts() -> Iterator:
    """hosts(names) -> one Host per node; names[i] are node i's hostname, then its other
    DNS names."""
    # Named per instance: a module that imports this fixture (test_k8s_doctor) gets an instance
    # of its own, beside this module's in the same process; reused names would fail `ip netns add`.
    instance = secrets.token_hex(2)
    netns = [f"ddp{os.getpid()}{instance}n{i}" for i in range(NODES)]
    if allowed("ip", "netns", "add", netns[0]):
        subprocess.run(["ip", "netns", "add", netns[1]], check=True)
        veth = [f"v{os.getpid() % 100000}{instance}n{i}" for i in range(NODES)]
        subprocess.run(
            [
                "ip",
                "link",
                "add",
                veth[0],
                "netns",
                netns[0],
                "type",
                "veth",
                "peer",
                "name",
                veth[1],
                "netns",
                netns[1],
            ],
            check=True,
        )
        addresses = [f"{SUBNET}.{i + 1}" for i in range(NODES)]
        for i, ns in enumerate(netns):
            for step in (
                ["addr", "add", f"{addresses[i]}/24", "dev", veth[i]],
                ["link", "set", veth[i], "up"],
                ["link", "set", "lo", "up"],
            ):
                subprocess.run(["ip", "-n", ns, *step], check=True)

        def two_hosts(names: list[tuple[str, ...]]) -> list[Host]:
            for ns in netns:  # `ip netns exec` mounts this over /etc/hosts
                (Path("/etc/netns") / ns).mkdir(parents=True, exist_ok=True)
                (Path("/etc/netns") / ns / "hosts").write_text(hosts_file(names, addresses))
            return [
                Host(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "unshare",
                        "--uts",
                        "--mount",
                        "sh",
                        "-c",
                        AS_A_POD,
                        names[i][0],
                    ],
                    addresses[i],
                )
                for i, ns in enumerate(netns)
            ]

        two_hosts.netns, two_hosts.veth, two_hosts.addresses = netns, veth, addresses
        yield two_hosts
        for ns in netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    elif allowed("unshare", "--mount", "--uts", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"):

        def loopback(names: list[tuple[str, ...]]) -> list[Host]:
            addresses = [f"127.0.0.{i + 1}" for i in range(NODES)]  # all of 127/8 is loopback
            private = Path(f"/tmp/ddp-hosts-{os.getpid()}")
            private.write_text(hosts_file(names, addresses))
            setup = f"mount --bind {private} /etc/hosts && {AS_A_POD}"
            return [
                Host(["unshare", "--mount", "--uts", "sh", "-c", setup, names[i][0]], addresses[i])
                for i in range(NODES)
            ]

        yield loopback
    else:
        pytest.skip("needs network namespaces or `unshare --mount --uts` (root)")


def rendered_pods(flavor: str, gpus: int, *deploy: str) -> dict:
    """The pods' manifest object (Job, JobSet or PyTorchJob) and its trainer container, rendered
    as `python -m <pkg>.k8s` renders it for NODES nodes, with the `deploy` overrides; in this
    process, because that command writes its overrides into the project's configs/."""
    config = check.compose_and_check(
        [
            f"deploy.flavor={flavor}",
            f"deploy.nodes={NODES}",
            f"deploy.gpus_per_node={gpus}",
            "deploy.runs_access_mode=ReadWriteMany",
            *deploy,
        ],
        this_node=False,
    )
    deploy, profile = render.deploy_and_profile(config)
    manifest = yaml.safe_load(render.manifests(deploy, nccl_env(profile))[f"{flavor}.yaml"])
    if flavor == "job":
        assert manifest["spec"]["completionMode"] == "Indexed"
    return manifest, trainer_container(flavor, manifest)


def operator_env(pytorchjob: dict, port: int) -> dict[str, str]:
    """What the training operator sets from elasticPolicy (pkg/controller.v1/pytorch/elastic.go)."""
    spec, name = pytorchjob["spec"], pytorchjob["metadata"]["name"]
    policy = spec["elasticPolicy"]
    return {
        "PET_RDZV_ENDPOINT": f"{policy.get('rdzvHost', f'{name}-worker-0')}:{port}",
        "PET_RDZV_BACKEND": policy["rdzvBackend"],
        "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
        "PET_MAX_RESTARTS": str(policy["maxRestarts"]),
        "PET_RDZV_CONF": ",".join(f"{c['key']}={c['value']}" for c in policy.get("rdzvConf", [])),
        "PET_RDZV_ID": policy["rdzvId"],
        "PET_NPROC_PER_NODE": spec["nprocPerNode"],
    }


def trainer_env(trainjob: dict, port: int) -> dict[str, str]:
    """What Kubeflow Trainer v2.3's torch plugin sets (pkg/runtime/framework/plugins/torch/torch.go,
    EnforceMLPolicy): numNodes, numProcPerNode, and pod 0 of the JobSet's replicated Job "node"
    as the master; PET_NODE_RANK is the pod's completion index, set per node."""
    name, trainer = trainjob["metadata"]["name"], trainjob["spec"]["trainer"]
    return {
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": str(port),  # Trainer's 29500, which may be taken on this machine
    }


def node_env(container: dict, index: int, host: Host, port: int) -> dict[str, str]:
    """The container's env on node `index`, the downward API's fields filled in."""
    env = {
        **os.environ,
        "PATH": f"{launcher_bin()}:{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    fields = {"status.podIP": host.address}
    for variable in container["env"]:
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:  # the completion-index annotation or the pod IP
            path = variable["valueFrom"]["fieldRef"]["fieldPath"]
            env[variable["name"]] = fields.get(path, str(index))
    if "RDZV_PORT" in env:
        env["RDZV_PORT"] = str(port)  # the manifest's port may be taken on this machine
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(
    hosts,
    flavor: str,
    tmp_path: Path,
    run_dir: Path,
    *overrides: str,
    only: int | None = None,
    port: int | None = None,
    gpus: int = GPUS,
    devices: list[str] | None = None,
    deploy: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen]:
    """Every node (or node `only`), started with the manifest's command, args and env, rendered
    with the `deploy` overrides, and `env` on top; devices[i] is node i's CUDA_VISIBLE_DEVICES,
    as the device plugin would give its pod."""
    manifest, container = rendered_pods(flavor, gpus, *deploy)
    name = manifest["metadata"]["name"]
    args = [
        f"hydra.run.dir={run_dir}" if a.startswith("hydra.run.dir=") else a
        for a in container["args"]
    ]
    port = port or free_port()
    operator = {"pytorchjob": operator_env, "trainjob": trainer_env}.get(flavor)
    injected = operator(manifest, port) if operator else {}
    names = [POD_NAMES[flavor](name, i) for i in range(NODES)]
    rdzv_host = next((v["value"] for v in container["env"] if v["name"] == "RDZV_HOST"), None)
    assert rdzv_host in (None, *names[0])  # the manifest names pod 0 as Kubernetes does
    assert injected.get("PET_MASTER_ADDR") in (None, *names[0])
    return [
        subprocess.Popen(
            [*host.prefix, *container["command"], *args, *overrides],
            env={
                **node_env(container, index, host, port),
                **injected,
                **({"PET_NODE_RANK": str(index)} if flavor == "trainjob" else {}),
                **({"CUDA_VISIBLE_DEVICES": devices[index]} if devices else {}),
                **(env or {}),
            },
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index, host in enumerate(hosts(names))
        if only is None or index == only
    ]


def resume_lines(log: Path) -> list[str]:
    """Rank 0's "resumed from the checkpoint of step N ..." lines, one per resume."""
    text = log.read_text() if log.exists() else ""
    return re.findall(r"resumed from the checkpoint of step .*", text)


def wait_for_checkpoint(
    nodes: list[subprocess.Popen], run_dir: Path, after_resume: int = 0
) -> str | None:
    """Until a checkpoint is saved, or with after_resume=N, until the Nth resume has saved a
    newer checkpoint than the one it resumed from: that resume's line."""
    deadline = time.monotonic() + 180
    while True:
        steps = [int(path.stem.split("_")[1]) for path in checkpoint_paths(run_dir)]
        if not after_resume and steps:
            return None
        resumes = resume_lines(run_dir / "train.log")
        if after_resume and len(resumes) >= after_resume:
            step = int(re.match(r"resumed from the checkpoint of step (\d+)", resumes[-1])[1])
            if any(saved > step for saved in steps):
                return resumes[after_resume - 1]
        assert all(node.poll() is None for node in nodes), "a node ended before its checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.1)


def finish(nodes: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each node's output, once all have ended within `timeout` seconds; else they are killed
    and the test fails with the end of each node's output."""
    deadline = time.monotonic() + timeout
    try:
        return [node.communicate(timeout=max(deadline - time.monotonic(), 0))[0] for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            if node.poll() is None:
                for worker in worker_pids(node.pid).values():
                    os.kill(worker, signal.SIGKILL)
                node.kill()
        tails = [f"--- node {i}:\n{node.communicate()[0][-4000:]}" for i, node in enumerate(nodes)]
        pytest.fail(f"nodes still running after {timeout} s\n" + "\n".join(tails))


def assert_resumed_and_finished(
    nodes, outputs, run_dir: Path, world_size: int, steps: tuple[str, ...] = STEPS
) -> None:
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]
    rows = read_metrics(run_dir)
    assert rows[-1]["step"] == int(steps[0].split("=")[1])
    assert all(row["world_size"] == world_size for row in rows)
    assert "resumed from the checkpoint of step" in (run_dir / "train.log").read_text()


def node_gpus(flavor: str) -> int:
    """2 processes per node for the Job; 1 for the others, which read the count from the same
    deploy.gpus_per_node (a process less per node is seconds of CPU less)."""
    return GPUS if flavor == "job" else 1


@pytest.mark.slow  # pod 0 started 15 s late (a slow image pull), on purpose
@pytest.mark.parametrize("flavor", [pytest.param(OWN_FLAVOR, marks=pytest.mark.render)])
def test_the_manifests_launch_line_trains_on_two_nodes(hosts, tmp_path, flavor):
    """Pod 1 starts first and pod 0, which hosts the rendezvous, 15 s later (a slow image pull),
    within deploy.rdzv_timeout_s: pod 1 waits for it, and the two train together. The timeout
    leaves pod 0 minutes to start: on a loaded machine its start-up alone takes tens of seconds."""
    gpus = node_gpus(flavor)
    run_dir = tmp_path / "run"
    late = dict(port=free_port(), gpus=gpus, deploy=("deploy.rdzv_timeout_s=180",))
    overrides = ("trainer.max_steps=20", "trainer.log_every=10")
    (first,) = launch_nodes(hosts, flavor, tmp_path, run_dir, *overrides, only=1, **late)
    time.sleep(15)
    assert first.poll() is None, first.communicate()[0][-3000:]
    nodes = [*launch_nodes(hosts, flavor, tmp_path, run_dir, *overrides, only=0, **late), first]
    outputs = finish(nodes, timeout=240)
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]
        # the caches went to HOME=/tmp, not to a read-only home (matplotlib warns there)
        assert "not a writable directory" not in output, output[-3000:]
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [10, 20]
    assert all(row["world_size"] == NODES * gpus for row in rows)
    assert f"world size {NODES * gpus}, backend gloo" in (run_dir / "train.log").read_text()


def resolved_launches(flavor: str, gpus: int, tmp_path: Path, monkeypatch) -> list[dict]:
    """Each node's torchrun launch, as the manifest's launch line makes it, without starting it:
    the container's command, run by sh in the pod's env (a stand-in `<project>` notes the
    arguments it is given), then those arguments through the launcher (in this process, with
    torchrun's run() noting what it is given), then torchrun's own config_from_args. The launch
    config, the rendezvous endpoint's host named as the pod it reaches."""
    manifest, container = rendered_pods(flavor, gpus)
    name = manifest["metadata"]["name"]
    names = [POD_NAMES[flavor](name, i) for i in range(NODES)]
    addresses = [f"{SUBNET}.{i + 1}" for i in range(NODES)]
    port = 29400  # nothing listens: no launch starts
    operator = {"pytorchjob": operator_env, "trainjob": trainer_env}.get(flavor)
    injected = operator(manifest, port) if operator else {}
    stand_in = tmp_path / "bin"
    stand_in.mkdir(exist_ok=True)
    (stand_in / COMMAND).write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$NOTED_ARGS"\n')
    (stand_in / COMMAND).chmod(0o755)
    args = [
        f"hydra.run.dir={tmp_path / 'run'}" if a.startswith("hydra.run.dir=") else a
        for a in container["args"]
    ]
    given = []
    monkeypatch.setattr(launch, "run", given.append)
    resolved = []
    for index in range(NODES):
        env = {
            **node_env(container, index, Host([], addresses[index]), port),
            **injected,
            **({"PET_NODE_RANK": str(index)} if flavor == "trainjob" else {}),
        }
        noted = tmp_path / f"{flavor}-{index}.args"
        env["NOTED_ARGS"] = str(noted)
        env["PATH"] = f"{stand_in}:{env['PATH']}"
        subprocess.run([*container["command"], *args], env=env, check=True)
        argv = noted.read_text().split("\0")[:-1]
        # torchrun's parser reads PET_* as it is made: this process gets the pod's env, put back
        # by monkeypatch when the test ends (launcher_state: what launch() adds)
        for name in set(os.environ) - set(env):
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert launch.launch(argv) == 0
        config, _, command = config_from_args(given[-1])
        launched = {field.name: getattr(config, field.name) for field in fields(config)}
        logs_specs = vars(config.logs_specs)
        launched["logs_specs"] = {k: v for k, v in logs_specs.items() if k != "_root_log_dir"}
        launched["command"] = command
        # Pod 0 hosts the rendezvous: torchrun there knows the endpoint for its own by the name
        # localhost or its hostname; the others reach it by a DNS name of pod 0.
        host, _, rdzv_port = config.rdzv_endpoint.rpartition(":")
        if index == 0 and host in ("localhost", names[0][0]):
            host = "pod 0, itself"
        elif index > 0 and host in names[0]:
            host = "pod 0"
        launched["rdzv_endpoint"] = f"{host}:{rdzv_port}"
        # The address the node gives the others: its pod IP, or without --local-addr, its
        # hostname (socket.getfqdn()), which for a PyTorchJob's pod is the name of a Service of
        # its own (the operator's), at that IP.
        if config.local_addr is None and flavor == "pytorchjob":
            launched["local_addr"] = addresses[index]
        launched["local_addr"] = {addresses[index]: "its pod IP"}.get(
            launched["local_addr"], launched["local_addr"]
        )
        resolved.append(launched)
    return resolved


@pytest.mark.usefixtures("launcher_state")
@pytest.mark.parametrize("flavor", OTHER_FLAVORS)
def test_each_flavors_launch_line_makes_the_launch_that_trains_on_two_nodes(
    tmp_path, monkeypatch, flavor
):
    """Node by node, the torchrun launch that this flavor's launch line makes is the own
    flavor's, which trains on two nodes above: the same nodes, processes, rendezvous (at pod 0,
    by a name Kubernetes gives it), restarts, program and overrides."""
    gpus = node_gpus(OWN_FLAVOR)  # as it trains
    own = resolved_launches(OWN_FLAVOR, gpus, tmp_path, monkeypatch)
    theirs = resolved_launches(flavor, gpus, tmp_path, monkeypatch)
    assert theirs == own


def pod_failure_verdict(job: dict, exit_code: int, disrupted: bool) -> str:
    """What the Job controller does with a pod that failed with `exit_code`, with the condition
    DisruptionTarget when `disrupted` (a preemption, eviction or drain), by the Job's
    podFailurePolicy: the action of the first rule that matches, else Count (against
    backoffLimit), as Kubernetes' Job controller decides it."""
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        if codes and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            return rule["action"]
        conditions = rule.get("onPodConditions", [])
        if disrupted and {"type": "DisruptionTarget", "status": "True"} in conditions:
            return rule["action"]
    return "Count"


def lose_pod(node: subprocess.Popen) -> int:
    """The whole pod, as a preemption ends it: its workers (torchrun starts them in sessions of
    their own), then torchrun. Returns the container's exit code."""
    for worker in worker_pids(node.pid).values():
        os.kill(worker, signal.SIGKILL)
    os.kill(node.pid, signal.SIGKILL)
    node.communicate()
    return 128 + signal.SIGKILL


def lose_node_silently(hosts, index: int, node: subprocess.Popen) -> None:
    """Node `index` goes as a node lost without a word does (powered off, its link cut): its
    link goes down first, so that nothing its processes' deaths send (FIN, RST) reaches the
    others, then its pod's processes are killed. Its pod IP goes with it; the link comes back up
    with a new one for the replacement pod, which the DNS names (hosts files) now reach. Packets
    for the old IP find no host: nothing answers them, not even with a reset."""
    ns, veth, old = hosts.netns[index], hosts.veth[index], hosts.addresses[index]
    subprocess.run(["ip", "-n", ns, "link", "set", veth, "down"], check=True)
    lose_pod(node)
    new = f"{SUBNET}.{index + 1 + NODES}"
    for step in (
        ["addr", "del", f"{old}/24", "dev", veth],
        ["addr", "add", f"{new}/24", "dev", veth],
        ["link", "set", veth, "up"],
    ):
        subprocess.run(["ip", "-n", ns, *step], check=True)
    hosts.addresses[index] = new


@pytest.mark.slow
@pytest.mark.timeout(900)  # a first checkpoint, then one after each of three resumes, then the end
def test_a_killed_worker_restarts_in_place_then_a_lost_pod_1_and_a_lost_pod_0_cost_nothing(
    hosts, tmp_path
):
    """One run, three failures, each recovered without a failure the Job counts.

    A worker dies: torchrun --max-restarts on both nodes stops its workers (on the failure, or
    on seeing a node wait in the rendezvous) and starts new ones, which meet in a new rendezvous
    round and resume from the newest checkpoint. No pod is lost: both torchruns live on and
    train on to a newer checkpoint.

    Then pod 1 is lost, and its controller starts a replacement with the same launch line: the
    other node's torchrun restarts its workers into the new rendezvous round, to a newer
    checkpoint.

    Then pod 0, which hosts the rendezvous, is lost, and its replacement starts seconds later:
    the survivor's launcher joins the replacement's rendezvous instead of failing its pod, and
    every rank resumes from the newest checkpoint, to the end. The lost pods' exits are ignored
    by the rendered podFailurePolicy; no other pod fails."""
    run_dir = tmp_path / "run"
    log = run_dir / "train.log"
    port = free_port()
    deploy = ("deploy.rdzv_timeout_s=180",)  # the replacement of pod 0 starts within it, loaded too
    nodes = launch_nodes(
        hosts,
        "job",
        tmp_path,
        run_dir,
        *LONGER_STEPS,
        "dist.timeout_s=15",
        port=port,
        gpus=1,
        deploy=deploy,
    )
    wait_for_checkpoint(nodes, run_dir)
    victim = sorted(worker_pids(nodes[1].pid).values())[-1]
    os.kill(victim, signal.SIGKILL)
    # both torchruns live on: their new workers resume, and train on to the next checkpoint
    resumed = wait_for_checkpoint(nodes, run_dir, after_resume=1)
    assert all(node.poll() is None for node in nodes)
    assert victim not in worker_pids(nodes[1].pid).values() != {}
    assert all(row["world_size"] == NODES for row in read_metrics(run_dir))
    assert resumed.startswith("resumed from the checkpoint of step"), resumed

    lost = [lose_pod(nodes[1])]
    (replacement,) = launch_nodes(
        hosts, "job", tmp_path, run_dir, *LONGER_STEPS, only=1, port=port, gpus=1, deploy=deploy
    )
    nodes = [nodes[0], replacement]
    assert wait_for_checkpoint(nodes, run_dir, after_resume=2), (
        "the replacement's round did not resume"
    )

    lost.append(lose_pod(nodes[0]))
    time.sleep(5)  # a replacement pod takes seconds to be scheduled and start
    (replacement,) = launch_nodes(
        hosts, "job", tmp_path, run_dir, *LONGER_STEPS, only=0, port=port, gpus=1, deploy=deploy
    )
    nodes = [replacement, nodes[1]]
    outputs = finish(nodes, timeout=240)
    assert_resumed_and_finished(nodes, outputs, run_dir, world_size=NODES, steps=LONGER_STEPS)
    assert len(resume_lines(log)) >= 3, "pod 0's replacement's round did not resume"
    joined = re.findall(r"lost the rendezvous at .*", outputs[1])
    assert len(joined) == 1 and "joining its replacement's, for up to 180 s" in joined[0], outputs[
        1
    ][-3000:]
    job, _ = rendered_pods("job", 1, *deploy)
    assert [pod_failure_verdict(job, code, disrupted=True) for code in lost] == ["Ignore", "Ignore"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # a first checkpoint, a replacement 30 s after the loss, then the end
def test_pod_0_lost_silently_is_given_up_within_the_timeout_and_its_replacement_joined(
    hosts, tmp_path, figure
):
    """Pod 0's node goes silent (link down, then its IP gone): nothing resets the survivor's
    connections to the rendezvous store, which torchrun's agent reads with no timeout of its
    own, so the kernel would retransmit for about 16 minutes (tcp_retries2) while the
    replacement pod times out waiting for it. With deploy.rdzv_timeout_s=60 the survivor's
    launcher gives the silent host up at 30 s, saying so while it waits, joins the replacement
    that starts 30 s after the loss at a new IP, and every rank resumes from the newest
    checkpoint, to the end: no pod of the survivor fails."""
    if not hasattr(hosts, "netns"):
        pytest.skip("needs network namespaces (root): a node lost silently is a link cut")
    run_dir = tmp_path / "run"
    port = free_port()
    deploy = ("deploy.rdzv_timeout_s=60",)
    start = dict(port=port, gpus=1, deploy=deploy)
    nodes = launch_nodes(hosts, "job", tmp_path, run_dir, *STEPS, "dist.timeout_s=15", **start)
    wait_for_checkpoint(nodes, run_dir)
    lost_at = time.monotonic()
    lose_node_silently(hosts, 0, nodes[0])
    time.sleep(max(0.0, 30 - (time.monotonic() - lost_at)))  # the replacement pod's start
    (replacement,) = launch_nodes(hosts, "job", tmp_path, run_dir, *STEPS, only=0, **start)
    nodes = [replacement, nodes[1]]
    wait_for_checkpoint(nodes, run_dir, after_resume=1)
    training_again = time.monotonic() - lost_at
    outputs = finish(nodes, timeout=300)
    assert_resumed_and_finished(nodes, outputs, run_dir, world_size=NODES)
    survivor = outputs[1]
    waiting = re.findall(
        r"the rendezvous host \S+ \(pod 0\) has not answered for (\d+) s; this node "
        r"gives it up at 30 s",
        survivor,
    )
    assert waiting[:2] == ["10", "20"], survivor[-3000:]
    joined = re.findall(r"lost the rendezvous at .*", survivor)
    assert len(joined) == 1, survivor[-3000:]
    assert "joining its replacement's, for up to 60 s" in joined[0], survivor[-3000:]
    figure(
        f"pod 0 lost silently (deploy.rdzv_timeout_s=60, its replacement 30 s later): training "
        f"again, resumed, {training_again:.0f} s after the loss"
    )


# Installed as sitecustomize in a node's processes: the seconds torchrun's run() took in its
# launcher land in LAUNCH_CLOCK/<pid> (the launcher's own clock, from the rendezvous's start: a
# loaded machine's slow start-up before it is not counted).
LAUNCH_CLOCK = """
import importlib.abc, importlib.util, os, sys, time


class _OnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.distributed.run":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _run = module.run

            def _timed_run(*args, **kwargs):
                started = time.monotonic()
                try:
                    return _run(*args, **kwargs)
                finally:
                    seconds = time.monotonic() - started
                    with open(
                        os.path.join(os.environ["LAUNCH_CLOCK"], str(os.getpid())), "w"
                    ) as out:
                        out.write(str(seconds))

            module.run = _timed_run

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _OnImport())
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_pod_alone_past_deploy_rdzv_timeout_s_ends_in_one_line_naming_it(hosts, tmp_path, figure):
    """Pod 1 with no pod 0 to reach, and pod 0 with no pod 1 to join it (each with a rendezvous
    of its own): each ends after deploy.rdzv_timeout_s, not torchrun's 60 or 600 s, in one line
    that names the setting. Timed by each launcher's own clock from its rendezvous's start."""
    deploy = ("deploy.rdzv_timeout_s=10",)
    hook, clock = tmp_path / "hook", tmp_path / "clock"
    hook.mkdir()
    clock.mkdir()
    (hook / "sitecustomize.py").write_text(LAUNCH_CLOCK)
    env = {"PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}", "LAUNCH_CLOCK": str(clock)}
    alone = [
        node
        for index in (0, 1)
        for node in launch_nodes(
            hosts,
            "job",
            tmp_path,
            tmp_path / f"run{index}",
            "trainer.max_steps=20",
            only=index,
            port=free_port(),
            gpus=1,
            deploy=deploy,
            env=env,
        )
    ]
    outputs = finish(alone, timeout=240)
    assert [node.returncode for node in alone] == [1, 1], outputs
    waited = sorted(float(path.read_text()) for path in clock.iterdir())
    figure("each launcher's rendezvous gave up after " + " and ".join(f"{s:.1f} s" for s in waited))
    assert len(waited) == 2 and max(waited) < 40, (waited, outputs)  # torch's own: 60 s, 600 s
    host, peer = (output.strip().splitlines() for output in outputs)
    assert len(host) == 1 and re.fullmatch(
        rf"{COMMAND} train: the rendezvous at localhost:\d+ did not gather its 2 nodes within 10 s "
        r"\(--rdzv-conf join_timeout; deploy.rdzv_timeout_s in k8s/\): a node has not started",
        host[0],
    ), host
    assert len(peer) == 1 and re.match(
        rf"{COMMAND} train: could not reach the rendezvous at {COMMAND}-0.{COMMAND}:\d+ "
        r"within 10 s \(--rdzv-conf read_timeout; deploy.rdzv_timeout_s in k8s/\): the node that "
        r"hosts it \(pod 0\) has not started, or its port is closed to this node "
        r"\(The client socket has timed out",
        peer[0],
    ), peer


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_a_killed_worker_restarts_one_gpu_nodes_in_place_over_nccl(hosts, tmp_path):
    """The same in-place restart under NCCL: 2 nodes x 1 GPU, the Job's launch line. The two
    "nodes" share a host but not a hostname, so NCCL joins them over sockets, as across nodes."""
    run_dir = tmp_path / "run"
    steps = ("trainer.max_steps=6000", "trainer.log_every=500", "trainer.checkpoint_every=1000")
    nodes = launch_nodes(
        hosts, "job", tmp_path, run_dir, *steps, "dist.timeout_s=30", gpus=1, devices=["0", "1"]
    )
    wait_for_checkpoint(nodes, run_dir)
    killed_at = time.monotonic()
    os.kill(sorted(worker_pids(nodes[1].pid).values())[-1], signal.SIGKILL)
    outputs = finish(nodes, timeout=240)
    assert_resumed_and_finished(nodes, outputs, run_dir, world_size=2, steps=steps)
    log = (run_dir / "train.log").read_text()
    assert "backend nccl, gate all-reduce passed" in log
    print(
        f"\nGPU-RESULT in-place restart over NCCL: {time.monotonic() - killed_at:.1f} s from the "
        f"kill to the end of {steps[0]}"
    )

"""The Indexed Job's own launch line, run as 2 nodes x 2 processes on this machine (CPU, gloo).

Each "node" is a process tree started with the container's command, args and env from the
rendered manifest, and JOB_COMPLETION_INDEX as the Job controller would set it. Two network
namespaces joined by a veth pair act as two hosts, each with an /etc/hosts that names pod 0's
Service address; where namespaces cannot be made, a private mount namespace maps that name to
the loopback address instead.
"""

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import PACKAGE, read_metrics, worker_pid

NODES, GPUS = 2, 2
SUBNET = "10.231.7"  # host i is SUBNET.(i + 1)


def allowed(*command: str) -> bool:
    return (
        shutil.which(command[0]) is not None
        and subprocess.run(command, capture_output=True).returncode == 0
    )


@pytest.fixture(scope="module")
def hosts() -> Iterator:
    """hosts(service_name) -> one command prefix per node, under which that name reaches node 0."""
    names = [f"ddp{os.getpid()}n{i}" for i in range(NODES)]
    if allowed("ip", "netns", "add", names[0]):
        subprocess.run(["ip", "netns", "add", names[1]], check=True)
        veth = [f"v{os.getpid() % 100000}n{i}" for i in range(NODES)]
        subprocess.run(["ip", "link", "add", veth[0], "netns", names[0], "type", "veth",
                        "peer", "name", veth[1], "netns", names[1]], check=True)  # fmt: skip
        for i, name in enumerate(names):
            for step in (["addr", "add", f"{SUBNET}.{i + 1}/24", "dev", veth[i]],
                         ["link", "set", veth[i], "up"], ["link", "set", "lo", "up"]):  # fmt: skip
                subprocess.run(["ip", "-n", name, *step], check=True)

        def two_hosts(service: str) -> list[list[str]]:
            for i, name in enumerate(names):  # `ip netns exec` mounts these over /etc/hosts
                (Path("/etc/netns") / name).mkdir(parents=True, exist_ok=True)
                (Path("/etc/netns") / name / "hosts").write_text(
                    f"127.0.0.1 localhost\n{SUBNET}.{i + 1} {socket.gethostname()}\n"
                    f"{SUBNET}.1 {service}\n"
                )
            return [["ip", "netns", "exec", name] for name in names]

        yield two_hosts
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    elif allowed("unshare", "--mount", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"):

        def loopback(service: str) -> list[list[str]]:
            private = Path(f"/tmp/ddp-hosts-{os.getpid()}")
            private.write_text(Path("/etc/hosts").read_text() + f"\n127.0.0.1 {service}\n")
            mount = 'mount --bind "$0" /etc/hosts && exec "$@"'
            return [["unshare", "--mount", "sh", "-c", mount, str(private)]] * NODES

        yield loopback
    else:
        pytest.skip("needs network namespaces or `unshare --mount` (root)")


def rendered_container(out: Path, flavor: str) -> dict:
    """The trainer container of the pods, from a fresh render of k8s/ for NODES nodes."""
    render = [sys.executable, "-m", f"{PACKAGE}.k8s", "--out", str(out), f"deploy.flavor={flavor}",
              f"deploy.nodes={NODES}", f"deploy.gpus_per_node={GPUS}"]  # fmt: skip
    subprocess.run(render, check=True, capture_output=True)
    if flavor == "jobset":
        (replicated,) = yaml.safe_load((out / "jobset.yaml").read_text())["spec"]["replicatedJobs"]
        job_spec = replicated["template"]["spec"]
    else:
        job_spec = yaml.safe_load((out / "job.yaml").read_text())["spec"]
    assert job_spec["completionMode"] == "Indexed"
    (container,) = job_spec["template"]["spec"]["containers"]
    return container


def node_env(container: dict, index: int, port: int) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    for variable in container["env"]:
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        else:  # the completion-index annotation, through the downward API
            env[variable["name"]] = str(index)
    env["RDZV_PORT"] = str(port)  # the manifest's port may be taken on this machine
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_nodes(
    hosts, flavor: str, tmp_path: Path, run_dir: Path, *overrides: str
) -> list[subprocess.Popen]:
    """Every node of the Job, started with the manifest's command, args and env."""
    container = rendered_container(tmp_path / "k8s", flavor)
    env = {variable["name"]: variable.get("value") for variable in container["env"]}
    args = [
        f"hydra.run.dir={run_dir}" if a.startswith("hydra.run.dir=") else a
        for a in container["args"]
    ]
    port = free_port()
    return [
        subprocess.Popen(
            [*prefix, *container["command"], *args, *overrides],
            env=node_env(container, index, port),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for index, prefix in enumerate(hosts(env["RDZV_HOST"]))
    ]


@pytest.mark.parametrize("flavor", ["job", "jobset"])
def test_the_jobs_launch_line_trains_on_two_nodes(hosts, tmp_path, flavor):
    run_dir = tmp_path / "run"
    nodes = launch_nodes(
        hosts, flavor, tmp_path, run_dir, "trainer.max_steps=20", "trainer.log_every=10"
    )
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [10, 20]
    assert all(row["world_size"] == NODES * GPUS for row in rows)
    assert "world size 4, backend gloo" in (run_dir / "train.log").read_text()


def test_a_lost_node_fails_the_others_fast_and_a_relaunch_resumes(hosts, tmp_path):
    """What the Job does when a pod dies: the other nodes' collectives fail within
    dist.timeout_s and their pods fail too; the replacement pods start the same launch line
    and every rank resumes from the newest checkpoint in the shared run dir."""
    import signal
    import time

    run_dir = tmp_path / "run"
    steps = ("trainer.max_steps=3000", "trainer.log_every=100", "trainer.checkpoint_every=200")
    nodes = launch_nodes(hosts, "job", tmp_path, run_dir, *steps, "dist.timeout_s=15")
    try:
        deadline = time.monotonic() + 180
        while not list((run_dir / "checkpoints").glob("step_*.pt")):
            assert all(node.poll() is None for node in nodes), (
                "a node ended before its first checkpoint"
            )
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.1)
        # The whole pod: its workers (torchrun starts them in sessions of their own), then torchrun.
        for rank in range(GPUS, 2 * GPUS):
            os.kill(worker_pid(nodes[1].pid, rank), signal.SIGKILL)
        os.kill(nodes[1].pid, signal.SIGKILL)
        lost_at = time.monotonic()
        survivor = nodes[0].communicate(timeout=120)[0]
        assert nodes[0].returncode != 0
        assert time.monotonic() - lost_at < 15 + 60, "the surviving node did not give up in time"
        assert "A collective failed on rank" in survivor
    finally:
        for node in nodes:
            for rank in range(NODES * GPUS):
                if node.poll() is None and (worker := worker_pid(node.pid, rank)):
                    os.kill(worker, signal.SIGKILL)
            if node.poll() is None:
                node.kill()
            node.communicate()

    relaunched = launch_nodes(hosts, "job", tmp_path, run_dir, *steps)
    outputs = [node.communicate(timeout=300)[0] for node in relaunched]
    for node, output in zip(relaunched, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]
    assert read_metrics(run_dir)[-1]["step"] == 3000
    assert "resumed from the checkpoint of step" in (run_dir / "train.log").read_text()

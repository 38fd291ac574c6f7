"""make k8s-doctor: the doctor's Job is the training pods with another command, and its own label;
its launch line, run as 2 nodes on this machine (CPU, gloo, network namespaces: test_multinode's
hosts), all-reduces between the nodes and exits with the verdict on training's profile."""

# ruff: noqa: F811 (test_multinode's hosts fixture, imported: the tests take it by that name)

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import PACKAGE, trainer_container
from test_multinode import NODES, finish, free_port, hosts, node_env  # noqa: F401

from ddp_project import PROJECT, doctor
from ddp_project.config import compose as check
from ddp_project.k8s import apply, cluster, render
from ddp_project.k8s import doctor as k8s_doctor
from ddp_project.k8s.flavors import FLAVORS
from ddp_project.k8s.meta import COMPONENT_LABEL, NAME_LABEL, PART_OF_LABEL
from ddp_project.k8s.pods import nccl_env

# Placement and platform settings, so that "the same pods" means something.
PLATFORM = (
    "+deploy.node_selector={nvidia.com/gpu.product: H200}",
    "deploy.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
    "deploy.one_pod_per_node=true",
    "+deploy.env={WANDB_PROJECT: doctor-test}",
)


def rendered(flavor: str, nodes: int, *overrides: str) -> tuple[dict, list[dict]]:
    """The training workload and the doctor's objects, from one composed config."""
    config = check.compose_and_check(
        [
            f"deploy.flavor={flavor}",
            f"deploy.nodes={nodes}",
            "deploy.runs_access_mode=ReadWriteMany",
            *overrides,
        ],
        this_node=False,
    )
    deploy, profile = render.deploy_and_profile(config)
    training = yaml.safe_load(render.manifests(deploy, nccl_env(profile))[f"{flavor}.yaml"])
    return training, k8s_doctor.objects(deploy, profile)


def training_pod(flavor: str, workload: dict) -> dict:
    spec = workload["spec"]
    return {
        "job": lambda: spec["template"],
        "jobset": lambda: spec["replicatedJobs"][0]["template"]["spec"]["template"],
        "pytorchjob": lambda: spec["pytorchReplicaSpecs"]["Worker"]["template"],
        "trainjob": lambda: cluster.pod_template(workload),
    }[flavor]()


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_the_doctor_job_is_the_training_pods_with_another_command(flavor, nodes):
    """Image, resources, env (the NCCL profile's, deploy.env's), security, placement and the node
    count are training's; the command and args, the name, the component label and the runs claim
    (which the doctor does not mount) are not."""
    training, found = rendered(flavor, nodes, "nccl=pcie_safe", *PLATFORM)
    job = found[0]
    name = training["metadata"]["name"]
    assert [o["kind"] for o in found] == ["Job", "Service"][:nodes]
    assert all(o["metadata"]["name"] == f"{name}-doctor" for o in found)
    for obj in found:
        assert obj["metadata"]["labels"] == {
            NAME_LABEL: name,
            COMPONENT_LABEL: "doctor",
            PART_OF_LABEL: PROJECT,
        }
        assert obj["metadata"]["namespace"] == training["metadata"]["namespace"]
    spec = job["spec"]
    assert spec["backoffLimit"] == 0 and spec["ttlSecondsAfterFinished"] == 3600
    assert 0 < spec["activeDeadlineSeconds"] <= 3600
    assert spec.get("completions", 1) == nodes
    assert spec.get("completionMode") == ("Indexed" if nodes > 1 else None)
    pod, theirs = job["spec"]["template"], training_pod(flavor, training)
    assert pod["metadata"]["labels"][COMPONENT_LABEL] == "doctor"
    assert theirs["metadata"]["labels"][COMPONENT_LABEL] == "training"
    (mine,) = pod["spec"]["containers"]
    ours = trainer_container(flavor, training)
    for key in ("image", "securityContext"):
        assert (
            mine[key] == (ours if flavor != "trainjob" else theirs["spec"]["containers"][0])[key]
        ), key
    assert mine["resources"] == ours.get("resources", ours.get("resourcesPerNode"))
    plain = {e["name"]: e["value"] for e in mine["env"] if "value" in e}
    for variable in ours["env"]:
        if "value" in variable and variable["name"] not in ("RDZV_HOST", "RDZV_PORT"):
            assert plain[variable["name"]] == variable["value"], variable
    assert plain["NCCL_P2P_DISABLE"] == "1" and plain["WANDB_PROJECT"] == "doctor-test"
    for key in ("nodeSelector", "tolerations", "affinity", "securityContext"):
        assert pod["spec"].get(key) == theirs["spec"].get(key), key
    assert pod["spec"]["automountServiceAccountToken"] is False  # a TrainJob's: its ServiceAccount
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["dshm", "tmp"]  # no runs claim
    assert {v["name"]: v for v in theirs["spec"]["volumes"]}["dshm"] == pod["spec"]["volumes"][0]
    assert mine["command"] != ours["command"]
    args = mine["args"]
    assert args[args.index("--training-profile") + 1] == "pcie_safe"
    assert args[args.index("--training-vars") + 1 :] == ["NCCL_IB_DISABLE", "NCCL_P2P_DISABLE"]
    assert args[args.index("--nnodes") + 1] == str(nodes)


def test_make_k8s_apply_never_deletes_the_doctor_and_the_doctor_deletes_only_its_job():
    """apply.to_delete (make k8s-apply) passes over the doctor's objects on the cluster; the
    doctor's delete selects its component only."""
    training, found = rendered("job", 2)
    service = {**training, "kind": "Service"}
    there = [*found, training, service]
    gone = apply.to_delete([training], there)
    assert all(o["metadata"]["labels"][COMPONENT_LABEL] == "training" for o in gone)
    assert training in gone and not [o for o in gone if o in found]


def doctor_cli(
    *args: str, path: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"PATH": path} if path is not None else {})}
    return subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.k8s.doctor", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--wait-s", "abc"],
            "argument --wait-s: must be a number of seconds above 0 and at most a week; got 'abc'",
        ),
        (
            ["--wait-s", "0"],
            "argument --wait-s: must be a number of seconds above 0 and at most a week; got '0'",
        ),
        (
            ["--wait-s", ""],
            "argument --wait-s: must be a number of seconds above 0 and at most a week; got ''",
        ),
        (["--wait-s", "1e308"], "at most a week; got '1e308'"),
        (["--wait-s", "nan"], "at most a week; got 'nan'"),
        (["deploy.nodes=0"], "config error: deploy.nodes"),
        (["deploy.nodes=abc"], "config error: deploy.nodes"),
    ],
)
def test_a_bad_k8s_doctor_argument_is_one_line(args, says):
    done = doctor_cli(*args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and says in lines[0], done.stderr


def test_k8s_doctor_without_kubectl_or_a_cluster_is_one_line(tmp_path):
    """No kubectl on PATH; a kubectl with no API server behind it (a kubeconfig naming a port
    where nothing listens): one line each, nothing applied."""
    python_only = str(Path(sys.executable).parent)
    done = doctor_cli(path=python_only)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        "make k8s-doctor: kubectl is not on PATH; "
        f"python -m {PACKAGE}.k8s.doctor --print writes the manifests"
    ]
    if not os.access("/usr/local/bin/kubectl", os.X_OK) and not any(
        Path(p, "kubectl").is_file() for p in os.environ["PATH"].split(os.pathsep)
    ):
        pytest.skip("no kubectl here for the no-cluster case")
    config = tmp_path / "kubeconfig"
    port = free_port()
    config.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "gone",
                "clusters": [{"name": "gone", "cluster": {"server": f"https://127.0.0.1:{port}"}}],
                "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "u"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
            }
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.k8s.doctor"],
        capture_output=True,
        text=True,
        env={**os.environ, "KUBECONFIG": str(config)},
        timeout=180,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith(
        f"make k8s-doctor: no API server reachable at https://127.0.0.1:{port}"
    )
    assert lines[0].endswith("nothing was changed")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (
            ["--nnodes", "2"],
            "--nnodes 2: --master-addr and --master-port must say where node 0's doctor listens",
        ),
        (
            ["--nnodes", "2", "--master-addr", "h", "--master-port", "1", "--node-rank", "2"],
            "--node-rank 2: must be below --nnodes 2",
        ),
        (["--nnodes", "0"], "argument --nnodes: must be a whole number, at least 1; got '0'"),
        (
            ["--master-port", "65535"],
            "argument --master-port: must be 1 to 65534 (the next port is used too); got '65535'",
        ),
        (
            ["--master-port", "x"],
            "argument --master-port: must be a whole number, at least 1; got 'x'",
        ),
        (
            ["--master-addr", ""],
            "argument --master-addr: must be a host name or address, one word; got ''",
        ),
        (
            ["--master-addr", "a b"],
            "argument --master-addr: must be a host name or address, one word; got 'a b'",
        ),
        (
            ["--master-addr", "h" * 254],
            "argument --master-addr: must be a host name or address, one word",
        ),
        (
            ["--training-vars", "LD_PRELOAD"],
            "argument --training-vars: must name an NCCL_*, TORCH_NCCL_* or GLOO_* variable; "
            "got 'LD_PRELOAD'",
        ),
        (["--training-profile", "fast"], "argument --training-profile: invalid choice: 'fast'"),
        (
            ["--join-timeout-s", "inf"],
            "argument --join-timeout-s: must be a number of seconds above 0; got 'inf'",
        ),
        (["--node-rank", "1"], "--node-rank: only with --nnodes 2 or more, or --training-profile"),
        (["--profiles", "infiniband"], "--profiles infiniband: on one node it acts as auto"),
    ],
)
def test_a_bad_nodes_argument_of_the_doctor_is_one_line(monkeypatch, capsys, args, says):
    monkeypatch.setattr(sys, "argv", ["doctor", *args])
    with pytest.raises(SystemExit) as stop:
        doctor.main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def launch_doctor(
    hosts, tmp_path: Path, *overrides: str, extra: tuple[str, ...] = ()
) -> list[subprocess.Popen]:  # noqa: F811
    """Each node started with the doctor Job's container command, args and env, as its pod would
    be (test_multinode's hosts and node_env); `extra` after the rendered args."""
    _, found = rendered("job", NODES, "deploy.gpus_per_node=1", *overrides)
    job = found[0]
    name = job["metadata"]["name"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    port = free_port()
    names = [(f"{name}-{i}", f"{name}-{i}.{name}") for i in range(NODES)]
    rdzv_host = next(v["value"] for v in container["env"] if v["name"] == "RDZV_HOST")
    assert rdzv_host == names[0][1]  # the manifest names pod 0 as Kubernetes does
    return [
        subprocess.Popen(
            [*host.prefix, *container["command"], *container["args"], *extra],
            env=node_env(container, index, host, port),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for index, host in enumerate(hosts(names))
    ]


QUICK = ("--profiles", "auto", "socket", "--timeout-s", "120")  # a loaded machine: no false "hangs"


def test_the_doctor_jobs_launch_line_all_reduces_across_two_nodes_and_says_start(hosts, tmp_path):
    """Pod 0 prints the table of every profile between both nodes' processes, training's first;
    every pod exits 0: training's profile works."""
    started = time.monotonic()
    nodes = launch_doctor(hosts, tmp_path, extra=QUICK)
    outputs = finish(nodes, timeout=300)
    assert [n.returncode for n in nodes] == [0, 0], outputs
    table = outputs[0]
    assert "2 node(s), 1 process(es) each: every all-reduce spans 2 process(es)" in table
    rows = [line.split() for line in table.splitlines() if line.startswith(("auto", "socket"))]
    assert [row[:3] for row in rows] == [["auto", "*", "works"], ["socket", "works", *rows[1][2:3]]]
    assert all(float(gbps) > 0 for gbps in rows[0][-2:])
    assert "Verdict: nccl=auto works across 2 nodes: start training (exit 0)." in table
    assert (
        outputs[1]
        .strip()
        .endswith("node 1: results sent to node 0, which prints the table; its verdict: exit 0")
    )
    print(f"two-node doctor: {time.monotonic() - started:.0f} s")


@pytest.mark.slow
def test_a_training_profile_that_fails_across_nodes_fails_the_doctor_and_names_the_remedy(
    hosts, tmp_path
):
    """Training's profile carries a GLOO_SOCKET_IFNAME no node has (nccl.env, as a wrong
    interface name would be): its row fails on both nodes, fast; the other profiles run without
    it and work; every pod exits 1 and pod 0 names the profile that works."""
    bad = ("nccl=socket", "+nccl.env.GLOO_SOCKET_IFNAME=nosuch0")
    nodes = launch_doctor(hosts, tmp_path, *bad, extra=QUICK)
    outputs = finish(nodes, timeout=300)
    assert [n.returncode for n in nodes] == [1, 1], outputs
    table = outputs[0]
    (socket_row,) = [line for line in table.splitlines() if line.startswith("socket *")]
    assert "fails" in socket_row and "Unable to find address for: nosuch0" in socket_row
    (auto_row,) = [line for line in table.splitlines() if line.startswith("auto ")]
    assert "works" in auto_row
    assert (
        "Verdict: nccl=socket does not work across 2 nodes: do not start training (exit 1). "
        "nccl=auto works, the fastest that does: make k8s-render ARGS=nccl=auto"
    ) in table


def test_a_profile_works_across_nodes_only_where_it_worked_on_every_node():
    """Node 0 measured a bandwidth, node 1's torchrun failed: the row fails, naming node 1; a hang
    on one node (and no failure) is a hang; all nodes working keeps node 0's measurement."""
    works = {
        "profile": "auto",
        "env": {},
        "result": "works",
        "init_s": 0.5,
        "busbw_gbps": {"1MiB": 3.0},
        "error": "",
    }
    fails = {
        **works,
        "result": "fails",
        "init_s": None,
        "busbw_gbps": {},
        "error": "rank 1: RuntimeError: x",
    }
    hangs = {
        **works,
        "result": "hangs",
        "init_s": None,
        "busbw_gbps": {},
        "error": "no result within 9 s",
    }
    row = doctor.across_nodes([works, fails], 2)
    assert (row.result, row.error, row.busbw_gbps) == (
        "fails",
        "node 1: rank 1: RuntimeError: x",
        {},
    )
    assert doctor.across_nodes([hangs, works], 2).error == "node 0: no result within 9 s"
    assert doctor.across_nodes([hangs, fails], 2).result == "fails"  # the cause, not its echo
    assert doctor.across_nodes([works, works], 2) == doctor.ProfileResult(**works)


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def doctor_node(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            f"{PACKAGE}.doctor",
            "--nnodes",
            "2",
            "--master-addr",
            "localhost",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow  # a launch stopped by SIGINT
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_doctor_waiting_for_the_other_nodes_stops_at_ctrl_c_in_one_line(rank):
    """Node 0 waiting for the others, node 1 for node 0 (an image still pulling): SIGINT stops
    either at once, with one line and 130, not at the end of --join-timeout-s."""
    port = free_port()
    node = doctor_node("--node-rank", rank, "--master-port", str(port), "--join-timeout-s", "600")
    if rank == "0":  # waiting once it listens for the others
        deadline = time.monotonic() + 300
        while not listening(port) and node.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    else:  # its imports, then the wait (a SIGINT during the imports is one line too)
        time.sleep(8)
    node.send_signal(signal.SIGINT)
    out, err = node.communicate(timeout=30)
    assert node.returncode == 130 and out == "", out + err
    assert err == f"{PACKAGE}.doctor: stopped by SIGINT; nothing was measured to the end\n"


def test_a_node_whose_node_0_never_comes_says_so_in_one_line():
    """No doctor at --master-addr: exit 1 after --join-timeout-s, one line naming the address,
    and none of TCPStore's C++ retry logs."""
    port = free_port()
    node = doctor_node("--node-rank", "1", "--master-port", str(port), "--join-timeout-s", "2")
    out, err = node.communicate(timeout=60)
    assert node.returncode == 1 and out == "", out + err
    assert err.startswith(
        f"{PACKAGE}.doctor: node 1: the doctors of 2 nodes did not meet "
        f"at localhost:{port} within 2 s"
    )
    assert len(err.splitlines()) == 1 and err.rstrip().endswith(
        "do not start training: the nodes could not all-reduce together"
    )


@pytest.mark.slow  # a launch stopped by SIGINT
def test_k8s_doctor_stops_at_ctrl_c_in_one_line_naming_what_may_be_left(tmp_path):
    """SIGINT while kubectl is busy (here a kubectl that never answers): one line, 130, naming
    the Job that may be running and the command that stops it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text("#!/bin/sh\nsleep 60\n")
    (bin_dir / "kubectl").chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    running = subprocess.Popen(
        [sys.executable, "-m", f"{PACKAGE}.k8s.doctor"],
        env={**os.environ, "PATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(10)  # the config composed; kubectl's dry run under way
    running.send_signal(signal.SIGINT)
    out, err = running.communicate(timeout=30)
    assert running.returncode == 130, out + err
    assert err == (
        "make k8s-doctor: stopped by SIGINT; job/ddp-project-doctor may be running: "
        "kubectl delete -n default job/ddp-project-doctor stops it\n"
    )


# A caller descheduled between the child's exec and Popen's return (a loaded machine): the
# Ctrl-C lands inside Popen, before the child's group is known to the code that kills it.
SLOW_POPEN = (
    "import subprocess, time; real = subprocess.Popen._execute_child; "
    "subprocess.Popen._execute_child = lambda *a, **k: (real(*a, **k), time.sleep(3))[0]; "
)


@pytest.mark.parametrize("slow_popen", [False, True], ids=["running", "inside-popen"])
def test_ctrl_c_during_a_profile_kills_its_torchrun_too(tmp_path, slow_popen):
    """A profile's torchrun runs in its own session (the hard timeout kills its group), so the
    terminal's SIGINT never reaches it: the doctor's Ctrl-C must take it down too."""
    pid_file = tmp_path / "child.pid"
    code = (SLOW_POPEN if slow_popen else "") + (
        f"from {PACKAGE}.nccl import probe; "
        f"probe.run_with_hard_timeout(['sh', '-c', 'echo $$ > {pid_file}; exec sleep 300'], 600)"
    )
    caller = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline and caller.poll() is None, "the child never started"
        time.sleep(0.1)
    child = int(pid_file.read_text())
    caller.send_signal(signal.SIGINT)
    _, err = caller.communicate(timeout=30)
    assert "KeyboardInterrupt" in err  # re-raised for the doctor's one line
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


def test_the_one_node_doctor_jobs_command_gives_the_verdict_on_trainings_profile(tmp_path):
    """deploy.nodes=1 (the default): the Job's one pod runs the doctor with --nnodes 1 and
    --training-profile; it judges training's profile on that node alone (no infiniband row)."""
    _, (job,) = rendered("job", 1, "deploy.gpus_per_node=1")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", f"{PACKAGE}.doctor"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env |= {v["name"]: v["value"] for v in container["env"] if "value" in v}
    args = [a if a != "29500" else str(free_port()) for a in container["args"]]
    done = subprocess.run(
        [*container["command"], *args, "--timeout-s", "120"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [
        line.split()[0]
        for line in done.stdout.splitlines()
        if line.startswith(tuple(doctor.NODES_PROFILES))
    ]
    assert rows == ["auto", "nccl_default", "pcie_safe", "socket"]  # training's (auto) first
    assert "Verdict: nccl=auto works across 1 nodes: start training (exit 0)." in done.stdout

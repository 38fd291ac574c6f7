"""The rendered manifests against a real API server, as a cluster admin's would take them.

The folder DDP_TEMPLATE_K8S names (../shared/k8s in CI: conftest.local_k8s) runs kube-apiserver
and kube-controller-manager v1.36 with the JobSet, PyTorchJob and Kubeflow Trainer CRDs,
Trainer's torch-distributed runtime, and PodSecurity `restricted` enforced on the namespace
default. It has no scheduler and no kubelet: pods are created, and checked as the server holds
them, but never run. One cluster per session.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import (
    BIN,
    COMPLETION_INDEX,
    FLAVORS,
    job_of,
    local_k8s,
    manifest_of,
    pod_from,
    pod_template_in,
    pod_template_of,
)

COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
TRAINER = Path("reference") / "kubeflow-trainer-v2.3.0" / "pkg"  # in the API server's folder
NAMESPACE = "default"  # the renders' namespace; restricted here, as an admin would set it


class Cluster:
    def __init__(self, env: dict[str, str]):
        self.env = env  # KUBECONFIG, and the bundled kubectl first on PATH

    def kubectl(self, *args: str, stdin: str | None = None, ok: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["kubectl", *args], env=self.env, input=stdin, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0 or not ok, done.stderr[-3000:]
        return done

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", "-n", NAMESPACE, "-o", "json", *args).stdout)


@pytest.fixture(scope="session")
def shared_k8s() -> Path:
    return local_k8s()


@pytest.fixture(scope="session")
def cluster(shared_k8s, tmp_path_factory):
    """An API server for this session, with its state in a folder of its own."""
    script = str(shared_k8s / "cluster.sh")
    env = {**os.environ, "K8S_STATE_DIR": str(tmp_path_factory.mktemp("k8s-state"))}
    up = subprocess.run([script, "up"], env=env, capture_output=True, text=True, timeout=900)
    assert up.returncode == 0, up.stderr[-3000:]
    exports = subprocess.run([script, "env"], env=env, capture_output=True, text=True, check=True)
    for line in exports.stdout.splitlines():  # export NAME=value, PATH=<bin>:$PATH
        name, value = line.removeprefix("export ").split("=", 1)
        env[name] = value.replace("$PATH", env["PATH"])
    yield Cluster(env)
    subprocess.run([script, "down"], env=env, capture_output=True, timeout=120, check=True)


def test_every_render_passes_the_servers_strict_dry_run(cluster, matrix):
    """Schema (the CRDs' too), defaulting and admission, with unknown fields refused; a Job's pod
    template that broke PodSecurity restricted would draw a warning."""
    files = sorted(p for r in matrix.values() for p in (r.path / "k8s").glob("*.yaml"))
    done = cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", *[a for f in files for a in ("-f", str(f))]
    )
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert len(lines) == len(files) and all(line.endswith(" created (server dry run)") for line in lines)
    kinds = {line.split("/")[0] for line in lines}
    assert {"job.batch", "jobset.jobset.x-k8s.io", "pytorchjob.kubeflow.org", "trainjob.trainer.kubeflow.org"} <= kinds
    # The dry run refuses what it should: a misspelt TrainJob field.
    trainjob = yaml.safe_load(next(f for f in files if f.name == "trainjob.yaml").read_text())
    trainjob["spec"]["trainer"]["numProcsPerNode"] = trainjob["spec"]["trainer"].pop("numProcPerNode")
    refused = cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", stdin=json.dumps(trainjob), ok=False
    )
    assert refused.returncode != 0 and 'unknown field "spec.trainer.numProcsPerNode"' in refused.stderr


def test_rdma_settings_pass_the_strict_dry_run_and_restricted_warns_of_ipc_lock(
    cluster, default_project, installed_default, tmp_path
):
    """What InfiniBand pods need, set as the README says, for every flavor: the server takes the
    objects, and PodSecurity restricted names IPC_LOCK, as the renderer's note says it would."""
    project = tmp_path / "ddp-project"
    shutil.copytree(default_project, project)
    env = {**os.environ, "PYTHONPATH": str(installed_default)}
    settings = ["deploy.nodes=2", "deploy.runs_access_mode=ReadWriteMany", "deploy.capabilities=[IPC_LOCK]",
                "deploy.extra_resources={rdma/rdma_shared_device_a: 1}", "deploy.pod_labels.team=vision",
                "deploy.pod_annotations={k8s.v1.cni.cncf.io/networks: ib-net}"]  # fmt: skip
    files = []
    for flavor in FLAVORS:
        out = tmp_path / flavor
        render = [sys.executable, "-m", "ddp_project.k8s", "--force", "--out", str(out), f"deploy.flavor={flavor}"]
        done = subprocess.run([*render, *settings], cwd=project, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "note: deploy.capabilities IPC_LOCK: a namespace that enforces PodSecurity restricted" in done.stdout
        files += sorted(out.glob("*.yaml"))
    given = [a for f in files for a in ("-f", str(f))]
    done = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", *given)
    lines = done.stdout.splitlines()
    assert len(lines) == len(files) and all(line.endswith(" created (server dry run)") for line in lines)
    # restricted warns on the workloads whose pod template it reads (Job, and a JobSet's none)
    assert 'would violate PodSecurity "restricted:latest"' in done.stderr and '"IPC_LOCK"' in done.stderr


# Every platform setting but added capabilities (which restricted refuses: the test above), set
# as a user would on the command line.
PLATFORM_SETTINGS = [
    "deploy.runs_access_mode=ReadWriteMany", "deploy.queue=team-a", "deploy.queue_priority=high",
    "deploy.topology=cloud.provider.com/topology-rack", "deploy.topology_mode=preferred",
    "deploy.one_pod_per_node=true", "deploy.guaranteed=true", "deploy.image_pull_secrets=[ghcr-pull]",
    "deploy.affinity.nodeAffinity={requiredDuringSchedulingIgnoredDuringExecution: {nodeSelectorTerms: "
    "[{matchExpressions: [{key: topology.kubernetes.io/zone, operator: In, values: [a, b]}]}]}}",
    "deploy.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
    "deploy.node_selector={nvidia.com/gpu.product: NVIDIA-H200}", "deploy.storage_class=cephfs",
    "deploy.extra_resources={rdma/rdma_shared_device_a: 1}", "deploy.pod_labels.team=vision",
    "deploy.pod_annotations={k8s.v1.cni.cncf.io/networks: ib-net}", "nccl.env.GLOO_SOCKET_IFNAME=eth1",
]  # fmt: skip
# One process renders every flavor x 1, 2 and 4 nodes from one composed config, as the renderer
# would for each (its check included): 12 renders of the command line would take a minute.
RENDER_ALL = """
import json, sys
from ddp_project.config.compose import compose_and_check
from ddp_project.k8s import checks, render
from ddp_project.k8s.__main__ import deploy_and_profile
from ddp_project.k8s.flavors import FLAVORS
from ddp_project.k8s.pods import nccl_env
from ddp_project.config.overrides import hydra_overrides
deploy, profile = deploy_and_profile(compose_and_check(hydra_overrides(sys.argv[1:]), this_node=False))
out = {}
for flavor in FLAVORS:
    for nodes in (1, 2, 4):
        each = deploy | {"flavor": flavor, "nodes": nodes, "name": f"p-{flavor}-{nodes}"}
        assert checks.deploy_errors(each) == [], checks.deploy_errors(each)
        out[f"{flavor}-{nodes}"] = render.manifests(each, nccl_env(profile))
print(json.dumps(out))
"""


def test_platform_settings_on_every_flavor_and_node_count_pass_the_server_and_restricted(
    cluster, installed_default, default_project
):
    """Every flavor x 1, 2 and 4 nodes with the platform settings set: the objects pass the strict
    server dry run, and each one's pod, as its controller makes it, is admitted under PodSecurity
    restricted with QoS Guaranteed (deploy.guaranteed) and the settings where the scheduler reads them."""
    env = {**os.environ, "PYTHONPATH": str(installed_default)}
    done = subprocess.run([sys.executable, "-c", RENDER_ALL, *PLATFORM_SETTINGS], cwd=default_project, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    renders = {key: {f: yaml.safe_load(t) for f, t in files.items()} for key, files in json.loads(done.stdout).items()}
    objects = [manifest for files in renders.values() for manifest in files.values()]
    listed = {"apiVersion": "v1", "kind": "List", "items": objects}
    applied = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", stdin=json.dumps(listed))
    assert applied.stdout.count(" created (server dry run)") == len(objects), applied.stdout
    accounts = [m for m in objects if m["kind"] == "ServiceAccount"]
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": accounts}))
    pods = []
    for key, files in renders.items():
        flavor = key.rpartition("-")[0]
        workload = files[f"{flavor}.yaml"]
        pods.append(pod_from(pod_template_in(workload, flavor), f"{key}-0", NAMESPACE))
    try:
        created = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                                  stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": pods}))  # fmt: skip
    finally:
        cluster.kubectl("delete", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": accounts}))
    assert created.stderr == ""  # no PodSecurity warning
    served = json_objects(created.stdout)
    assert len(served) == 12
    for pod in served:
        where = pod["metadata"]["name"]
        assert pod["status"]["qosClass"] == "Guaranteed", where
        spec, annotations = pod["spec"], pod["metadata"]["annotations"]
        (spread,) = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert spread["topologyKey"] == "kubernetes.io/hostname", where
        assert spec["affinity"]["nodeAffinity"], where
        assert spec["imagePullSecrets"] == [{"name": "ghcr-pull"}], where
        assert annotations["kueue.x-k8s.io/podset-preferred-topology"] == "cloud.provider.com/topology-rack", where
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["GLOO_SOCKET_IFNAME"] == "eth1", where


def json_objects(text: str) -> list[dict]:
    """kubectl's `-o json` for several objects: one document after another."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        obj, end = decoder.raw_decode(text, at + len(text[at:]) - len(text[at:].lstrip()))
        found.append(obj)
        at = end
    return found


def first_pod(rendered) -> dict:
    """Pod 0 of a render, as its controller makes it from the pod template (for a TrainJob, as
    Trainer merges runtime, trainer and patch: conftest.trainer_pod_template)."""
    namespace = manifest_of(rendered)["metadata"]["namespace"]
    return pod_from(pod_template_of(rendered), f"{rendered.path.name}-0", namespace)


def test_every_renders_pods_are_admitted_as_restricted_burstable_and_tokenless(cluster, matrix):
    """The server's view of each render's pod: PodSecurity restricted admits it (enforced on Pods),
    QoS is Burstable (not BestEffort, evicted first), and no API token is mounted (the
    ServiceAccount admission adds one unless the pod or, for a TrainJob, its account says no)."""
    renders = list(matrix.values())
    accounts = [str(r.path / "k8s" / "serviceaccount.yaml") for r in renders if r.flavor == "trainjob"]
    cluster.kubectl("apply", *[a for f in accounts for a in ("-f", f)])  # a pod may name only a real one
    try:
        pods = {"apiVersion": "v1", "kind": "List", "items": [first_pod(r) for r in renders]}
        done = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(pods))
    finally:
        cluster.kubectl("delete", "--wait", *[a for f in accounts for a in ("-f", f)])
    assert done.stderr == ""
    served = json_objects(done.stdout)
    assert [pod["metadata"]["name"] for pod in served] == [f"{r.path.name}-0" for r in renders]
    for rendered, pod in zip(renders, served, strict=True):
        where = rendered.path.name
        assert pod["status"]["qosClass"] == "Burstable", where
        assert not [v for v in pod["spec"]["volumes"] if v["name"].startswith("kube-api-access")], where
        (container,) = pod["spec"]["containers"]
        memory, gpus = f"{24 * rendered.gpus + 16}Gi", str(rendered.gpus)  # the GPU request: the server's
        assert container["resources"] == {
            "requests": {
                "cpu": str(4 * rendered.gpus),
                "memory": memory,
                "ephemeral-storage": "10Gi",
                "nvidia.com/gpu": gpus,
            },
            "limits": {"memory": memory, "nvidia.com/gpu": gpus},
        }, where
        assert container["imagePullPolicy"] == "IfNotPresent", where  # a TrainJob's too, by default
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, where


def test_the_trainjob_model_matches_trainers_source(shared_k8s):
    """conftest.trainer_pod_template and test_multinode's trainer_env model what Trainer v2.3 does;
    its source and runtime here say the same (a TrainJob's pods are not made on this cluster)."""
    torch = (shared_k8s / TRAINER / "runtime" / "framework" / "plugins" / "torch" / "torch.go").read_text()
    constants = (shared_k8s / TRAINER / "constants" / "constants.go").read_text()
    for name, variable in [("TorchEnvNumNodes", "PET_NNODES"), ("TorchEnvNumProcPerNode", "PET_NPROC_PER_NODE"),
                           ("TorchEnvNodeRank", "PET_NODE_RANK"), ("TorchEnvMasterAddr", "PET_MASTER_ADDR"),
                           ("TorchEnvMasterPort", "PET_MASTER_PORT")]:  # fmt: skip
        assert f'{name} string = "{variable}"' in constants and f"constants.{name}" in torch
    assert 'fmt.Sprintf("%s-%s-0-0.%s", trainJob.Name, constants.Node, trainJob.Name)' in torch
    assert "ContainerTrainerPort int32 = 29500" in constants and 'Node string = "node"' in constants
    assert "\"metadata.annotations['%s']\", batchv1.JobCompletionIndexAnnotation" in constants
    assert COMPLETION_INDEX == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    runtime = yaml.safe_load((shared_k8s / "runtimes" / "torch_distributed-v2.3.0.yaml").read_text())
    assert runtime["metadata"]["name"] == "torch-distributed"
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert node["name"] == "node" and list(pod) == ["containers"]  # nothing else goes into the pods
    assert [set(c) for c in pod["containers"]] == [{"name", "image"}] and pod["containers"][0]["name"] == "node"


def pods_of(cluster, name: str, count: int, image: str) -> list[dict]:
    """The Job's pods once the controller has made `count` of them with `image`, by index (a
    wait, not a limit: the controller takes seconds, more on a loaded machine)."""
    deadline = time.monotonic() + 300
    while True:
        pods = cluster.get("pods", "-l", f"job-name={name}")["items"]
        live = [p for p in pods if "deletionTimestamp" not in p["metadata"]]
        if len(live) == count and all(p["spec"]["containers"][0]["image"] == image for p in live):
            return sorted(
                live,
                key=lambda p: int(
                    p["metadata"].get("annotations", {}).get("batch.kubernetes.io/job-completion-index", 0)
                ),
            )
        assert time.monotonic() < deadline, f"{len(live)} pods of {count}: {[p['metadata']['name'] for p in pods]}"
        time.sleep(0.5)


def assert_pods_are_what_the_launch_line_expects(cluster, pods: list[dict], name: str, image: str) -> None:
    nodes = len(pods)
    for index, pod in enumerate(pods):
        spec = pod["spec"]
        (container,) = spec["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert pod["status"]["qosClass"] == "Burstable"
        assert container["resources"] == {
            "requests": {"cpu": "8", "memory": "64Gi", "ephemeral-storage": "10Gi", "nvidia.com/gpu": "2"},
            "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
        }
        assert container["image"] == image and container["imagePullPolicy"] == "IfNotPresent"
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in spec["volumes"]
        assert {"name": "dshm", "mountPath": "/dev/shm"}.items() <= next(
            m for m in container["volumeMounts"] if m["name"] == "dshm"
        ).items()
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 10001
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert spec["automountServiceAccountToken"] is False
        assert not [v for v in spec["volumes"] if v["name"].startswith("kube-api-access")]
        (runs,) = [v for v in spec["volumes"] if v["name"] == "runs"]
        assert runs["persistentVolumeClaim"]["claimName"] == f"{name}-runs-{'rwo' if nodes == 1 else 'rwx'}"
        if nodes == 1:
            assert "subdomain" not in spec and container["command"] == [name, "train"]
            continue
        # The launch line: pod 0 hosts the rendezvous, the others reach it at RDZV_HOST.
        assert pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] == str(index)
        assert env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
        assert spec["hostname"] == f"{name}-{index}" and spec["subdomain"] == name
        first = pods[0]["spec"]
        assert env["RDZV_HOST"]["value"] == f"{first['hostname']}.{first['subdomain']}"
        service = cluster.get("service", first["subdomain"])
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def project_make(cluster, default_project, installed_default, tmp_path):
    """make(*args) -> the CompletedProcess of `make` in a copy of the default project, with the
    installed project and the API server's kubectl first on PATH, as a user's shell would have."""
    project = tmp_path / "ddp-project"
    shutil.copytree(default_project, project)
    env = {k: v for k, v in cluster.env.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL"}}
    env |= {"PATH": f"{BIN}:{env['PATH']}", "PYTHONPATH": str(installed_default)}

    def make(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["make", *args], cwd=project, env=env, capture_output=True, text=True, timeout=300)

    return make


def test_the_job_runs_its_pods_survives_reapplying_and_deletes_cleanly(
    cluster, default_project, installed_default, tmp_path
):
    """The project's own `make k8s-apply`: one node, then two (a claim of the other access mode,
    not a clash), then a new image (a Job's pod template is immutable: it is replaced); the Job
    controller's pods each time; then the README's delete leaves nothing."""
    project_run = project_make(cluster, default_project, installed_default, tmp_path)

    def make(*args: str) -> None:
        done = project_run(*args)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "Warning" not in done.stderr, done.stderr  # e.g. "would violate PodSecurity"

    name, first, second = "ddp-project", "ghcr.io/your-org/ddp-project:0.1.0", "ghcr.io/your-org/ddp-project:0.2.0"
    make("k8s-apply")
    assert_pods_are_what_the_launch_line_expects(cluster, pods_of(cluster, name, 1, first), name, first)
    several = "deploy.nodes=2 deploy.runs_access_mode=ReadWriteMany"  # the run dir in a claim every node mounts
    for overrides, image in [(several, first), (f"{several} deploy.image={second}", second)]:
        make("k8s-render", f"ARGS={overrides}")
        make("k8s-apply", f"ARGS={overrides}")
        assert_pods_are_what_the_launch_line_expects(cluster, pods_of(cluster, name, 2, image), name, image)
    claims = cluster.get("persistentvolumeclaims", "-l", f"app.kubernetes.io/name={name}")["items"]
    assert sorted(c["metadata"]["name"] for c in claims) == [f"{name}-runs-rwo", f"{name}-runs-rwx"]

    kinds = "jobs,services,persistentvolumeclaims,serviceaccounts"  # docs/kubernetes.md's command
    cluster.kubectl(
        "delete", "-n", NAMESPACE, kinds, "-l", f"app.kubernetes.io/name={name}", "--cascade=foreground", "--wait"
    )
    left = cluster.kubectl(
        "get", "-n", NAMESPACE, f"pods,{kinds}", "-l", f"app.kubernetes.io/name={name}", "-o", "name"
    )
    assert left.stdout == ""
    assert cluster.get("pods", "-l", f"job-name={name}")["items"] == []


def test_k8s_apply_keeps_the_running_job_until_the_server_accepts_the_new_one_and_leaves_nothing_stale(
    cluster, default_project, installed_default, tmp_path
):
    """`make k8s-apply` asks the server first: a value only the server can judge (a namespace it
    does not have; the renderer refuses what it can know, such as an int32 past its range) leaves
    the running Job as it was, in one line. A change of flavor replaces the Job
    and its Service with a JobSet, and keeps the claim."""
    project_run = project_make(cluster, default_project, installed_default, tmp_path)

    def make(*args: str) -> subprocess.CompletedProcess:
        return project_run("-s", *args)

    name = "ddp-project"
    label = f"app.kubernetes.io/name={name}"
    mine = "jobs,jobsets,services,persistentvolumeclaims"
    done = make("k8s-apply", "ARGS=deploy.nodes=2 deploy.runs_access_mode=ReadWriteMany")
    assert done.returncode == 0, done.stderr[-3000:]
    before = {item["metadata"]["name"]: item["metadata"]["uid"] for item in cluster.get(mine, "-l", label)["items"]}
    assert set(before) == {name, f"{name}-runs-rwx"}  # the Job and its Service share the name

    refused = make("k8s-apply", "ARGS=deploy.namespace=team-b")
    said = [line for line in refused.stderr.splitlines() if not line.startswith("make: ")]
    assert refused.returncode != 0 and len(said) == 1, refused.stderr
    assert said[0].startswith("make k8s-apply: the server refuses k8s/, so the running job is left as it is:")
    assert 'namespaces "team-b" not found' in said[0]
    after = {item["metadata"]["name"]: item["metadata"]["uid"] for item in cluster.get(mine, "-l", label)["items"]}
    assert after == before

    switched = make("k8s-apply", "ARGS=deploy.namespace=default deploy.flavor=jobset")
    assert switched.returncode == 0, switched.stderr[-3000:]
    kinds = sorted(f"{item['kind']}/{item['metadata']['name']}" for item in cluster.get(mine, "-l", label)["items"])
    assert kinds == [f"JobSet/{name}", f"PersistentVolumeClaim/{name}-runs-rwx"]
    assert cluster.get("persistentvolumeclaims", f"{name}-runs-rwx")["metadata"]["uid"] == before[f"{name}-runs-rwx"]
    cluster.kubectl("delete", "-n", NAMESPACE, mine, "-l", label, "--cascade=foreground", "--wait")


def test_k8s_apply_refuses_pods_restricted_would_refuse_keeps_what_is_not_its_own_and_restarts_nothing_unchanged(
    cluster, default_project, installed_default, tmp_path
):
    """`make k8s-apply` in sequence: a user's Job and Service with the project's name label only
    are never deleted; an unchanged k8s/ restarts nothing; pods that PodSecurity restricted would
    refuse are refused before anything changes, for a Job (the server's warning) and a JobSet (a
    Pod's dry run: PodSecurity reads no JobSet); a new claim is named in a note; files the
    renderer did not write are named in one line."""
    project_run = project_make(cluster, default_project, installed_default, tmp_path)

    def make(*args: str) -> subprocess.CompletedProcess:
        return project_run("-s", *args)

    def one_line(done: subprocess.CompletedProcess) -> str:
        said = [line for line in done.stderr.splitlines() if not line.startswith("make: ")]
        assert done.returncode != 0 and len(said) == 1, done.stdout + done.stderr
        return said[0]

    name = "ddp-project"
    label = f"app.kubernetes.io/name={name}"
    only_name = {"app.kubernetes.io/name": name}
    pod = {"restartPolicy": "Never", "containers": [{"name": "eval", "image": "busybox"}]}
    theirs = [
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": f"{name}-eval", "labels": only_name},
         "spec": {"template": {"spec": pod}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": f"{name}-tensorboard", "labels": only_name},
         "spec": {"selector": {"app": "tb"}, "ports": [{"port": 6006}]}},
    ]  # fmt: skip
    listed = json.dumps({"apiVersion": "v1", "kind": "List", "items": theirs})
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=listed)
    try:
        done = make("k8s-apply")
        assert done.returncode == 0, done.stderr[-3000:]
        uid = cluster.get("job", name)["metadata"]["uid"]
        again = make("k8s-apply")
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"k8s/ is unchanged: job/{name} keeps running" in again.stdout
        assert cluster.get("job", name)["metadata"]["uid"] == uid

        for args, why in [("deploy.capabilities=[IPC_LOCK]", "would violate PodSecurity"),
                          ("deploy.flavor=jobset", "jobset.yaml: its JobSet's pods would be refused")]:  # fmt: skip
            line = one_line(make("k8s-apply", f"ARGS={args}"))
            assert line.startswith("make k8s-apply: the server refuses k8s/, so the running job is left as it is:")
            assert why in line and "IPC_LOCK" in line, line
            assert cluster.get("job", name)["metadata"]["uid"] == uid

        several = "deploy.capabilities=[] deploy.nodes=2 deploy.runs_access_mode=ReadWriteMany"
        switched = make("k8s-apply", f"ARGS={several}")
        assert switched.returncode == 0, switched.stderr[-3000:]
        assert f"waiting for job/{name}'s pods to stop (their grace period is 90 s)..." in switched.stdout
        assert f"note: the runs claim changes from {name}-runs-rwo to {name}-runs-rwx" in switched.stdout
        kept = cluster.kubectl("get", "-n", NAMESPACE, f"job/{name}-eval", f"service/{name}-tensorboard", "-o", "name")
        assert kept.stdout.split() == [f"job.batch/{name}-eval", f"service/{name}-tensorboard"]

        k8s = tmp_path / "ddp-project" / "k8s"
        (k8s / "empty.yaml").write_text("# nothing\n")
        (k8s / "two.yaml").write_text("kind: ConfigMap\n---\nkind: ConfigMap\n")
        line = one_line(make("k8s-apply"))
        assert "empty.yaml (no objects, not one)" in line and "two.yaml (2 objects, not one)" in line, line
    finally:
        cluster.kubectl("delete", "-n", NAMESPACE, "jobs,jobsets,services,persistentvolumeclaims,serviceaccounts",
                        "-l", label, "--cascade=foreground", "--wait", ok=False)  # fmt: skip


def stored(cluster, obj: dict) -> dict:
    """`obj` as the server would store it: admission and defaulting applied, nothing kept."""
    return json.loads(
        cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(obj)).stdout
    )


LOST_NODE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


def lost_node_seconds(pod: dict) -> dict[str, int]:
    return {
        t["key"]: t["tolerationSeconds"]
        for t in pod["spec"].get("tolerations", [])
        if t["key"] in LOST_NODE_TAINTS and t["effect"] == "NoExecute"
    }


def test_the_server_keeps_each_renders_lost_node_tolerations_and_each_jobs_replacement_policy(
    cluster, matrix, shared_k8s
):
    """A pod of every render keeps deploy.lost_node_s (60 s) for both taints of a lost node: the
    DefaultTolerationSeconds admission plugin adds its 300 s only to a pod that names neither, as
    it does here to one without them. A Job with a podFailurePolicy is defaulted to
    podReplacementPolicy Failed (a Terminating pod is not replaced); the Job that Trainer v2.3's
    torch-distributed runtime makes has none, so it is TerminatingOrFailed with backoffLimit 6."""
    for rendered in matrix.values():
        pod = first_pod(rendered) | {"metadata": {"name": "lost-node-check", "namespace": NAMESPACE}}
        pod["spec"] = pod["spec"] | {"serviceAccountName": "default"}  # a TrainJob's account is not made here
        assert lost_node_seconds(stored(cluster, pod)) == dict.fromkeys(LOST_NODE_TAINTS, 60), rendered.path.name
        pod["spec"] = pod["spec"] | {"tolerations": []}
        assert lost_node_seconds(stored(cluster, pod)) == dict.fromkeys(LOST_NODE_TAINTS, 300), rendered.path.name
        if rendered.flavor in ("job", "jobset"):
            job = job_of(rendered)
            job["metadata"]["namespace"] = NAMESPACE
            assert stored(cluster, job)["spec"]["podReplacementPolicy"] == "Failed", rendered.path.name
    runtime = yaml.safe_load((shared_k8s / "runtimes" / "torch_distributed-v2.3.0.yaml").read_text())
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert "failurePolicy" not in runtime["spec"]["template"]["spec"]  # the JobSet fails with its Job
    spec = node["template"]["spec"]
    spec["template"]["spec"]["restartPolicy"] = "OnFailure"  # the runtime sets none; a Job needs one
    runtime_job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "runtime-job", "namespace": NAMESPACE},
                   "spec": spec}  # fmt: skip
    served = stored(cluster, runtime_job)["spec"]
    assert (served["podReplacementPolicy"], served["backoffLimit"]) == ("TerminatingOrFailed", 6)
    assert "podFailurePolicy" not in served


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def ready(node: str) -> dict:
    condition = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "a test's",
                 "lastHeartbeatTime": now(), "lastTransitionTime": now()}  # fmt: skip
    return {"status": {"conditions": [condition]}}


def heartbeat(cluster, node: str) -> None:
    """What a kubelet posts: its node's Lease, renewed, and a Ready condition."""
    lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
             "metadata": {"name": node, "namespace": "kube-node-lease"},
             "spec": {"holderIdentity": node, "leaseDurationSeconds": 40,
                      "renewTime": now().replace("Z", ".000000Z")}}  # fmt: skip
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(lease))
    cluster.kubectl("patch", "node", node, "--subresource=status", "--type=merge", "-p", json.dumps(ready(node)))


def wait_for(what: str, probe, timeout_s: float = 300):
    """probe()'s first truthy value: a wait, not a limit on the controllers' speed."""
    deadline = time.monotonic() + timeout_s
    while not (found := probe()):
        assert time.monotonic() < deadline, f"still waiting for {what}"
        time.sleep(1)
    return found


@pytest.mark.slow
def test_a_pod_on_a_lost_node_is_replaced_only_once_the_node_is_out_of_service(
    cluster, default_project, installed_default, tmp_path
):
    """The real controllers: the Job's pod is bound to a node whose kubelet then goes silent. The
    node lifecycle controller taints it unreachable, and after deploy.lost_node_s the taint
    eviction controller deletes the pod (DisruptionTarget). The pod stays Terminating (no kubelet
    confirms its end) and the Job, podReplacementPolicy Failed, makes no new pod 0. Tainted
    node.kubernetes.io/out-of-service, the node's terminating pods are failed by PodGC, and the
    Job replaces pod 0 without counting it. Another node keeps heartbeating: with every node
    lost, the node lifecycle controller stops evicting (full disruption) and taints nothing."""
    make = project_make(cluster, default_project, installed_default, tmp_path)
    name, healthy, lost = "lost-node-job", "healthy-node", "lost-node"
    several = "deploy.nodes=2 deploy.runs_access_mode=ReadWriteMany"  # pod 0 of an Indexed Job
    done = make("k8s-render", f"ARGS=deploy.lost_node_s=5 deploy.name={name} {several}")
    assert done.returncode == 0, done.stderr
    for node in (healthy, lost):
        cluster.kubectl(
            "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        )
        heartbeat(cluster, node)
    stop = threading.Event()
    beating = threading.Thread(target=lambda: [heartbeat(cluster, healthy) for _ in iter(lambda: stop.wait(5), True)])
    beating.start()
    try:
        cluster.kubectl("apply", "-f", str(tmp_path / "ddp-project" / "k8s"))

        def pods_0() -> list[dict]:
            pods = cluster.get("pods", "-l", f"job-name={name}")["items"]
            return [p for p in pods if p["metadata"]["annotations"][COMPLETION_INDEX_ANNOTATION] == "0"]

        (pod,) = wait_for("the Job's pod 0", pods_0)
        first = pod["metadata"]["name"]
        binding = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": first},
            "target": {"kind": "Node", "name": lost},
        }
        cluster.kubectl("create", "-n", NAMESPACE, "-f", "-", stdin=json.dumps(binding))  # the scheduler's call

        def evicted() -> dict | None:
            (pod,) = pods_0()
            return pod if "deletionTimestamp" in pod["metadata"] else None

        pod = wait_for("the eviction", evicted)
        taints = {t["key"] for t in cluster.get("node", lost)["spec"]["taints"]}
        assert "node.kubernetes.io/unreachable" in taints
        assert {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}.items() <= next(
            c for c in pod["status"]["conditions"] if c["type"] == "DisruptionTarget"
        ).items()
        wait_for("the Job to count it terminating", lambda: cluster.get("job", name)["status"].get("terminating") == 1)
        # Without podFailurePolicy (TerminatingOrFailed) the Job counts a Terminating pod as failed
        # and replaces it after its first backoff, 10 s (pkg/controller/job: DefaultJobPodFailureBackOff).
        time.sleep(20)
        assert [p["metadata"]["name"] for p in pods_0()] == [first]
        assert "failed" not in cluster.get("job", name)["status"]

        cluster.kubectl("taint", "node", lost, "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute")
        (new,) = wait_for("pod 0's replacement", lambda: [p for p in pods_0() if p["metadata"]["name"] != first])
        assert "deletionTimestamp" not in new["metadata"]
        assert "failed" not in cluster.get("job", name)["status"]  # DisruptionTarget: Ignore, not counted
    finally:
        stop.set()
        beating.join()
        kinds = "jobs,services,persistentvolumeclaims"
        cluster.kubectl("delete", "-n", NAMESPACE, kinds, "-l", f"app.kubernetes.io/name={name}", "--wait=false")
        cluster.kubectl("delete", "node", healthy, lost, "--ignore-not-found")


def test_k8s_doctor_applies_its_job_beside_training_and_neither_deletes_the_other(
    cluster, default_project, installed_default, tmp_path
):
    """`make k8s-doctor` on two nodes: its manifests pass the strict dry run without a warning
    (PodSecurity restricted); the server takes its Job and Service and the Job controller makes
    its pods (no kubelet here: they stay Pending, so the wait ends in one line, after a line
    saying it waits); the training Job beside it is untouched. A new `make k8s-apply` replaces
    the training Job and leaves the doctor's; the next doctor replaces only its own Job."""
    project_run = project_make(cluster, default_project, installed_default, tmp_path)
    name, image = "ddp-project", "ghcr.io/your-org/ddp-project:0.1.0"
    several = "ARGS=deploy.nodes=2 deploy.runs_access_mode=ReadWriteMany"
    mine = "jobs,services,persistentvolumeclaims"
    try:
        done = project_run("-s", "k8s-apply", several)
        assert done.returncode == 0, done.stderr[-3000:]
        uids = lambda: {  # noqa: E731
            f"{i['kind']}/{i['metadata']['name']}": i["metadata"]["uid"]
            for i in cluster.get(mine, "-l", f"app.kubernetes.io/name={name}")["items"]
        }
        training = uids()
        assert set(training) == {f"Job/{name}", f"Service/{name}", f"PersistentVolumeClaim/{name}-runs-rwx"}

        printed = subprocess.run(
            [sys.executable, "-m", "ddp_project.k8s.doctor", "--print"], cwd=tmp_path / "ddp-project",
            env={**cluster.env, "PYTHONPATH": str(installed_default)}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert printed.returncode == 0, printed.stderr[-3000:]
        strict = cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-", stdin=printed.stdout)
        assert strict.stderr == ""  # no "would violate PodSecurity" warning, no unknown field
        assert strict.stdout.split() == [
            f"job.batch/{name}-doctor", "created", "(server", "dry", "run)",
            f"service/{name}-doctor", "created", "(server", "dry", "run)",
        ]  # fmt: skip

        def doctor() -> subprocess.CompletedProcess:
            return project_run("-s", "k8s-doctor", "ARGS=--wait-s 31")

        first = doctor()
        said = [line for line in first.stderr.splitlines() if not line.startswith("make: ")]
        assert first.returncode != 0 and len(said) == 1, first.stdout + first.stderr
        assert said[0].startswith(f"make k8s-doctor: job/{name}-doctor has not finished after 31 s (pods: Pending 2)")
        assert f"job.batch/{name}-doctor created" in first.stdout and f"service/{name}-doctor created" in first.stdout
        assert f"waiting for job/{name}-doctor to end (at most 31 s; its pods' log follows)..." in first.stdout
        pods = pods_of(cluster, f"{name}-doctor", 2, image)  # admitted under restricted: no FailedCreate
        for index, pod in enumerate(pods):
            assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "doctor"
            assert pod["spec"]["hostname"] == f"{name}-doctor-{index}" and pod["spec"]["subdomain"] == f"{name}-doctor"
            assert pod["status"]["qosClass"] == "Burstable"
            (container,) = pod["spec"]["containers"]
            assert "ddp_project.doctor" in " ".join(container["command"])
        doctors = {k: v for k, v in uids().items() if "doctor" in k}
        assert set(doctors) == {f"Job/{name}-doctor", f"Service/{name}-doctor"}
        assert {k: v for k, v in uids().items() if k not in doctors} == training  # training untouched

        replaced = project_run("-s", "k8s-apply", f"{several} deploy.image=ghcr.io/your-org/ddp-project:0.2.0")
        assert replaced.returncode == 0, replaced.stderr[-3000:]
        after = uids()
        assert after[f"Job/{name}"] != training[f"Job/{name}"]  # training's Job replaced...
        assert {k: after[k] for k in doctors} == doctors  # ...the doctor's kept

        again = doctor()
        assert again.returncode != 0, again.stdout + again.stderr
        last = uids()
        assert last[f"Job/{name}-doctor"] != doctors[f"Job/{name}-doctor"]  # its own Job replaced
        assert last[f"Service/{name}-doctor"] == doctors[f"Service/{name}-doctor"]  # applied in place
        assert last[f"Job/{name}"] == after[f"Job/{name}"]  # the training Job untouched
    finally:
        cluster.kubectl("delete", "-n", NAMESPACE, mine, "-l", f"app.kubernetes.io/name={name}",
                        "--cascade=foreground", "--wait", ok=False)  # fmt: skip

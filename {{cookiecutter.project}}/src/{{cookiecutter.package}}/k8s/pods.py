"""What every flavor's pods share: the trainer container, torchrun's launch line and rendezvous,
the pod spec (security, scheduling, volumes) and the claim that holds the runs. A flavor's
builder (flavors.py) puts these into its workload and changes only what its controller needs."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, NamedTuple

from .. import PROJECT
from ..nccl import decision as nccl
from .meta import (
    HOSTNAME,
    NAME_LABEL,
    TRAINING,
    cpu_text,
    label_texts,
    labels,
    manifest,
    optional,
    quantity,
    size_text,
    topology_annotation,
)

# The launcher (launch.py, the project's console script): it checks the config and the run dir,
# then runs torchrun; a config error exits 2 and a divergence 4, which fail the job at once.
COMMAND = PROJECT
RUNS_MOUNT = "/workspace/runs"
# Workers get a fresh store per rendezvous round. Sharing torchrun's store (the default since torch
# 2.5) hands restarted workers the previous round's addresses: pytorch/pytorch#135712, and the
# in-place restart test hangs or fails in init_process_group without this.
FRESH_WORKER_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# The root filesystem is read-only. Processes write to the run dir (the claim), /dev/shm, and
# /tmp (an emptyDir), where HOME points so that triton and matplotlib keep their caches
# (torch.compile's go beside the runs, on the claim: core/caches.py).
READ_ONLY_ROOT = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}
WRITABLE_HOME = {"HOME": "/tmp"}
TMP_MOUNT = {"name": "tmp", "mountPath": "/tmp"}
POD_IP = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# A node that stops answering is tainted NoExecute with these by the node lifecycle controller
# (pkg/controller/nodelifecycle), and the taint eviction controller deletes a pod on it once the
# shortest tolerationSeconds among the pod's matching tolerations has passed
# (pkg/controller/tainteviction, getMinTolerationTime). A pod that names neither gets 300 s for
# each from the DefaultTolerationSeconds admission plugin (plugin/pkg/admission/
# defaulttolerationseconds), which adds nothing to a pod that tolerates them itself.
LOST_NODE_TAINTS = ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready")


class Launch(NamedTuple):
    """The trainer container's command and args, and the env its launch line reads."""

    command: list[str]
    args: list[str]
    env: list[dict]


def nccl_env(profile_fields: Mapping[str, Any]) -> dict[str, str]:
    """The variables a profile sets explicitly (a configs/nccl/*.yaml file, or the composed nccl
    group): what goes into the container's env block."""
    fields = SimpleNamespace(**{name: None for name in nccl.FIELD_VARS}, env={}, auto=False)
    vars(fields).update(profile_fields)
    return {var: value for var, (value, _) in sorted(nccl.config_env(fields).items())}


def c10d_launch(index: str, host: str, port: str) -> str:
    """Several nodes: torchrun's c10d rendezvous, hosted by node 0's torchrun on localhost; the
    other nodes reach it at $host:$port. Ranks are assigned per round, so a node whose workers
    fail can re-rendezvous with the others in place (--max-restarts)."""
    return (
        f'case "${index}" in 0) host=localhost ;; *) host="${host}" ;; esac; '
        f'exec {COMMAND} train --rdzv-backend c10d --rdzv-endpoint "$host:${port}" '
        '--local-addr "$POD_IP" "$@"'
    )


MULTI_NODE_LAUNCH = c10d_launch("JOB_COMPLETION_INDEX", "RDZV_HOST", "RDZV_PORT")


def rendezvous_timeouts(deploy: Mapping[str, Any]) -> dict[str, str]:
    """torchrun's c10d rendezvous timeouts (--rdzv-conf): read_timeout, how long a node keeps
    trying to reach the store on pod 0, and join_timeout, how long a round waits for every node.
    At torchrun's defaults a pod 0 that started a minute late, or a lost pod 0 whose replacement
    took a minute to start, failed every other pod."""
    seconds = str(deploy["rdzv_timeout_s"])
    return {"join_timeout": seconds, "read_timeout": seconds}


def train_args(deploy: Mapping[str, Any]) -> dict[str, list[str]]:
    """torchrun's arguments and the run dir, by what they set: each flavor takes those its
    controller does not set itself."""
    name = deploy["name"]
    conf = ",".join(f"{key}={value}" for key, value in rendezvous_timeouts(deploy).items())
    return {
        "nodes": ["--nnodes", str(deploy["nodes"])],
        "processes": ["--nproc-per-node", str(deploy["gpus_per_node"])],
        "rendezvous": ["--rdzv-id", name, "--rdzv-conf", conf],
        "restarts": ["--max-restarts", str(deploy["max_restarts"])],
        "run_dir": [f"hydra.run.dir={RUNS_MOUNT}/{name}"],
    }


def torchrun_launch(deploy: Mapping[str, Any], rendezvous_host: str) -> Launch:
    """One node: a standalone torchrun. Several: an Indexed Job's pods, pod 0 (by its completion
    index) hosting the rendezvous that the others reach at `rendezvous_host`."""
    a = train_args(deploy)
    if deploy["nodes"] == 1:
        return Launch(
            [COMMAND, "train"], ["--standalone", *a["processes"], *a["restarts"], *a["run_dir"]], []
        )
    env = [
        {
            "name": "JOB_COMPLETION_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}},
        },
        POD_IP,
        {"name": "RDZV_HOST", "value": rendezvous_host},  # pod 0, through DNS
        {"name": "RDZV_PORT", "value": str(deploy["rdzv_port"])},
    ]
    args = [*a["nodes"], *a["processes"], *a["rendezvous"], *a["restarts"], *a["run_dir"]]
    return Launch(["/bin/sh", "-c", MULTI_NODE_LAUNCH, COMMAND], args, env)


def container_resources(deploy: Mapping[str, Any], gpus: bool = True) -> dict:
    """Requests from the deploy config, scaled by the GPUs per node, so that the pod is not
    BestEffort (evicted first). The memory limit holds the processes and /dev/shm, whose
    memory-backed pages count against it. No CPU limit unless deploy.guaranteed: throttling
    stalls the data loaders and NCCL's threads, and the request reserves the cores anyway.
    Guaranteed (requests = limits) is what a node's static CPU manager pins whole cores for, and
    the last class evicted under memory pressure."""
    per_node = deploy["gpus_per_node"]
    memory = size_text(quantity(deploy["memory_per_gpu"]) * per_node + quantity(deploy["shm_size"]))
    requests = {
        "cpu": cpu_text(quantity(deploy["cpu_per_gpu"]) * per_node),
        "memory": memory,
        "ephemeral-storage": str(deploy["ephemeral_storage"]),  # /tmp and the caches in it
    }
    limits = {"nvidia.com/gpu": per_node} if gpus else {}
    limits |= (
        {"cpu": requests["cpu"], "memory": memory} if deploy["guaranteed"] else {"memory": memory}
    )
    extra = dict(deploy["extra_resources"])  # extended resources: requests must equal limits
    return {"requests": requests | extra, "limits": limits | extra}


def added_capabilities(deploy: Mapping[str, Any]) -> dict:
    """deploy.capabilities on top of dropping all of them, as READ_ONLY_ROOT does."""
    if not deploy["capabilities"]:
        return {}
    return {"capabilities": READ_ONLY_ROOT["capabilities"] | {"add": list(deploy["capabilities"])}}


def secret_env(deploy: Mapping[str, Any]) -> list[dict]:
    """deploy.secret_env as secretKeyRefs: k8s/ names the Secret and key, never the value."""
    refs = []
    for var, ref in deploy["secret_env"].items():
        secret, key = ref.split("/", 1)
        refs.append({"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    return refs


def trainer_container(
    deploy: Mapping[str, Any], env: Mapping[str, str], launch: Launch, name: str = "trainer"
) -> dict:
    values = {
        **env,
        **label_texts(deploy["env"]),
        **FRESH_WORKER_STORE,
        "PYTHONUNBUFFERED": "1",
        **WRITABLE_HOME,
    }
    return {
        "name": name,
        "image": deploy["image"],
        "imagePullPolicy": deploy["image_pull_policy"],
        "command": launch.command,
        "args": launch.args,
        "env": [{"name": var, "value": value} for var, value in values.items()]
        + secret_env(deploy)
        + launch.env,
        "resources": container_resources(deploy),
        "securityContext": READ_ONLY_ROOT | added_capabilities(deploy),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            TMP_MOUNT,
            {"name": "runs", "mountPath": RUNS_MOUNT},
        ],
    }


def pod_metadata(deploy: Mapping[str, Any], component: str = TRAINING) -> dict:
    """The pods' labels (this project's, and deploy.pod_labels) and annotations
    (deploy.pod_annotations, and Kueue's topology request)."""
    annotations = label_texts(deploy["pod_annotations"]) | topology_annotation(deploy)
    return {
        "labels": labels(deploy["name"], component) | label_texts(deploy["pod_labels"]),
        **optional(annotations=annotations or None),
    }


def affinity(deploy: Mapping[str, Any]) -> dict | None:
    """deploy.affinity, and with deploy.one_pod_per_node no two of this job's pods on one node
    (each pod counts its node's GPUs as its own: two on one node would share them)."""
    spread = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {NAME_LABEL: deploy["name"]}},
                    "topologyKey": HOSTNAME,
                }
            ]
        }
    }
    found = dict(deploy["affinity"]) | (spread if deploy["one_pod_per_node"] else {})
    return found or None


def runs_claim_name(deploy: Mapping[str, Any]) -> str:
    """deploy.runs_claim, or the rendered claim, named by its access mode: a claim's spec is
    immutable, so another mode is another claim, while changing deploy.nodes keeps the claim and
    the checkpoints in it."""
    mode = {"ReadWriteOnce": "rwo", "ReadWriteMany": "rwx"}[deploy["runs_access_mode"]]
    return deploy["runs_claim"] or f"{deploy['name']}-runs-{mode}"


def lost_node_tolerations(deploy: Mapping[str, Any]) -> list[dict]:
    """deploy.lost_node_s as the pods' tolerations of a lost node's taints; none for null (the
    admission plugin's 300 s). Evicted, the pod is only Terminating: a kubelet that cannot be
    reached never confirms its end, so nothing replaces it until the node is tainted
    node.kubernetes.io/out-of-service or its Node object is deleted (PodGC then fails the pod)."""
    if deploy["lost_node_s"] is None:
        return []
    return [
        {
            "key": taint,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": deploy["lost_node_s"],
        }
        for taint in LOST_NODE_TAINTS
    ]


def pod_spec(deploy: Mapping[str, Any], container: dict, restart: str = "Never") -> dict:
    # Ours first: the taint eviction controller goes by the first toleration that matches each taint
    # (GetMatchingTolerations), so a wildcard of deploy.tolerations
    # cannot outlast deploy.lost_node_s.
    tolerations = lost_node_tolerations(deploy) + [dict(t) for t in deploy["tolerations"]]
    scheduling = optional(
        priorityClassName=deploy["priority_class"],
        nodeSelector=label_texts(deploy["node_selector"]) or None,
        affinity=affinity(deploy),
        tolerations=tolerations or None,
        imagePullSecrets=[{"name": s} for s in deploy["image_pull_secrets"]] or None,
    )
    return {
        "restartPolicy": restart,
        # SIGTERM first: every rank stops at one step and rank 0 checkpoints; torchrun gives
        # its workers 30 s, and this leaves the container time to report.
        "terminationGracePeriodSeconds": 90,
        "automountServiceAccountToken": False,  # nothing in the pod talks to the API server
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,  # the Dockerfile's trainer user
            "runAsGroup": 10001,
            "fsGroup": 10001,  # makes the runs volume writable by that user
            # Only where the volume's root is not the group's yet: changing every file of a
            # large run dir at each start takes minutes.
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        **scheduling,
        "containers": [container],
        "volumes": [
            # The container default of 64 MiB breaks NCCL's SHM transport and DataLoader workers.
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": deploy["shm_size"]}},
            {"name": "tmp", "emptyDir": {}},
            {"name": "runs", "persistentVolumeClaim": {"claimName": runs_claim_name(deploy)}},
        ],
    }


def runs_claim(deploy: Mapping[str, Any]) -> dict:
    spec = {
        "accessModes": [deploy["runs_access_mode"]],
        **optional(storageClassName=deploy["storage_class"]),
        "resources": {"requests": {"storage": deploy["runs_storage"]}},
    }
    claim = manifest("v1", "PersistentVolumeClaim", deploy, spec)
    claim["metadata"]["name"] = runs_claim_name(deploy)
    return claim

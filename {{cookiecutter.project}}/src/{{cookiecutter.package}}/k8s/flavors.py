"""One builder per workload kind, and the table FLAVORS that deploy.flavor picks from. A new
flavor is a builder here and an entry in the table, nothing else: the deploy schema's choices
(deploy.FlavorName), the checks, render and apply read the table, and the template's tests
hold its prompt and the READMEs against it (docs/extending.md, "Add a flavor")."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import PACKAGE
from ..core.exits import FAIL_AT_ONCE
from .meta import labels, manifest, optional
from .pods import (
    COMMAND,
    POD_IP,
    Launch,
    c10d_launch,
    pod_metadata,
    pod_spec,
    rendezvous_timeouts,
    torchrun_launch,
    train_args,
    trainer_container,
)

Deploy = Mapping[str, Any]
Env = Mapping[str, str]
REPLICATED_JOB = "node"  # a JobSet's one replicated Job: its pods are the nodes
# Kubeflow Trainer v2.3 (pkg/constants/constants.go, pkg/runtime/framework/plugins/torch/torch.go):
# a TrainJob on the torch-distributed runtime becomes a JobSet whose replicated Job and container
# are both "node". The torch plugin sets PET_NNODES (numNodes), PET_NPROC_PER_NODE
# (numProcPerNode), PET_NODE_RANK (the completion index), PET_MASTER_ADDR (<name>-node-0-0.<name>)
# and PET_MASTER_PORT (29500); a TrainJob may not set them itself. torchrun reads PET_NNODES and
# PET_NPROC_PER_NODE as --nnodes and --nproc-per-node; the rendezvous is c10d, as for the others.
TRAINJOB_RUNTIME = "torch-distributed"
TRAINER_NODE = "node"
TRAINER_PORT = 29500
TRAINJOB_LAUNCH = c10d_launch("PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
# Who wrote a runtime patch. Trainer v2.3's webhook (pkg/runtime/framework/plugins/jobset/jobset.go)
# requires a domain-prefixed path (apimachinery's IsDomainPrefixedPath, as Kueue's
# kueue.x-k8s.io/manager) and fails closed on CREATE: the bare package name was refused.
PATCH_MANAGER = f"ddp-template.local/{PACKAGE}"
RANDOM_SUFFIX = "-abcde"  # the 5 characters a controller's generateName adds to a pod's name


def job_spec(
    deploy: Deploy, env: Env, backoff_limit: int, rendezvous_host: str, subdomain: bool = False
) -> dict:
    """One pod per node (Indexed when there are several), failing fast on a config error.
    subdomain: the pods' own, the headless Service's name (a JobSet sets it itself)."""
    name, nodes = deploy["name"], deploy["nodes"]
    container = trainer_container(deploy, env, torchrun_launch(deploy, rendezvous_host))
    pod = pod_spec(deploy, container)  # Never: podFailurePolicy needs it; a new pod resumes the run
    spec: dict[str, Any] = {
        "backoffLimit": backoff_limit,
        **optional(activeDeadlineSeconds=deploy["active_deadline_s"]),
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",  # a config error or a divergence: no retry fixes them
                    "onExitCodes": {
                        "containerName": "trainer",
                        "operator": "In",
                        "values": FAIL_AT_ONCE,
                    },
                },
                {
                    "action": "Ignore",  # eviction, preemption, drain: retry without counting it
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
            ]
        },
    }
    if nodes > 1:
        spec |= {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes}
        if subdomain:
            pod["subdomain"] = name  # pods are <name>-<index>.<name>: the headless Service
    spec["template"] = {"metadata": pod_metadata(deploy), "spec": pod}
    return spec


def job(deploy: Deploy, env: Env) -> dict:
    # A failure on one node fails the pods of every node: count retries per failure.
    name = deploy["name"]
    backoff_limit = deploy["backoff_limit"] * deploy["nodes"]
    spec = job_spec(deploy, env, backoff_limit, rendezvous_host=f"{name}-0.{name}", subdomain=True)
    spec = optional(ttlSecondsAfterFinished=deploy["ttl_after_finished_s"]) | spec
    return manifest("batch/v1", "Job", deploy, spec, queued=True)


def service(deploy: Deploy) -> dict:
    """The headless Service that names an Indexed Job's pods <name>-<index>.<name>."""
    spec = {
        "clusterIP": "None",  # headless: one DNS name per pod, no proxy
        "publishNotReadyAddresses": True,  # the names resolve before any pod is ready
        "selector": {"job-name": deploy["name"]},
        "ports": [{"name": "rendezvous", "port": deploy["rdzv_port"]}],
    }
    return manifest("v1", "Service", deploy, spec)


def jobset(deploy: Deploy, env: Env) -> dict:
    """The same pods in a JobSet: any failed pod fails its Job, and the JobSet then recreates
    every node's pod, which all resume from the newest checkpoint. It names its pods
    <jobset>-<replicated job>-<job index>-<pod index> under the subdomain <jobset>."""
    name = deploy["name"]
    host = f"{name}-{REPLICATED_JOB}-0-0.{name}"
    spec = {
        **optional(ttlSecondsAfterFinished=deploy["ttl_after_finished_s"]),
        "failurePolicy": {
            "maxRestarts": deploy["backoff_limit"],
            # the Job failed through its podFailurePolicy (a config error) or ran out of
            # deploy.active_deadline_s: a restart would not help
            "rules": [
                {
                    "name": "ConfigErrorOrDeadline",
                    "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy", "DeadlineExceeded"],
                }
            ],
        },
        "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
        "replicatedJobs": [
            {
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": labels(name)},
                    "spec": job_spec(deploy, env, backoff_limit=0, rendezvous_host=host),
                },
            }
        ],
    }
    return manifest("jobset.x-k8s.io/v1alpha2", "JobSet", deploy, spec, queued=True)


def pytorchjob(deploy: Deploy, env: Env) -> dict:
    """The same pod under the Kubeflow training operator: one Worker replica per node, and
    torchrun's c10d rendezvous on worker 0, which the operator wires up from elasticPolicy."""
    name, nodes = deploy["name"], deploy["nodes"]
    # The operator's PET_* env (elasticPolicy) gives torchrun the c10d rendezvous on worker 0,
    # --nnodes and --max-restarts; older operators set PET_NPROC_PER_NODE only with a Master.
    a = train_args(deploy)
    launch = Launch([COMMAND, "train"], [*a["processes"], *a["run_dir"]], [])
    # the operator injects into, and reads the port of, the container "pytorch"
    container = trainer_container(deploy, env, launch, name="pytorch")
    container["ports"] = [{"name": "pytorchjob-port", "containerPort": deploy["rdzv_port"]}]
    # OnFailure: the kubelet restarts a failed container in its pod, which keeps its DNS name.
    pod = pod_spec(deploy, container, restart="OnFailure")
    spec = {
        "nprocPerNode": str(deploy["gpus_per_node"]),
        "elasticPolicy": {
            "rdzvBackend": "c10d",
            "rdzvPort": deploy["rdzv_port"],
            "rdzvId": name,
            "minReplicas": nodes,  # a fixed world: no autoscaling
            "maxReplicas": nodes,
            "maxRestarts": deploy["max_restarts"],
            "rdzvConf": [{"key": k, "value": v} for k, v in rendezvous_timeouts(deploy).items()],
        },
        "runPolicy": {
            "backoffLimit": deploy["backoff_limit"] * nodes,  # a failure on one node restarts all
            "cleanPodPolicy": "Running",  # a finished job frees every GPU; logs stay
            **optional(
                ttlSecondsAfterFinished=deploy["ttl_after_finished_s"],
                activeDeadlineSeconds=deploy["active_deadline_s"],
            ),
        },
        "pytorchReplicaSpecs": {
            "Worker": {
                "replicas": nodes,
                "restartPolicy": "OnFailure",
                "template": {"metadata": pod_metadata(deploy), "spec": pod},
            }
        },
    }
    return manifest("kubeflow.org/v1", "PyTorchJob", deploy, spec, queued=True)


def trainjob(deploy: Deploy, env: Env) -> dict:
    """The same pods from Kubeflow Trainer v2: a TrainJob on the torch-distributed
    ClusterTrainingRuntime, which makes a JobSet of numNodes pods. What a TrainJob's trainer
    cannot hold (security contexts, volumes, scheduling) goes in as a runtime patch."""
    name = deploy["name"]
    a = train_args(deploy)  # --nnodes and --nproc-per-node: Trainer's PET_* env
    launch = Launch(
        ["/bin/sh", "-c", TRAINJOB_LAUNCH, COMMAND],
        [*a["rendezvous"], *a["restarts"], *a["run_dir"]],
        [POD_IP],
    )
    # Trainer's torch plugin fills in the container "node"
    container = trainer_container(deploy, env, launch, name=TRAINER_NODE)
    pod = pod_spec(deploy, container, restart="OnFailure")  # the runtime's
    patched = (
        "securityContext",
        "terminationGracePeriodSeconds",
        "nodeSelector",
        "affinity",
        "tolerations",
        "imagePullSecrets",
        "volumes",
    )
    pod_patch = {key: pod[key] for key in patched if key in pod}
    # Patches cannot set automountServiceAccountToken: a ServiceAccount without a token does.
    pod_patch["serviceAccountName"] = name
    pod_patch["containers"] = [
        {key: container[key] for key in ("name", "securityContext", "volumeMounts")}
    ]
    node_patch = {"template": {"metadata": pod_metadata(deploy), "spec": pod_patch}}
    spec = {
        "runtimeRef": {
            "apiGroup": "trainer.kubeflow.org",
            "kind": "ClusterTrainingRuntime",
            "name": TRAINJOB_RUNTIME,
        },
        **optional(activeDeadlineSeconds=deploy["active_deadline_s"]),
        "trainer": {
            "image": container["image"],
            "command": container["command"],
            "args": container["args"],
            "env": container["env"],
            "numNodes": deploy["nodes"],
            "numProcPerNode": deploy["gpus_per_node"],
            "resourcesPerNode": container["resources"],
        },
        "runtimePatches": [
            {
                "manager": PATCH_MANAGER,
                "trainingRuntimeSpec": {
                    "template": {
                        "spec": {
                            "replicatedJobs": [
                                {"name": TRAINER_NODE, "template": {"spec": node_patch}}
                            ]
                        }
                    }
                },
            }
        ],
    }
    return manifest("trainer.kubeflow.org/v1alpha1", "TrainJob", deploy, spec, queued=True)


def trainjob_pod_template(trainjob: dict) -> dict:
    """The runtime patch's pod with the trainer's container fields (the runtime's own part is not
    in it), without its ServiceAccount: k8s/ applies that, a check's pod takes the default."""
    spec = trainjob["spec"]
    (patch,) = spec["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    template = node["template"]["spec"]["template"]
    trainer = spec["trainer"]
    fields = {
        "image": trainer.get("image"),
        "command": trainer.get("command"),
        "args": trainer.get("args"),
        "env": trainer.get("env"),
        "resources": trainer.get("resourcesPerNode"),
    }
    containers = [
        c | {k: v for k, v in fields.items() if v is not None}
        for c in template["spec"]["containers"]
    ]
    pod = {k: v for k, v in template["spec"].items() if k != "serviceAccountName"}
    return {"metadata": template.get("metadata", {}), "spec": pod | {"containers": containers}}


def service_account(deploy: Deploy) -> dict:
    """A TrainJob's pods' account, without an API token: its pods cannot say so themselves."""
    account = manifest("v1", "ServiceAccount", deploy, spec=None)
    return account | {"automountServiceAccountToken": False}


def trainjob_cannot(deploy: Deploy) -> list[tuple[str, str]]:
    """What Trainer v2.3's TrainJob API cannot carry, or sets itself."""
    return [
        (key, why)
        for key, ok, why in [
            (
                "image_pull_policy",
                deploy["image_pull_policy"] == "IfNotPresent",
                "a TrainJob cannot set it: its pods get IfNotPresent, "
                "Kubernetes' default for a tagged image",
            ),
            (
                "rdzv_port",
                deploy["rdzv_port"] == TRAINER_PORT,
                f"a TrainJob's rendezvous port is Trainer's {TRAINER_PORT} (PET_MASTER_PORT)",
            ),
            (
                "priority_class",
                deploy["priority_class"] is None,
                "a TrainJob cannot set it (Trainer v2.3's runtimePatches have no "
                "priorityClassName); use a queue",
            ),
        ]
        if not ok
    ]


def job_pod_name(name: str, nodes: int) -> str:
    """An Indexed Job's longest pod name: <job>-<index>-<random> (batch/v1's job controller)."""
    return f"{name}-{nodes - 1}{RANDOM_SUFFIX}" if nodes > 1 else f"{name}{RANDOM_SUFFIX}"


def jobset_pod_name(name: str, nodes: int) -> str:
    """A JobSet's longest pod name, as JobSet v0.12's webhook checks it (pkg/webhooks/
    jobset_webhook.go: GenPodName(jobset, replicated job, last job index, last pod index) plus
    "-abcde", a DNS-1035 label): a TrainJob's JobSet has its name and the replicated Job "node"."""
    return f"{name}-{REPLICATED_JOB}-0-{nodes - 1}{RANDOM_SUFFIX}"


def pytorchjob_pod_name(name: str, nodes: int) -> str:
    """The training operator's pod name, <job>-worker-<index> (common GenGeneralName): no suffix."""
    return f"{name}-worker-{nodes - 1}"


@dataclass(frozen=True)
class Flavor:
    """Everything about a flavor that is its own; its name is its key in FLAVORS, and the name of
    the file it writes, k8s/<name>.yaml."""

    kind: str  # the workload's kind, this flavor's own: make k8s-apply finds the entry by it
    resource: str  # as kubectl names it: make k8s-apply deletes the project's workloads by it
    build: Callable[[Deploy, Env], dict]
    needs: str  # the controller a cluster must run, for the file's header; "" for none
    # The longest pod name its controller makes, from deploy.name and deploy.nodes: within 63.
    pod_name: Callable[[str, int], str]
    # The template its controller makes its pods from, out of the built workload: make k8s-apply
    # checks it as a bare Pod (PodSecurity) and reads its claims and grace period.
    pod_template: Callable[[dict], dict]
    # What becomes of a pod on a node that stopped answering, once it is evicted and stays
    # Terminating (the notes after a render): who replaces it, and when.
    lost_node: str
    # The other objects it needs, by file name (a Job's Service, a TrainJob's ServiceAccount),
    # and the comment above each of those files, formatted with name=deploy.name.
    companions: Callable[[Deploy], dict[str, dict]] = lambda deploy: {}
    companion_headers: Mapping[str, str] = field(default_factory=dict)
    header_note: str = ""  # more for its file's header: what the deploy keys cannot set
    logs: str = "-l app.kubernetes.io/name={name}"  # what kubectl logs -f follows, with name=
    cannot: Callable[[Deploy], list[tuple[str, str]]] = lambda deploy: []  # (key, why) it refuses
    # Kueue's integration for the kind where a platform must enable it (Kueue's Configuration,
    # integrations.frameworks; per Kueue's docs for PyTorchJob and TrainJob): without it the
    # queue label does nothing. "" where Kueue's default configuration manages the kind.
    kueue_opt_in: str = ""


# A Job's pods, and a JobSet's, whose Job holds them: replaced only once failed.
JOB_LOST_NODE = (
    "the Job replaces it only when it has failed (podReplacementPolicy Failed, which "
    "podFailurePolicy requires)"
)

FLAVORS = {
    "job": Flavor(
        "Job",
        "jobs.batch",
        job,
        needs="",
        pod_name=job_pod_name,
        pod_template=lambda w: w["spec"]["template"],
        lost_node=JOB_LOST_NODE,
        companions=lambda d: {"service.yaml": service(d)} if d["nodes"] > 1 else {},
        companion_headers={
            "service.yaml": (
                "# The headless Service that names each pod of the Indexed Job: "
                "{name}-<index>.{name}\n"
            )
        },
        logs="job/{name}",
    ),
    "jobset": Flavor(
        "JobSet",
        "jobsets.jobset.x-k8s.io",
        jobset,
        pod_name=jobset_pod_name,
        needs="the JobSet controller (jobset.x-k8s.io)",
        pod_template=lambda w: w["spec"]["replicatedJobs"][0]["template"]["spec"]["template"],
        lost_node=JOB_LOST_NODE,
    ),
    "pytorchjob": Flavor(
        "PyTorchJob",
        "pytorchjobs.kubeflow.org",
        pytorchjob,
        pod_name=pytorchjob_pod_name,
        needs="the Kubeflow training operator (kubeflow.org/v1)",
        kueue_opt_in="kubeflow.org/pytorchjob",
        pod_template=lambda w: w["spec"]["pytorchReplicaSpecs"]["Worker"]["template"],
        # the operator names a pod <name>-worker-<index>, without a random suffix
        lost_node=(
            "its replacement has its name, so the operator can create it only once "
            "the old pod is gone"
        ),
    ),
    "trainjob": Flavor(
        "TrainJob",
        "trainjobs.trainer.kubeflow.org",
        trainjob,
        pod_name=jobset_pod_name,
        needs=(
            f"Kubeflow Trainer v2 (trainer.kubeflow.org) and its {TRAINJOB_RUNTIME} "
            "ClusterTrainingRuntime"
        ),
        companions=lambda d: {"serviceaccount.yaml": service_account(d)},
        cannot=trainjob_cannot,
        companion_headers={
            "serviceaccount.yaml": "# The pods' ServiceAccount, without an API token: a TrainJob "
            "cannot set automountServiceAccountToken on its pods.\n"
        },
        header_note=(
            "# The runtime decides the retries and keeps finished jobs "
            "(deploy.backoff_limit and deploy.ttl_after_finished_s do not apply).\n"
        ),
        kueue_opt_in="trainer.kubeflow.org/trainjob",
        pod_template=trainjob_pod_template,
        lost_node=(
            "the runtime's Job replaces it at once (podReplacementPolicy TerminatingOrFailed: two "
            "pod 0s if the old one still runs), counts it against its backoffLimit (6) and its "
            f"JobSet has no failurePolicy; {TRAINJOB_RUNTIME} sets these, a TrainJob cannot"
        ),
    ),
}

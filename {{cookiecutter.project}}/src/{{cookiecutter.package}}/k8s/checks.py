"""The deploy group's values, checked before anything is rendered: each value the API server
would refuse (or that would make a job that cannot run) is refused here, in one line naming the
key and what is allowed. config/deploy.py's DeployConfig runs deploy_errors(); so does the
template's hook, on the plain YAML."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ..core.suggest import did_you_mean
from .flavors import FLAVORS, Flavor
from .meta import TOPOLOGY_ANNOTATIONS, label_text, labels, quantity, topology_annotation
from .pods import LOST_NODE_TAINTS

NAME_MAX = 47  # pods are <name>-<index>-<5 characters> or <name>-node-0-<index>-<5>: within 63
POD_NAME_MAX = 63  # a DNS label; each flavor's longest pod name is checked against it (nodes > 100)
RFC1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # Services and TrainJobs: a letter first
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
# An OCI image reference: [registry[:port]/]path[:tag][@sha256:digest].
IMAGE = re.compile(
    r"(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?(?:@(?P<digest>sha256:[a-f0-9]{64}))?"
)
PULL_POLICIES = ("IfNotPresent", "Always", "Never")
# Set by deploy.gpus_per_node, cpu_per_gpu, memory_per_gpu and ephemeral_storage.
OWN_RESOURCES = ("cpu", "memory", "ephemeral-storage", "nvidia.com/gpu")
CAPABILITY = re.compile(r"[A-Z][A-Z0-9_]*")
# PodSecurity restricted allows adding this one only
# (baseline a few more; IPC_LOCK none but privileged).
RESTRICTED_CAPABILITIES = ("NET_BIND_SERVICE",)
INT32_MAX = 2**31 - 1  # the API's int32 fields: backoffLimit, maxRestarts, ttlSecondsAfterFinished
INT64_MAX = 2**63 - 1  # activeDeadlineSeconds, tolerationSeconds
INDEXED_MAX = 100_000  # completions and parallelism of an Indexed Job (batch/v1 validation)
ANNOTATIONS_MAX = 256 * 1024  # all of an object's annotations, keys and values (apimachinery)
RDZV_TIMEOUT_MAX = 86400
LOST_NODE_MAX = 86400  # longer is a pod that a dead node keeps for good: null says that plainly
AFFINITY_KEYS = ("nodeAffinity", "podAffinity", "podAntiAffinity")
TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
SIZES = ("memory_per_gpu", "shm_size", "ephemeral_storage", "runs_storage")
ADDED_LATER = {"env": {}, "secret_env": {}}  # keys a project rendered before them lacks
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")  # a Secret's data key
NCCL_VARS = re.compile(r"(TORCH_)?NCCL_\w*|GLOO_\w*")
SECRET_LIKE = re.compile(r"KEY|TOKEN|PASSWORD|PASSWD|SECRET|CREDENTIAL", re.IGNORECASE)
# What the trainer container's env already holds (pods.py and the launch lines).
OWN_ENV = (
    "HOME",
    "PYTHONUNBUFFERED",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
    "POD_IP",
    "JOB_COMPLETION_INDEX",
    "RDZV_HOST",
    "RDZV_PORT",
)


def whole_number(value: Any, low: int, high: float = math.inf) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def label_key_ok(key: Any) -> bool:
    """[prefix/]name, the prefix a DNS subdomain, as in nvidia.com/gpu.product."""
    if not isinstance(key, str):
        return False
    prefix, slash, name = key.rpartition("/")
    prefix_ok = not slash or (len(prefix) <= 253 and DNS_SUBDOMAIN.fullmatch(prefix) is not None)
    return prefix_ok and len(name) <= 63 and LABEL_NAME.fullmatch(name) is not None


def label_value_ok(value: Any) -> bool:
    return (
        isinstance(value, str)
        and len(value) <= 63
        and LABEL_NAME.fullmatch(value or "a") is not None
    )


def toleration_errors(key: str, toleration: Any) -> list[str]:
    if not isinstance(toleration, Mapping):
        return [f"{key}={toleration}: must be a mapping of {', '.join(TOLERATION_KEYS)}"]
    unknown = sorted(set(toleration) - set(TOLERATION_KEYS))
    if unknown:
        hint = did_you_mean(unknown[0], TOLERATION_KEYS, f"{key}.")
        return [f"{key}.{unknown[0]}: no such key; {hint}allowed: {', '.join(TOLERATION_KEYS)}"]
    operator, effect = toleration.get("operator", "Equal"), toleration.get("effect", "")
    problems = {
        "operator": (operator in ("Equal", "Exists"), "must be Equal or Exists"),
        "key": (
            label_key_ok(toleration.get("key"))
            or (operator == "Exists" and not toleration.get("key")),
            "must be a taint key such as nvidia.com/gpu (only operator Exists may leave it out)",
        ),
        "value": (
            label_value_ok(toleration.get("value", ""))
            and not (operator == "Exists" and toleration.get("value")),
            "must be a label value (63 characters: letters, digits, '-', '_', '.'), "
            "empty with operator Exists",
        ),
        "effect": (
            effect in ("", *TAINT_EFFECTS),
            f"must be empty (any effect) or one of {', '.join(TAINT_EFFECTS)}",
        ),
        "tolerationSeconds": (
            "tolerationSeconds" not in toleration
            or (whole_number(toleration["tolerationSeconds"], 0) and effect == "NoExecute"),
            "must be a whole number of seconds, 0 or more, with effect NoExecute",
        ),
    }
    return [
        f"{key}.{field}={toleration.get(field)}: {allowed}"
        for field, (ok, allowed) in problems.items()
        if not ok
    ]


def map_errors(deploy: Mapping[str, Any], key: str, label_values: bool) -> list[str]:
    """A map of label (or annotation) keys to strings, such as deploy.node_selector."""
    problems = []
    for name, value in deploy[key].items():
        if not label_key_ok(name):
            problems.append(
                f"deploy.{key}.{name}: must be {'a label' if label_values else 'an annotation'} "
                "key ([prefix/]name, such as nvidia.com/gpu.product; name: 63 characters, "
                "letters, digits, '-', '_', '.')"
            )
        elif isinstance(value, float):
            problems.append(typed_value_error(key, name, value))
        elif not isinstance(value, str | bool | int) or (
            label_values and not label_value_ok(label_text(value))
        ):
            allowed = (
                "a label value (63 characters: letters, digits, '-', '_', '.')"
                if label_values
                else "a string"
            )
            problems.append(f"deploy.{key}.{name}={value}: must be {allowed}")
    return problems


def typed_value_error(key: str, name: str, value: float) -> str:
    """A value YAML or Hydra read as a float: what was written is lost (1.10 reads as 1.1, 1e3
    as 1000.0), so rendering str(value) would put another value in the label than the user's."""
    return (
        f"deploy.{key}.{name}={value}: read as the number {value}, which loses what was written "
        f"(1.10 reads as 1.1, 1e3 as 1000.0); quote it: \"deploy.{key}.{name}='<text>'\" on the "
        f'command line, {name}: "<text>" in YAML'
    )


def env_errors(deploy: Mapping[str, Any]) -> list[str]:
    """deploy.env (plain values) and deploy.secret_env (<Secret>/<key>): names a container may
    have that this project does not set itself, and no secret in the clear."""
    problems = []
    for key in ("env", "secret_env"):
        for var, value in deploy[key].items():
            where = f"deploy.{key}.{var}"
            if not isinstance(var, str) or not ENV_NAME.fullmatch(var):
                problems.append(
                    f"{where}: must be a variable name (letters, digits, '_', not a digit first)"
                )
            elif NCCL_VARS.fullmatch(var):
                problems.append(
                    f"{where}: an NCCL or gloo variable: set it with nccl.env.{var}, "
                    "which the doctor and the report see"
                )
            elif var in OWN_ENV or var.startswith("PET_"):
                problems.append(
                    f"{where}: the launch line sets it "
                    f"(allowed: any variable but {', '.join(OWN_ENV)} and PET_*)"
                )
            elif key == "env" and var in deploy["secret_env"]:
                problems.append(f"{where}: also in deploy.secret_env: keep one")
            elif key == "env" and SECRET_LIKE.search(var):
                problems.append(
                    f"{where}: looks like a secret, which k8s/ and the logs would hold in the "
                    f"clear; name it from a Secret instead: deploy.secret_env.{var}=<secret>/<key> "
                    "(kubectl create secret generic <secret> --from-literal=<key>=...)"
                )
            elif key == "env" and isinstance(value, float):
                problems.append(typed_value_error(key, var, value))
            elif key == "env" and not isinstance(value, str | bool | int):
                problems.append(f"{where}={value}: must be a string, a number or true/false")
            elif key == "secret_env" and not secret_ref_ok(value):
                problems.append(
                    f"{where}={value}: must be <Secret>/<key>, such as wandb/api-key "
                    "(a Secret's name, a DNS subdomain; a key: letters, digits, '-', '_', '.')"
                )
    return problems


def secret_ref_ok(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    secret, slash, key = value.partition("/")
    return bool(slash) and name_ok(secret, DNS_SUBDOMAIN, 253) and name_ok(key, SECRET_KEY, 253)


def name_ok(value: Any, pattern: re.Pattern, length: int) -> bool:
    return isinstance(value, str) and len(value) <= length and pattern.fullmatch(value) is not None


def deploy_errors(deploy: Mapping[str, Any]) -> list[str]:
    """What is wrong in the deploy group, one line each (deploy.<key>=<value>: what is allowed).
    Runs before anything is rendered: a manifest is written whole or not at all."""
    # A project's configs/ from before a key existed (cruft update) gets the key's default.
    deploy = {**ADDED_LATER, **deploy}
    problems = [*name_and_image_errors(deploy), *number_errors(deploy), *kind_errors(deploy)]
    if problems:  # the checks below read these values: numbers, lists and maps as checked here
        return problems
    return [
        *toleration_list_errors(deploy),
        *placement_errors(deploy),
        *resource_errors(deploy),
        *metadata_errors(deploy),
        *env_errors(deploy),
        *storage_errors(deploy),
        *queue_errors(deploy),
        *flavor_errors(deploy),
    ]


class DeployProblems(list):
    """Lines of what is wrong in a deploy group; check() adds the usual one for a key."""

    def __init__(self, deploy: Mapping[str, Any]) -> None:
        super().__init__()
        self.deploy = deploy

    def check(self, ok: Any, key: str, allowed: str) -> None:
        if not ok:
            self.append(f"deploy.{key}={self.deploy[key]}: {allowed}")


def name_and_image_errors(deploy: Mapping[str, Any]) -> list[str]:
    """deploy.name, namespace, flavor, image and image_pull_policy."""
    problems = DeployProblems(deploy)
    name, flavor, policy = deploy["name"], deploy["flavor"], deploy["image_pull_policy"]
    problems.check(
        name_ok(name, RFC1035_LABEL, NAME_MAX),
        "name",
        "must be a-z, 0-9 and '-', start with a letter and end with a letter or digit, "
        f"at most {NAME_MAX} characters",
    )
    problems.check(
        name_ok(deploy["namespace"], DNS_LABEL, 63),
        "namespace",
        "must be a DNS label: a-z, 0-9 and '-', at most 63 characters",
    )
    problems.check(flavor in FLAVORS, "flavor", f"must be one of {', '.join(FLAVORS)}")
    image = deploy["image"]
    parts = IMAGE.fullmatch(image) if isinstance(image, str) and len(image) <= 255 else None
    problems.check(
        parts,
        "image",
        "must be an image reference: [registry/]name:tag or [registry/]name@sha256:<digest>",
    )
    if parts:
        problems.check(
            parts["tag"] or parts["digest"],
            "image",
            "must name a tag or a digest (e.g. ghcr.io/acme/project:0.1.0): "
            "a node reuses the image it pulled",
        )
        problems.check(
            parts["tag"] != "latest" or parts["digest"] or policy == "Always",
            "image",
            "a node keeps the :latest it pulled first; use a version tag or a digest "
            "(or image_pull_policy=Always)",
        )
    problems.check(
        policy in PULL_POLICIES, "image_pull_policy", f"must be one of {', '.join(PULL_POLICIES)}"
    )
    return problems


def number_errors(deploy: Mapping[str, Any]) -> list[str]:
    """The counts, sizes, ports and seconds."""
    problems = DeployProblems(deploy)
    nodes = deploy["nodes"]
    problems.check(
        whole_number(nodes, 1, INDEXED_MAX),
        "nodes",
        f"must be 1 to {INDEXED_MAX} (an Indexed Job's most completions)",
    )
    problems.check(whole_number(deploy["gpus_per_node"], 1, 16), "gpus_per_node", "must be 1 to 16")
    cores = quantity(deploy["cpu_per_gpu"])
    problems.check(
        cores and (cores * 1000).denominator == 1,
        "cpu_per_gpu",
        "must be a CPU quantity above 0 in steps of 1m, such as 4 or 3500m",
    )
    for key in SIZES:
        size = quantity(deploy[key])
        problems.check(
            size and size.denominator == 1, key, "must be a size such as 16Gi, 500Mi or 2G"
        )
    problems.check(
        whole_number(deploy["rdzv_port"], 1024, 65535), "rdzv_port", "must be 1024 to 65535"
    )
    # A failure on one node fails every node's pod: the rendered backoffLimit is this x nodes.
    most = INT32_MAX // nodes if whole_number(nodes, 1) else INT32_MAX
    problems.check(
        whole_number(deploy["backoff_limit"], 0, most),
        "backoff_limit",
        f"must be 0 to {most} (the job's backoffLimit, this x deploy.nodes, is an int32)",
    )
    problems.check(
        whole_number(deploy["max_restarts"], 0, INT32_MAX),
        "max_restarts",
        f"must be 0 to {INT32_MAX}",
    )
    problems.check(
        whole_number(deploy["rdzv_timeout_s"], 10, RDZV_TIMEOUT_MAX),
        "rdzv_timeout_s",
        f"must be 10 to {RDZV_TIMEOUT_MAX} seconds (a day)",
    )
    ttl, deadline = deploy["ttl_after_finished_s"], deploy["active_deadline_s"]
    problems.check(
        ttl is None or whole_number(ttl, 0, INT32_MAX),
        "ttl_after_finished_s",
        f"must be null (keep) or seconds, 0 to {INT32_MAX}",
    )
    problems.check(
        deadline is None or whole_number(deadline, 1, INT64_MAX),
        "active_deadline_s",
        "must be null (no limit) or seconds, at least 1",
    )
    lost = deploy["lost_node_s"]
    problems.check(
        lost is None or whole_number(lost, 0, LOST_NODE_MAX),
        "lost_node_s",
        f"must be null (the cluster's 300 s) or seconds, 0 to {LOST_NODE_MAX} (a day)",
    )
    problems.check(isinstance(deploy["guaranteed"], bool), "guaranteed", "must be true or false")
    problems.check(
        isinstance(deploy["one_pod_per_node"], bool), "one_pod_per_node", "must be true or false"
    )
    return problems


def kind_errors(deploy: Mapping[str, Any]) -> list[str]:
    """Each list is a list and each map a mapping. The schema makes them so, but the template's
    hook reads configs/ as plain YAML (cruft update: as the user left them)."""
    problems = DeployProblems(deploy)
    kinds = {
        "tolerations": list,
        "node_selector": Mapping,
        "affinity": Mapping,
        "extra_resources": Mapping,
        "capabilities": list,
        "pod_labels": Mapping,
        "pod_annotations": Mapping,
        "image_pull_secrets": list,
        "env": Mapping,
        "secret_env": Mapping,
    }
    for key, kind in kinds.items():
        problems.check(
            isinstance(deploy[key], kind),
            key,
            f"must be a {'mapping' if kind is Mapping else 'list'}",
        )
    return problems


def toleration_list_errors(deploy: Mapping[str, Any]) -> list[str]:
    """Each toleration as the API server reads it, and none of a lost node's taints:
    deploy.lost_node_s sets those."""
    problems = DeployProblems(deploy)
    for index, toleration in enumerate(deploy["tolerations"]):
        problems += toleration_errors(f"deploy.tolerations[{index}]", toleration)
        # as DefaultTolerationSeconds reads a toleration of them; one after ours would never be used
        if (
            isinstance(toleration, Mapping)
            and toleration.get("key") in LOST_NODE_TAINTS
            and toleration.get("effect", "") in ("", "NoExecute")
        ):
            problems.append(
                f"deploy.tolerations[{index}].key={toleration['key']}: set deploy.lost_node_s "
                "instead, which tolerates both of a lost node's taints"
            )
    return problems


def placement_errors(deploy: Mapping[str, Any]) -> list[str]:
    """Where the pods may run: deploy.node_selector, deploy.affinity, deploy.one_pod_per_node."""
    problems = DeployProblems(deploy)
    problems += map_errors(deploy, "node_selector", label_values=True)
    for key in sorted(set(deploy["affinity"]) - set(AFFINITY_KEYS)):
        hint = did_you_mean(key, AFFINITY_KEYS, "deploy.affinity.")
        problems.append(
            f"deploy.affinity.{key}: no such key; {hint}allowed: {', '.join(AFFINITY_KEYS)} "
            "(as in a pod's spec.affinity)"
        )
    for key in AFFINITY_KEYS:
        if not isinstance(deploy["affinity"].get(key, {}), Mapping):
            problems.append(
                f"deploy.affinity.{key}: must be a mapping, as in a pod's spec.affinity"
            )
    problems.check(
        not (deploy["one_pod_per_node"] and "podAntiAffinity" in deploy["affinity"]),
        "one_pod_per_node",
        "is a podAntiAffinity of its own: set it or deploy.affinity.podAntiAffinity, not both",
    )
    return problems


def resource_errors(deploy: Mapping[str, Any]) -> list[str]:
    """What the pods ask of a node besides GPUs, CPU and memory: resources, capabilities."""
    problems = DeployProblems(deploy)
    for key, count in deploy["extra_resources"].items():
        if not label_key_ok(key) or "/" not in key or key in OWN_RESOURCES:
            problems.append(
                f"deploy.extra_resources.{key}: must be an extended resource name (prefix/name, "
                f"such as rdma/rdma_shared_device_a), not one of {', '.join(OWN_RESOURCES)}"
            )
        elif not whole_number(count, 1, INT32_MAX):
            problems.append(
                f"deploy.extra_resources.{key}={count}: must be a whole number, 1 to {INT32_MAX}"
            )
    for capability in deploy["capabilities"]:
        if not name_ok(capability, CAPABILITY, 64) or capability.startswith("CAP_"):
            problems.append(
                f"deploy.capabilities: {capability}: must be a Linux capability without CAP_, "
                "such as IPC_LOCK"
            )
    return problems


def metadata_errors(deploy: Mapping[str, Any]) -> list[str]:
    """The pods' labels and annotations, and the Secrets their images are pulled with."""
    problems = DeployProblems(deploy)
    name = deploy["name"]
    problems += map_errors(deploy, "pod_labels", label_values=True)
    problems += [
        f"deploy.pod_labels.{key}: is this project's own label; choose another key"
        for key in deploy["pod_labels"]
        if key in labels(name)
    ]
    problems += map_errors(deploy, "pod_annotations", label_values=False)
    annotations = {**deploy["pod_annotations"], **topology_annotation(deploy)}
    size = sum(len(str(key)) + len(str(value)) for key, value in annotations.items())
    if size > ANNOTATIONS_MAX:
        problems.append(
            f"deploy.pod_annotations: {size} bytes in all; "
            f"a pod's annotations hold at most {ANNOTATIONS_MAX} (256 KiB)"
        )
    for secret in deploy["image_pull_secrets"]:
        if not name_ok(secret, DNS_SUBDOMAIN, 253):
            problems.append(
                f"deploy.image_pull_secrets: {secret}: must be a Secret name "
                "(a DNS subdomain: a-z, 0-9, '-', '.')"
            )
    return problems


def storage_errors(deploy: Mapping[str, Any]) -> list[str]:
    """The run dirs' claim, and the classes named by name."""
    problems = DeployProblems(deploy)
    nodes = deploy["nodes"]
    problems.check(
        deploy["runs_access_mode"] == "ReadWriteMany"
        or deploy["runs_claim"] is not None
        or nodes == 1,
        "runs_access_mode",
        "several nodes share the run dir: ReadWriteMany, from a storage class "
        "that offers it (deploy.storage_class), or an existing claim (deploy.runs_claim)",
    )
    for key, kind in (
        ("priority_class", "a PriorityClass"),
        ("storage_class", "a StorageClass"),
        ("runs_claim", "a PersistentVolumeClaim"),
    ):
        problems.check(
            deploy[key] is None or name_ok(deploy[key], DNS_SUBDOMAIN, 253),
            key,
            f"must be null or {kind} name (a DNS subdomain: a-z, 0-9, '-', '.')",
        )
    return problems


def queue_errors(deploy: Mapping[str, Any]) -> list[str]:
    """Kueue's keys: the queue, its priority, the topology the pods are placed by."""
    problems = DeployProblems(deploy)
    queue = deploy["queue"]
    problems.check(
        queue is None or name_ok(queue, DNS_LABEL, 63),
        "queue",
        "must be null or a Kueue LocalQueue name: a-z, 0-9 and '-', at most 63 characters",
    )
    for key, what in (
        ("queue_priority", "a Kueue WorkloadPriorityClass"),
        (
            "topology",
            "a node label key naming a topology level, such as cloud.provider.com/topology-rack",
        ),
    ):
        value = deploy[key]
        valid = (
            name_ok(value, DNS_SUBDOMAIN, 253) if key == "queue_priority" else label_key_ok(value)
        )
        problems.check(value is None or valid, key, f"must be null or {what}")
        problems.check(
            value is None or queue is not None, key, "only Kueue reads it: set deploy.queue too"
        )
    problems.check(
        deploy["topology_mode"] in TOPOLOGY_ANNOTATIONS,
        "topology_mode",
        f"must be one of {', '.join(TOPOLOGY_ANNOTATIONS)}",
    )
    return problems


def flavor_errors(deploy: Mapping[str, Any]) -> list[str]:
    """What the chosen flavor's controller would refuse: pod names, keys it cannot carry."""
    problems = DeployProblems(deploy)
    name, nodes, flavor = deploy["name"], deploy["nodes"], deploy["flavor"]
    if flavor in FLAVORS:
        problems += pod_name_errors(name, nodes, FLAVORS[flavor])
        problems += [
            f"deploy.{key}={deploy[key]}: {why}" for key, why in FLAVORS[flavor].cannot(deploy)
        ]
    return problems


def pod_name_errors(name: str, nodes: int, flavor: Flavor) -> list[str]:
    """A pod name is a DNS label of 63 characters, and a controller's webhook refuses a workload
    whose pods would not fit (JobSet's for 101 nodes and a 47-character name)."""
    longest = flavor.pod_name(name, nodes)
    if len(longest) <= POD_NAME_MAX:
        return []
    most = POD_NAME_MAX - (len(longest) - len(name))
    return [
        f"deploy.name={name}: a {flavor.kind} of {nodes} nodes names a pod {longest} "
        f"({len(longest)} characters; a pod name holds {POD_NAME_MAX}): "
        f"at most {most} characters here"
    ]

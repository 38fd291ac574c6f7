"""What every object of k8s/ shares: its labels and metadata, and Kubernetes' quantities."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from .. import PROJECT

# Every object of the project carries it: make k8s-apply finds them by it.
NAME_LABEL = "app.kubernetes.io/name"
COMPONENT_LABEL = "app.kubernetes.io/component"
# The project's, whatever deploy.name and deploy.namespace: make k8s-apply finds by it a job left
# running under an earlier name or in another namespace. Never in a selector that deletes: objects
# applied before it existed lack it.
PART_OF_LABEL = "app.kubernetes.io/part-of"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"  # Kueue admits the job through this LocalQueue
PRIORITY_LABEL = (
    "kueue.x-k8s.io/priority-class"  # Kueue orders and preempts by this WorkloadPriorityClass
)
# Kueue's topology-aware scheduling: the pods of a pod set land in one domain of this level
# (kueue.x-k8s.io/v1beta1 PodSetTopologyRequest), required or as close as the cluster allows.
TOPOLOGY_ANNOTATIONS = {
    "required": "kueue.x-k8s.io/podset-required-topology",
    "preferred": "kueue.x-k8s.io/podset-preferred-topology",
}
HOSTNAME = "kubernetes.io/hostname"  # the node's own topology domain: one pod per node


TRAINING = "training"  # the component of what make k8s-apply applies, and deletes
DOCTOR = "doctor"  # make k8s-doctor's: make k8s-apply never lists it, so never deletes it


def identity(name: str, component: str = TRAINING) -> dict[str, str]:
    """The labels that say an object is this one's to replace or delete."""
    return {NAME_LABEL: name, COMPONENT_LABEL: component}


def labels(name: str, component: str = TRAINING) -> dict[str, str]:
    return {**identity(name, component), PART_OF_LABEL: PROJECT}


def label_text(value: str | bool | int) -> str:
    """A label or annotation value as the user wrote it: YAML and Hydra read `true` and `2` as a
    bool and an int, and Python's str() would give 'True' (the GPU operator's labels say true).
    k8s.checks refuses the values this cannot give back as written (a float: 1.10 reads as 1.1)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def label_texts(values: Mapping[str, Any]) -> dict[str, str]:
    return {key: label_text(value) for key, value in values.items()}


def optional(**values: Any) -> dict:
    """The fields whose value is set (not None)."""
    return {key: value for key, value in values.items() if value is not None}


def manifest(
    api_version: str,
    kind: str,
    deploy: Mapping[str, Any],
    spec: dict | None,
    suffix: str = "",
    queued: bool = False,
    component: str = TRAINING,
) -> dict:
    """A namespaced object of this project, named <deploy.name><suffix>; `queued`: the workload,
    which carries Kueue's labels when deploy.queue is set."""
    name = deploy["name"]
    metadata = {
        "name": name + suffix,
        "namespace": deploy["namespace"],
        "labels": labels(name, component),
    }
    if queued and deploy["queue"]:
        metadata["labels"][QUEUE_LABEL] = deploy["queue"]
        if deploy["queue_priority"]:
            metadata["labels"][PRIORITY_LABEL] = deploy["queue_priority"]
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata} | (
        {"spec": spec} if spec is not None else {}
    )


def topology_annotation(deploy: Mapping[str, Any]) -> dict[str, str]:
    """Kueue's topology request for the pod set, on the pod template: all nodes in one domain of
    the level deploy.topology names (a rack, a block), required or preferred."""
    if deploy["topology"] is None:
        return {}
    return {TOPOLOGY_ANNOTATIONS[deploy["topology_mode"]]: deploy["topology"]}


# ---------------------------------------------------------------- quantities ("16Gi", "3500m")

QUANTITY = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?)(?P<suffix>[KMGTPE]i|[mkMGTPE]?)")
SCALE = {
    "": 1,
    "m": Fraction(1, 1000),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


def quantity(value: Any) -> Fraction | None:
    """A Kubernetes quantity ("16Gi", "500M", "4", "3500m") as a number; None if it is not one."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    match = QUANTITY.fullmatch(str(value))
    return Fraction(match["number"]) * SCALE[match["suffix"]] if match else None


def size_text(size: Fraction) -> str:
    """Bytes as a quantity, in the largest binary unit that holds them whole."""
    whole = math.ceil(size)
    for suffix in ("Ti", "Gi", "Mi", "Ki"):
        if whole % SCALE[suffix] == 0:
            return f"{whole // SCALE[suffix]}{suffix}"
    return str(whole)


def cpu_text(cores: Fraction) -> str:
    return str(cores.numerator) if cores.denominator == 1 else f"{math.ceil(cores * 1000)}m"

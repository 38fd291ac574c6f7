"""The deploy group's schema: what the k8s package renders into k8s/. k8s.checks.deploy_errors()
checks its values, for this schema and for the template's hook alike."""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Dict, List, Optional

from omegaconf import MISSING

from ..k8s.checks import deploy_errors
from ..k8s.flavors import FLAVORS
from .error import ConfigError

# deploy.flavor's choices: the names of k8s.flavors.FLAVORS, whose entries say what each is. An
# Enum, so that a bad value is refused as any other choice is, naming the allowed ones.
FlavorName = Enum("FlavorName", {name: name for name in FLAVORS}, module=__name__)


class AccessMode(Enum):
    ReadWriteOnce = "ReadWriteOnce"  # one node mounts it: most default storage classes
    ReadWriteMany = "ReadWriteMany"  # every node's pod mounts it: what several nodes need


class TopologyMode(Enum):
    required = "required"  # every pod in one domain of deploy.topology, or none admitted
    preferred = "preferred"  # as few domains as the free nodes allow


class PullPolicy(Enum):
    IfNotPresent = "IfNotPresent"
    Always = "Always"
    Never = "Never"


@dataclass
class DeployConfig:
    """What the k8s package renders into k8s/: the image, where it runs, the shape of the job and
    what its pods ask of a node. k8s.checks.deploy_errors() checks the values; the hook uses
    it too."""

    name: str = MISSING
    image: str = MISSING
    image_pull_policy: PullPolicy = MISSING
    namespace: str = MISSING
    flavor: FlavorName = MISSING
    nodes: int = MISSING
    gpus_per_node: int = MISSING
    cpu_per_gpu: str = MISSING
    memory_per_gpu: str = MISSING
    ephemeral_storage: str = MISSING
    rdzv_port: int = MISSING
    shm_size: str = MISSING
    runs_storage: str = MISSING
    runs_access_mode: AccessMode = MISSING
    storage_class: Optional[str] = MISSING
    runs_claim: Optional[str] = MISSING
    backoff_limit: int = MISSING
    max_restarts: int = MISSING
    rdzv_timeout_s: int = MISSING
    ttl_after_finished_s: Optional[int] = MISSING
    active_deadline_s: Optional[int] = MISSING
    guaranteed: bool = MISSING
    tolerations: List[Dict[str, Any]] = MISSING
    lost_node_s: Optional[int] = MISSING
    # Any: a value YAML or Hydra typed (true, 1.10) is checked as written, not re-typed as str
    node_selector: Dict[str, Any] = MISSING
    affinity: Dict[str, Any] = MISSING
    one_pod_per_node: bool = MISSING
    extra_resources: Dict[str, int] = MISSING
    capabilities: List[str] = MISSING
    pod_labels: Dict[str, Any] = MISSING
    pod_annotations: Dict[str, Any] = MISSING
    image_pull_secrets: List[str] = MISSING
    env: Dict[str, Any] = MISSING
    secret_env: Dict[str, str] = MISSING
    priority_class: Optional[str] = MISSING
    queue: Optional[str] = MISSING
    queue_priority: Optional[str] = MISSING
    topology: Optional[str] = MISSING
    topology_mode: TopologyMode = MISSING

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        errors = deploy_errors(
            {
                key: value.value if isinstance(value, Enum) else value
                for key, value in values.items()
            }
        )
        if errors:
            raise ConfigError(errors[0])

"""Typed schema of every config group, and the checks that run before anything starts.

Hydra merges each YAML file and override into these dataclasses, so a wrong type or an unknown key
fails at compose time, naming the key. Checks that types cannot express live in __post_init__ and
check_devices; check.py runs them all before Hydra creates the run dir.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Dict, NoReturn, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from {{ cookiecutter.package }} import nccl


class ConfigError(ValueError):
    """A config value that is well typed but not allowed. The message names the key."""


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value}: {allowed}")


class Backend(Enum):
    auto = "auto"  # nccl when CUDA is available, else gloo
    nccl = "nccl"
    gloo = "gloo"


class NcclDebug(Enum):
    VERSION = "VERSION"
    WARN = "WARN"
    INFO = "INFO"
    TRACE = "TRACE"


@dataclass
class ModelConfig:
    hidden_dim: int = 128
    depth: int = 2

    def __post_init__(self) -> None:
        require(self.hidden_dim >= 1, "model.hidden_dim", self.hidden_dim, "must be at least 1")
        require(self.depth >= 1, "model.depth", self.depth, "must be at least 1")


@dataclass
class DataConfig:
    num_samples: int = 16384
    num_features: int = 32
    num_classes: int = 8
    batch_size: int = 128
    num_workers: int = 0
    pin_memory: bool = True
    on_device: bool = False

    def __post_init__(self) -> None:
        require(self.num_samples >= 1, "data.num_samples", self.num_samples, "must be at least 1")
        require(
            self.num_features >= 1, "data.num_features", self.num_features, "must be at least 1"
        )
        require(self.num_classes >= 2, "data.num_classes", self.num_classes, "must be at least 2")
        require(self.batch_size >= 1, "data.batch_size", self.batch_size, "must be at least 1")
        require(self.num_workers >= 0, "data.num_workers", self.num_workers, "must be 0 or more")
        require(
            not (self.on_device and self.num_workers > 0),
            "data.num_workers",
            self.num_workers,
            "must be 0 with data.on_device=true (the batches are cut on the GPU)",
        )


class Precision(Enum):
    bf16 = "bf16"  # bf16 autocast on GPU
    fp16 = "fp16"  # fp16 autocast with a grad scaler on GPU
    fp32 = "fp32"


@dataclass
class TrainerConfig:
    max_steps: int = 300
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    log_every: int = 25
    seed: int = 0
    precision: Precision = Precision.bf16
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    grad_accumulation: int = 1
    fused_optimizer: bool = True
    compile: bool = False

    def __post_init__(self) -> None:
        require(self.max_steps >= 1, "trainer.max_steps", self.max_steps, "must be at least 1")
        require(self.lr > 0, "trainer.lr", self.lr, "must be greater than 0")
        require(
            self.weight_decay >= 0, "trainer.weight_decay", self.weight_decay, "must be 0 or more"
        )
        require(self.log_every >= 1, "trainer.log_every", self.log_every, "must be at least 1")
        require(
            self.warmup_steps >= 0, "trainer.warmup_steps", self.warmup_steps, "must be 0 or more"
        )
        require(
            self.checkpoint_every >= 0,
            "trainer.checkpoint_every",
            self.checkpoint_every,
            "must be 0 (no checkpoints) or more",
        )
        require(
            self.keep_checkpoints >= 2,
            "trainer.keep_checkpoints",
            self.keep_checkpoints,
            "must be at least 2",
        )
        require(
            self.grad_accumulation >= 1,
            "trainer.grad_accumulation",
            self.grad_accumulation,
            "must be at least 1",
        )


class CommHook(Enum):
    default = "default"  # DDP's own: sum, then divide by the world size
    bf16 = "bf16"  # compress to bf16 for the all-reduce: half the bytes on the wire
    fp16 = "fp16"  # compress to fp16
    noop = "noop"  # no gradient communication at all: the bench's compute-only run


@dataclass
class DistConfig:
    backend: Backend = Backend.auto
    timeout_s: int = 180
    gate_timeout_s: int = 60
    async_error_handling: Optional[int] = 2
    bucket_cap_mb: int = 100
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    comm_hook: CommHook = CommHook.default
    time_comm: bool = True

    def __post_init__(self) -> None:
        require(self.timeout_s >= 1, "dist.timeout_s", self.timeout_s, "must be at least 1 second")
        require(
            self.gate_timeout_s >= 1,
            "dist.gate_timeout_s",
            self.gate_timeout_s,
            "must be at least 1 second",
        )
        require(
            self.async_error_handling in (None, 0, 1, 2, 3),
            "dist.async_error_handling",
            self.async_error_handling,
            "must be null, 0, 1, 2 or 3 (TORCH_NCCL_ASYNC_ERROR_HANDLING)",
        )
        require(
            self.bucket_cap_mb >= 1, "dist.bucket_cap_mb", self.bucket_cap_mb, "must be at least 1"
        )


@dataclass
class NcclConfig:
    """One field per NCCL variable (see nccl.FIELD_VARS); None leaves the variable alone."""

    auto: bool = False  # fill in transport variables from the node's facts
    p2p_disable: Optional[bool] = None
    p2p_level: Optional[str] = None
    ib_disable: Optional[bool] = None
    ib_hca: Optional[str] = None
    ib_gid_index: Optional[int] = None
    shm_disable: Optional[bool] = None
    socket_ifname: Optional[str] = None
    debug: Optional[NcclDebug] = None
    debug_subsys: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)  # any other NCCL_* variable

    def __post_init__(self) -> None:
        errors = nccl.config_errors(self)
        if errors:
            raise ConfigError(errors[0])


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class Flavor(Enum):
    job = "job"  # batch/v1 Job, and a headless Service for several nodes: no operator needed
    jobset = "jobset"  # a JobSet (jobset.x-k8s.io): restarts every node's pod together
    pytorchjob = "pytorchjob"  # a Kubeflow PyTorchJob (kubeflow.org/v1): the training operator


@dataclass
class DeployConfig:
    """What k8s.py renders into k8s/: the image, where it runs, and the shape of the job."""

    name: str = "ddp-project"
    image: str = "ddp-project:latest"
    namespace: str = "default"
    flavor: Flavor = Flavor.job
    nodes: int = 1
    gpus_per_node: int = 1
    rdzv_port: int = 29500
    shm_size: str = "16Gi"
    runs_storage: str = "50Gi"
    backoff_limit: int = 3
    max_restarts: int = 3

    def __post_init__(self) -> None:
        # The Job's pods are <name>-<index>-<suffix>; the claim is <name>-runs.
        require(
            DNS_LABEL.fullmatch(self.name) is not None and len(self.name) <= 47,
            "deploy.name", self.name, "must be a DNS label of at most 47 characters (a-z, 0-9, -)",
        )  # fmt: skip
        require(
            DNS_LABEL.fullmatch(self.namespace) is not None,
            "deploy.namespace", self.namespace, "must be a DNS label (a-z, 0-9, -)",
        )  # fmt: skip
        require(self.nodes >= 1, "deploy.nodes", self.nodes, "must be at least 1")
        require(
            1 <= self.gpus_per_node <= 16,
            "deploy.gpus_per_node", self.gpus_per_node, "must be 1 to 16",
        )  # fmt: skip
        require(
            1024 <= self.rdzv_port <= 65535,
            "deploy.rdzv_port", self.rdzv_port, "must be 1024 to 65535",
        )  # fmt: skip
        require(
            self.backoff_limit >= 0, "deploy.backoff_limit", self.backoff_limit, "must be 0 or more"
        )
        require(
            self.max_restarts >= 0, "deploy.max_restarts", self.max_restarts, "must be 0 or more"
        )


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    nccl: NcclConfig = field(default_factory=NcclConfig)
    deploy: DeployConfig = field(default_factory=DeployConfig)


def uses_cuda(backend: Backend) -> bool:
    return backend is Backend.nccl or (backend is Backend.auto and torch.cuda.is_available())


def check_devices(config: TrainConfig, local_world_size: int) -> None:
    """torchrun's --nproc-per-node must fit the GPUs this node can see."""
    if not uses_cuda(config.dist.backend):
        return
    visible = torch.cuda.device_count()
    require(visible > 0, "dist.backend", "nccl", "no CUDA device is visible; use auto or gloo")
    require(
        local_world_size <= visible,
        "--nproc-per-node",
        local_world_size,
        f"only {visible} GPU(s) visible on this node; use at most {visible} processes per node",
    )


def check_data(config: TrainConfig, world_size: int) -> None:
    """Every process needs at least one full batch of its shard, or it never takes a step."""
    per_process = config.data.num_samples // world_size
    require(
        per_process >= config.data.batch_size,
        "data.batch_size",
        config.data.batch_size,
        f"each of {world_size} process(es) gets {per_process} of data.num_samples={config.data.num_samples}; "
        f"use a batch size of at most {per_process}",
    )


def check_combinations(config: TrainConfig) -> None:
    """Values that are fine alone but not together."""
    require(
        not (config.dist.static_graph and config.trainer.grad_accumulation > 1),
        "dist.static_graph",
        "true",
        f"DDP's static graph cannot skip the gradient sync that trainer.grad_accumulation="
        f"{config.trainer.grad_accumulation} needs; set dist.static_graph=false",
    )


def to_train_config(cfg: DictConfig) -> TrainConfig:
    """The composed config as typed objects, checked; ConfigError names the bad key."""
    config: TrainConfig = OmegaConf.to_object(cfg)
    check_devices(config, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    check_data(config, int(os.environ.get("WORLD_SIZE", "1")))
    check_combinations(config)
    return config


def exit_with_error(message: str, grace_s: float = 60) -> NoReturn:
    """Every local rank finds the same error. Local rank 0 prints it, once per node; the others
    wait for that, because torchrun stops all workers as soon as the first one exits."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(grace_s)
    sys.exit(2)


def run_id() -> str:
    """Resolver: one name per launch, the same in every worker of it. torchrun's run id; under a
    static rendezvous, where that id is "none", the launcher's pid and start time (the workers'
    parent); without torchrun, the time."""
    given = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if given != "none":
        return given
    if "RANK" not in os.environ:
        return time.strftime("%Y-%m-%d_%H-%M-%S")
    launcher = os.getppid()
    try:
        started = Path(f"/proc/{launcher}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "0"
    return f"launcher-{launcher}-{started}"


def rank_zero_only(value: Any) -> Any:
    """Resolver: the value on global rank 0, None on the others (set by torchrun)."""
    return value if os.environ.get("RANK", "0") == "0" else None


def register_configs() -> None:
    """Make the schema and resolvers known to Hydra; call before Hydra composes."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    OmegaConf.register_new_resolver("rank_zero_only", rank_zero_only, replace=True)
    OmegaConf.register_new_resolver("run_id", run_id, replace=True)

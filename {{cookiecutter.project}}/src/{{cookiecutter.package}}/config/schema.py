"""Typed schema of every config group, and the checks that run before anything starts; the
model and data options' schemas are in options.py, which values may change after a checkpoint
in changeable.py.

Hydra merges each YAML file and override into these dataclasses, so a wrong type or an unknown key
fails at compose time, naming the key. Checks that types cannot express live in __post_init__, and
those of a whole config in validate.py; config.compose.ConfigCheck runs them all before Hydra
creates the run dir.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from ..core.world import rank_zero_only, run_name
from ..nccl import decision as nccl
from .changeable import EVALUATE_SETS, FREE_ON_RESUME
from .deploy import DeployConfig
from .error import ConfigError, require
from .loggers import LoggersConfig
from .options import DataConfig
from .profiling import ProfileConfig
from .registry import stored_options


class Backend(Enum):
    auto = "auto"  # nccl when CUDA is available, else gloo
    nccl = "nccl"
    gloo = "gloo"


class NcclDebug(Enum):
    VERSION = "VERSION"
    WARN = "WARN"
    INFO = "INFO"
    TRACE = "TRACE"


# Values live in configs/ (one YAML file per option, each key commented); these classes give
# their types and checks. MISSING: a value the YAML must give.


class Precision(Enum):
    bf16 = "bf16"  # bf16 autocast on GPU
    fp16 = "fp16"  # fp16 autocast with a grad scaler on GPU
    fp32 = "fp32"


class Schedule(Enum):  # the learning rate after warm-up: schedule.learning_rate
    constant = "constant"  # trainer.lr throughout
    linear = "linear"  # straight down to trainer.min_lr at trainer.max_steps
    cosine = "cosine"  # half a cosine down to trainer.min_lr at trainer.max_steps


class CheckpointFormat(Enum):
    # One file by rank 0 (torch.save): the shortest stall on one node (docs/performance.md).
    file = "file"
    dcp = "dcp"  # a folder every rank writes a share of (torch.distributed.checkpoint)


class OnNonFinite(Enum):
    stop = "stop"  # end the run with a non-zero exit; the checkpoints stay as they were
    skip = "skip"  # drop the optimizer step of such a step (checks every step: one GPU sync each)


def finite(value: float) -> bool:
    return math.isfinite(value)


@dataclass
class TrainerConfig:
    max_steps: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    lr: float = MISSING
    warmup_steps: int = MISSING
    schedule: Schedule = MISSING
    min_lr: Optional[float] = MISSING  # None: lr / 10 (schedule.floor)
    max_grad_norm: Optional[float] = MISSING
    on_nonfinite: OnNonFinite = field(default=MISSING, metadata=FREE_ON_RESUME)
    log_every: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    seed: int = MISSING
    precision: Precision = MISSING
    checkpoint_every: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    keep_checkpoints: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    async_checkpoint: bool = field(default=MISSING, metadata=FREE_ON_RESUME)
    checkpoint_format: CheckpointFormat = field(default=MISSING, metadata=FREE_ON_RESUME)
    val_every: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    val_batches: Optional[int] = field(default=MISSING, metadata=FREE_ON_RESUME)
    keep_best: bool = field(default=MISSING, metadata=FREE_ON_RESUME)
    grad_accumulation: int = MISSING
    compile: bool = MISSING
    # The EMA's decay changes the weights it keeps (and val_loss_ema), not the training: still a
    # change of results, so a resume that turns it on names it in trainer.accept_changes.
    ema_decay: Optional[float] = MISSING  # None: no EMA
    # How long the run goes, as max_steps does: a resume may change it, and counts on.
    patience: Optional[int] = field(default=MISSING, metadata=FREE_ON_RESUME)  # None: off
    accept_changes: List[str] = field(default=MISSING, metadata=FREE_ON_RESUME)

    def __post_init__(self) -> None:
        require(self.max_steps >= 1, "trainer.max_steps", self.max_steps, "must be at least 1")
        require(
            finite(self.lr) and self.lr > 0,
            "trainer.lr",
            self.lr,
            "must be a finite number above 0",
        )
        require(
            self.min_lr is None or (finite(self.min_lr) and 0 <= self.min_lr <= self.lr),
            "trainer.min_lr",
            self.min_lr,
            f"must be null (trainer.lr/10) or a finite number from 0 to trainer.lr={self.lr}",
        )
        require(
            self.max_grad_norm is None or (finite(self.max_grad_norm) and self.max_grad_norm > 0),
            "trainer.max_grad_norm",
            self.max_grad_norm,
            "must be null (no clipping) or a finite number above 0",
        )
        require(self.log_every >= 1, "trainer.log_every", self.log_every, "must be at least 1")
        require(
            0 <= self.seed < 2**63,
            "trainer.seed",
            self.seed,
            "must be 0 to 2**63-1 (torch's range)",
        )
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
            self.val_every >= 0,
            "trainer.val_every",
            self.val_every,
            "must be 0 (no validation) or more",
        )
        require(
            self.val_batches is None or self.val_batches >= 1,
            "trainer.val_batches",
            self.val_batches,
            "must be null (every held-out batch) or at least 1",
        )
        require(
            self.grad_accumulation >= 1,
            "trainer.grad_accumulation",
            self.grad_accumulation,
            "must be at least 1",
        )
        require(
            self.ema_decay is None or (finite(self.ema_decay) and 0 < self.ema_decay < 1),
            "trainer.ema_decay",
            self.ema_decay,
            "must be null (no EMA) or a number between 0 and 1, e.g. 0.999",
        )
        require(
            self.patience is None or self.patience >= 1,
            "trainer.patience",
            self.patience,
            "must be null (no early stopping) or at least 1",
        )
        require(
            self.patience is None or self.val_every > 0,
            "trainer.patience",
            self.patience,
            "counts validations without a new best val_loss: set trainer.val_every above 0, "
            "or trainer.patience=null",
        )


@dataclass
class OptimizerConfig:
    """configs/optimizer/: any torch.optim optimizer by _target_, in two parameter groups: the
    tensors of 2 or more dimensions decay, the rest (biases, norms' gains) do not. Null keys are
    the class's own defaults; what the class takes and accepts is checked in config/optimizer.py."""

    _target_: str = MISSING  # a torch.optim.Optimizer subclass by import path
    weight_decay: float = MISSING  # of the decayed group
    betas: Optional[List[float]] = MISSING
    eps: Optional[float] = MISSING
    fused: bool = MISSING  # one kernel on CUDA, where the class has one
    kwargs: Dict[str, Any] = field(default_factory=dict)  # its other keywords (momentum, ...)

    def __post_init__(self) -> None:
        require(
            finite(self.weight_decay) and self.weight_decay >= 0,
            "optimizer.weight_decay",
            self.weight_decay,
            "must be a finite number, 0 or more",
        )
        require(
            self.betas is None
            or (len(self.betas) == 2 and all(finite(b) and 0 <= b < 1 for b in self.betas)),
            "optimizer.betas",
            self.betas,
            "must be null (the optimizer's default) or two numbers in [0, 1), e.g. [0.9, 0.95]",
        )
        require(
            self.eps is None or (finite(self.eps) and self.eps > 0),
            "optimizer.eps",
            self.eps,
            "must be null (the optimizer's default) or a finite number above 0",
        )


MAX_TIMEOUT_S = 7 * 24 * 3600


class Strategy(Enum):
    ddp = "ddp"  # a whole replica per process; gradients all-reduced
    fsdp2 = "fsdp2"  # parameters, gradients and optimizer state sharded (fully_shard)


class CommHook(Enum):
    default = "default"  # DDP's own: sum, then divide by the world size
    bf16 = "bf16"  # compress to bf16 for the all-reduce: half the bytes on the wire
    fp16 = "fp16"  # compress to fp16


@dataclass
class DistConfig:
    backend: Backend = field(default=MISSING, metadata=FREE_ON_RESUME | EVALUATE_SETS)
    timeout_s: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    gate_timeout_s: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    checkpoint_timeout_s: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    async_error_handling: Optional[int] = field(default=MISSING, metadata=FREE_ON_RESUME)
    bucket_cap_mb: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    gradient_as_bucket_view: bool = field(default=MISSING, metadata=FREE_ON_RESUME)
    static_graph: bool = field(default=MISSING, metadata=FREE_ON_RESUME)
    comm_hook: CommHook = MISSING
    strategy: Strategy = field(default=MISSING, metadata=FREE_ON_RESUME)  # DCP reshards
    activation_checkpointing: bool = field(default=MISSING, metadata=FREE_ON_RESUME)
    time_comm: bool = field(default=MISSING, metadata=FREE_ON_RESUME)

    def __post_init__(self) -> None:
        for key in ("timeout_s", "gate_timeout_s", "checkpoint_timeout_s"):
            seconds = getattr(self, key)
            require(
                1 <= seconds <= MAX_TIMEOUT_S,
                f"dist.{key}",
                seconds,
                f"must be 1 to {MAX_TIMEOUT_S} seconds (a week)",
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
    """One field per NCCL variable (see nccl.FIELD_VARS); None leaves the variable alone, so a
    profile in configs/nccl/ lists only what it sets, and its own name (profile)."""

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
    # Any other NCCL_*, TORCH_NCCL_* or GLOO_* variable: nccl.env.NCCL_ALGO=Ring,
    # nccl.env.GLOO_SOCKET_IFNAME=eth0 (null: leave it unset)
    env: Dict[str, Optional[str]] = field(default_factory=dict)
    profile: Optional[str] = None  # the profile's name: each configs/nccl/<name>.yaml sets its own

    def __post_init__(self) -> None:
        errors = nccl.config_errors(self)
        if errors:
            raise ConfigError(errors[0])


@dataclass
class TrainConfig:
    model: Any = MISSING  # the model option's schema (registry), which its YAML brings
    data: Any = MISSING  # the data option's, likewise
    # each option of the logger group sets one of its keys
    logger: LoggersConfig = field(default=MISSING, metadata=FREE_ON_RESUME)
    trainer: TrainerConfig = MISSING
    optimizer: OptimizerConfig = MISSING
    dist: DistConfig = MISSING
    nccl: NcclConfig = field(default=MISSING, metadata=FREE_ON_RESUME)
    deploy: DeployConfig = field(default=MISSING, metadata=FREE_ON_RESUME)
    profile: ProfileConfig = field(default=MISSING, metadata=FREE_ON_RESUME)


# the groups with one schema each
SCHEMAS = {"trainer": TrainerConfig, "optimizer": OptimizerConfig, "dist": DistConfig}


def marked_keys(mark: dict[str, bool]) -> tuple[str, ...]:
    """The keys whose schema field carries `mark`, in schema order; a marked group as "group."
    (every key under it). The data group's keys are DataConfig's, which every data option has."""
    (name,) = mark
    keys: list[str] = []
    for group in fields(TrainConfig):
        if group.metadata.get(name):
            keys.append(f"{group.name}.")
            continue
        schema = {"data": DataConfig}.get(group.name, SCHEMAS.get(group.name))
        if schema:
            keys += [f"{group.name}.{f.name}" for f in fields(schema) if f.metadata.get(name)]
    return tuple(keys)


def uses_cuda(backend: Backend) -> bool:
    import torch  # here, so that rendering k8s/ needs no torch

    return backend is Backend.nccl or (backend is Backend.auto and torch.cuda.is_available())


def register_configs() -> None:
    """Make the schemas and resolvers known to Hydra; call before Hydra composes."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    # Groups whose options differ in shape: each option's YAML names its schema in `defaults`,
    # from the root (`- /mlp_schema`). Stored in the group, a schema would be one of its options:
    # listed by --help, tab completion and every "allowed:", and model=mlp_schema accepted.
    for stored in stored_options():
        store.store(name=stored.stored_as, node=stored.schema)
    OmegaConf.register_new_resolver("rank_zero_only", rank_zero_only, replace=True)
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)

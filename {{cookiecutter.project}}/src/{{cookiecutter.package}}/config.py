"""Typed schema of every config group, and the checks that run before anything starts.

Hydra merges each YAML file and override into these dataclasses, so a wrong type or an unknown key
fails at compose time, naming the key. Checks that types cannot express live in __post_init__ and
check_*; check.ConfigCheck runs them all before Hydra creates the run dir.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import hashlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field, fields, make_dataclass
from enum import Enum
from importlib.resources import files
from pathlib import Path
from typing import Any, Dict, List, NoReturn, Optional
from urllib.parse import urlsplit

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from . import nccl
from .exits import Exit
from .k8s.checks import deploy_errors
from .registry import option, option_of, options, stored_options
from .world import World


class ConfigError(ValueError):
    """A config value that is well typed but not allowed. The message names the key."""

    exit = Exit.CONFIG_ERROR


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


# Values live in configs/ (one YAML file per option, each key commented); these classes give
# their types and checks. MISSING: a value the YAML must give.


# Marks on schema fields (their metadata) that rundir and evaluate read through marked_keys().
# FREE_ON_RESUME: how a run goes, not what it computes, so a resume may change it.
# EVALUATE_SETS: evaluate may set it; the checkpoint's config decides the rest.
FREE_ON_RESUME = {"free_on_resume": True}
EVALUATE_SETS = {"evaluate_sets": True}


@dataclass
class DataConfig:
    """What every data option has: how many samples, and how they reach the GPU."""

    num_samples: int = MISSING
    batch_size: int = field(default=MISSING, metadata=EVALUATE_SETS)
    num_workers: int = field(default=MISSING, metadata=FREE_ON_RESUME | EVALUATE_SETS)
    pin_memory: bool = field(default=MISSING, metadata=FREE_ON_RESUME | EVALUATE_SETS)
    on_device: bool = field(default=MISSING, metadata=FREE_ON_RESUME)

    def __post_init__(self) -> None:
        require(self.num_samples >= 1, "data.num_samples", self.num_samples, "must be at least 1")
        require(self.batch_size >= 1, "data.batch_size", self.batch_size, "must be at least 1")
        require(
            0 <= self.num_workers <= 64, "data.num_workers", self.num_workers, "must be 0 to 64"
        )
        require(
            not (self.on_device and self.num_workers > 0),
            "data.num_workers",
            self.num_workers,
            "must be 0 with data.on_device=true (the batches are cut on the GPU)",
        )

    def training_samples(self) -> tuple[int, str]:
        """Samples training draws from, and the key that says how many."""
        return self.num_samples, f"data.num_samples={self.num_samples}"

    def held_out_samples(self) -> tuple[int, str]:
        """Samples evaluation reads (data.build_dataset(held_out=True)), and the key that says
        how many."""
        return self.num_samples // HELD_OUT, f"data.num_samples={self.num_samples}"


@option("data", "synthetic", "labelled points", stored_as="points_schema")
@dataclass
class PointsConfig(DataConfig):
    """configs/data/synthetic.yaml: labelled points from a fixed random teacher."""

    num_features: int = MISSING
    num_classes: int = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.num_features >= 1, "data.num_features", self.num_features, "must be at least 1"
        )
        require(self.num_classes >= 2, "data.num_classes", self.num_classes, "must be at least 2")


@option("data", "tokens", "token sequences", stored_as="tokens_schema")
@dataclass
class TokensConfig(DataConfig):
    """configs/data/tokens.yaml: token sequences for next-token prediction."""

    seq_len: int = MISSING
    vocab_size: int = MISSING
    path: Optional[str] = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.seq_len >= 1, "data.seq_len", self.seq_len, "must be at least 1")
        require(self.vocab_size >= 2, "data.vocab_size", self.vocab_size, "must be at least 2")
        if self.path is not None:
            problem = token_file_problem(self)
            if problem:
                raise ConfigError(f"data.path={self.path}: {problem}")

    def training_samples(self) -> tuple[int, str]:
        if self.path is None:
            return super().training_samples()
        sequences = file_sequences(self)
        return sequences - max(1, sequences // HELD_OUT), f"data.path={self.path}"

    def held_out_samples(self) -> tuple[int, str]:
        if self.path is None:
            return super().held_out_samples()
        return max(1, file_sequences(self) // HELD_OUT), f"data.path={self.path}"


@option("model", "mlp", "an MLP", stored_as="mlp_schema", reads=PointsConfig)
@dataclass
class MlpConfig:
    """configs/model/mlp.yaml: an MLP classifier over data=synthetic's points."""

    hidden_dim: int = MISSING
    depth: int = MISSING

    def __post_init__(self) -> None:
        require(self.hidden_dim >= 1, "model.hidden_dim", self.hidden_dim, "must be at least 1")
        require(self.depth >= 1, "model.depth", self.depth, "must be at least 1")


@option("model", "gpt", "a GPT", stored_as="gpt_schema", reads=TokensConfig)
@dataclass
class GptConfig:
    """configs/model/gpt.yaml: a decoder-only transformer over data=tokens."""

    n_layer: int = MISSING
    n_head: int = MISSING
    d_model: int = MISSING

    def __post_init__(self) -> None:
        require(self.n_layer >= 1, "model.n_layer", self.n_layer, "must be at least 1")
        require(self.n_head >= 1, "model.n_head", self.n_head, "must be at least 1")
        require(
            self.d_model >= 1 and self.d_model % self.n_head == 0,
            "model.d_model", self.d_model, f"must be a positive multiple of model.n_head={self.n_head}",
        )  # fmt: skip


HELD_OUT = 10  # one part in this many is held out for evaluation
TOKEN_BYTES = 2  # a token file holds uint16 ids, as nanoGPT writes them (data.TOKEN_DTYPE)
CHUNK_TOKENS = 2**24  # read 32 MiB of a token file at a time: any size scans in bounded memory
SCANNED_VAR = "DDP_TOKEN_FILE_SCAN"  # a scan's result, for the processes this one starts


def token_file_problem(data: TokensConfig) -> str | None:
    """Why data.path is no token file for this config, or None. Checked when the config is, so
    that a bad file is one line before any process starts, not an error at the first batch."""
    make = f"make one with python -m {__package__}.data TEXT OUT"
    if not data.path:
        return "an empty path; give a token file, or null for synthetic tokens"
    path = Path(data.path)
    try:
        size = path.stat().st_size
        if path.is_dir():
            return f"a directory, not a token file; {make}"
        if not path.is_file():  # a FIFO or a device: opening one may wait forever
            return f"not a regular file; {make}"
        with path.open("rb"):
            pass
    except FileNotFoundError:
        return f"no such file here ({Path.cwd()}); {make}"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if size % TOKEN_BYTES:
        return f"holds {size} bytes, an odd count: not a file of 2-byte (uint16) tokens; {make}"
    sequences = file_sequences(data)
    if sequences < 2:
        return (
            f"holds {sequences} sequence(s) of data.seq_len={data.seq_len} tokens "
            f"({size // TOKEN_BYTES} tokens); need at least 2"
        )
    top, at = largest_token(path)
    if top >= data.vocab_size:
        return (
            f"holds token id {top} (token {at} of the file), not below data.vocab_size="
            f"{data.vocab_size}; raise data.vocab_size to {top + 1}, or check that the file "
            f"holds uint16 tokens ({make})"
        )
    return None


def largest_token(path: Path) -> tuple[int, int]:
    """The largest id in a token file and where it is, read a chunk at a time. The result is
    kept in the environment, keyed by the file's identity: the launcher reads the file once, and
    the workers it starts (heirs of its environment) do not read it again."""
    import numpy as np  # here, so that rendering k8s/ needs no numpy

    stat = path.stat()
    file = f"{path.resolve()}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}"
    try:
        known = json.loads(os.environ.get(SCANNED_VAR, "{}"))
        if known.get("file") == file:
            return int(known["max"]), int(known["at"])
    except (ValueError, KeyError, TypeError, AttributeError):
        pass  # not ours, or garbled: read the file
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    top, at = -1, 0
    for start in range(0, len(tokens), CHUNK_TOKENS):
        chunk = tokens[start : start + CHUNK_TOKENS]
        index = int(chunk.argmax())
        if int(chunk[index]) > top:
            top, at = int(chunk[index]), start + index
    del tokens
    os.environ[SCANNED_VAR] = json.dumps({"file": file, "max": top, "at": at})
    return top, at


def file_sequences(data: TokensConfig) -> int:
    """How many sequences of seq_len + 1 tokens (consecutive ones share a token) the file holds."""
    tokens = Path(data.path).stat().st_size // TOKEN_BYTES
    return max(0, tokens - 1) // data.seq_len


@option("logger", "tensorboard")
@dataclass
class TensorBoardConfig:
    """configs/logger/tensorboard.yaml: event files in <run dir>/tensorboard."""


@option("logger", "csv")
@dataclass
class CsvLoggerConfig:
    """configs/logger/csv.yaml: metrics.csv and metrics.jsonl alone."""


class WandbMode(Enum):
    offline = "offline"  # written to <run dir>/wandb; `wandb sync` uploads it later
    online = "online"
    disabled = "disabled"


@option("logger", "wandb", package=("wandb", "wandb"))
@dataclass
class WandbConfig:
    """configs/logger/wandb.yaml: Weights & Biases (pip install '.[wandb]')."""

    project: Optional[str] = MISSING
    entity: Optional[str] = MISSING
    mode: WandbMode = MISSING
    tags: List[str] = MISSING

    def __post_init__(self) -> None:
        # W&B's own limits (wandb_settings), which it reports only once the run starts.
        project = self.project
        require(
            project is None or (len(project.strip()) > 0 and len(project) <= 128 and not set(project) & set("/\\#?%:")),
            "logger.wandb.project", repr(project),
            "must be null (this project's name) or a name of 1 to 128 characters without / \\ # ? % :",
        )  # fmt: skip
        require(
            self.entity is None or self.entity.strip() != "", "logger.wandb.entity", repr(self.entity),
            "must be null (your default entity) or a name that is not blank",
        )  # fmt: skip
        require(
            all(0 < len(tag) <= 64 for tag in self.tags), "logger.wandb.tags", self.tags,
            "each tag must be 1 to 64 characters",
        )  # fmt: skip


# The tracking URIs MLflow-skinny can use without a database driver: a server, or a folder.
MLFLOW_SCHEMES = ("http", "https", "file")


@option("logger", "mlflow", package=("mlflow", "mlflow"))
@dataclass
class MlflowLoggerConfig:
    """configs/logger/mlflow.yaml: MLflow (pip install '.[mlflow]')."""

    tracking_uri: Optional[str] = MISSING
    experiment: Optional[str] = MISSING

    def __post_init__(self) -> None:
        if self.tracking_uri is not None:
            problem = mlflow_uri_problem(self.tracking_uri)
            if problem:
                raise ConfigError(f"logger.mlflow.tracking_uri={self.tracking_uri}: {problem}")
        require(
            self.experiment is None or self.experiment.strip() != "",
            "logger.mlflow.experiment", repr(self.experiment),
            "must be null (this project's name) or a name that is not blank",
        )  # fmt: skip


def mlflow_uri_problem(uri: str) -> str | None:
    """Why MLflow could not use this tracking URI, or None."""
    parts = urlsplit(uri)
    if uri == "databricks" or parts.scheme == "databricks":  # a Databricks CLI profile
        return None
    allowed = (
        "use http(s)://host:port for a server, file:/absolute/path for a folder, "
        "or null for a file store in the run dir"
    )
    if parts.scheme not in MLFLOW_SCHEMES:
        return f"{parts.scheme or 'no'} scheme; {allowed}"
    if parts.scheme == "file":
        return None if parts.path.startswith("/") else f"not an absolute path; {allowed}"
    try:
        port = parts.port
    except ValueError as err:  # not a number, or out of range
        return f"{err}; {allowed}"
    if not parts.hostname or port == 0:
        return f"no host and port to reach; {allowed}"
    return None


def chosen_loggers(self: Any) -> list[str]:
    """LoggersConfig.chosen(): the loggers a config uses, in the order they registered."""
    return [f.name for f in fields(self) if getattr(self, f.name) is not None]


# configs/logger/*.yaml: each logger option sets its own key, so that several combine:
# logger=[tensorboard,wandb]; a key left null is a logger not used. A key for each logger option
# registered above, in that order.
LoggersConfig = make_dataclass(
    "LoggersConfig",
    [(o.name, Optional[o.schema], field(default=None)) for o in options("logger")],
    namespace={"chosen": chosen_loggers, "__module__": __name__},
)


class Precision(Enum):
    bf16 = "bf16"  # bf16 autocast on GPU
    fp16 = "fp16"  # fp16 autocast with a grad scaler on GPU
    fp32 = "fp32"


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
    weight_decay: float = MISSING
    max_grad_norm: Optional[float] = MISSING
    on_nonfinite: OnNonFinite = field(default=MISSING, metadata=FREE_ON_RESUME)
    log_every: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    seed: int = MISSING
    precision: Precision = MISSING
    checkpoint_every: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    keep_checkpoints: int = field(default=MISSING, metadata=FREE_ON_RESUME)
    grad_accumulation: int = MISSING
    fused_optimizer: bool = MISSING
    compile: bool = MISSING
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
            finite(self.weight_decay) and self.weight_decay >= 0,
            "trainer.weight_decay", self.weight_decay, "must be a finite number, 0 or more",
        )  # fmt: skip
        require(
            self.max_grad_norm is None or (finite(self.max_grad_norm) and self.max_grad_norm > 0),
            "trainer.max_grad_norm", self.max_grad_norm, "must be null (no clipping) or a finite number above 0",
        )  # fmt: skip
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
            self.grad_accumulation >= 1,
            "trainer.grad_accumulation",
            self.grad_accumulation,
            "must be at least 1",
        )


MAX_TIMEOUT_S = 7 * 24 * 3600


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
    time_comm: bool = field(default=MISSING, metadata=FREE_ON_RESUME)

    def __post_init__(self) -> None:
        for key in ("timeout_s", "gate_timeout_s", "checkpoint_timeout_s"):
            seconds = getattr(self, key)
            require(
                1 <= seconds <= MAX_TIMEOUT_S, f"dist.{key}", seconds,
                f"must be 1 to {MAX_TIMEOUT_S} seconds (a week)",
            )  # fmt: skip
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
    # Any other NCCL_*, TORCH_NCCL_* or GLOO_* variable: nccl.env.NCCL_ALGO=Ring, nccl.env.GLOO_SOCKET_IFNAME=eth0 (null: leave it unset)
    env: Dict[str, Optional[str]] = field(default_factory=dict)
    profile: Optional[str] = None  # the profile's name: each configs/nccl/<name>.yaml sets its own

    def __post_init__(self) -> None:
        errors = nccl.config_errors(self)
        if errors:
            raise ConfigError(errors[0])


class Flavor(Enum):
    job = "job"  # batch/v1 Job, and a headless Service for several nodes: no operator needed
    jobset = "jobset"  # a JobSet (jobset.x-k8s.io): restarts every node's pod together
    pytorchjob = "pytorchjob"  # a Kubeflow PyTorchJob (kubeflow.org/v1): the training operator
    trainjob = "trainjob"  # a Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1)


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
    what its pods ask of a node. k8s.checks.deploy_errors() checks the values; the hook uses it too."""

    name: str = MISSING
    image: str = MISSING
    image_pull_policy: PullPolicy = MISSING
    namespace: str = MISSING
    flavor: Flavor = MISSING
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
    node_selector: Dict[str, str] = MISSING
    affinity: Dict[str, Any] = MISSING
    one_pod_per_node: bool = MISSING
    extra_resources: Dict[str, int] = MISSING
    capabilities: List[str] = MISSING
    pod_labels: Dict[str, str] = MISSING
    pod_annotations: Dict[str, str] = MISSING
    image_pull_secrets: List[str] = MISSING
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


@dataclass
class TrainConfig:
    model: Any = MISSING  # the model option's schema (registry), which its YAML brings
    data: Any = MISSING  # the data option's, likewise
    # each option of the logger group sets one of its keys
    logger: LoggersConfig = field(default=MISSING, metadata=FREE_ON_RESUME)
    trainer: TrainerConfig = MISSING
    dist: DistConfig = MISSING
    nccl: NcclConfig = field(default=MISSING, metadata=FREE_ON_RESUME)
    deploy: DeployConfig = field(default=MISSING, metadata=FREE_ON_RESUME)


SCHEMAS = {"trainer": TrainerConfig, "dist": DistConfig}  # the groups with one schema each


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


def check_devices(config: TrainConfig, world: World) -> None:
    """torchrun's --nproc-per-node must fit the GPUs this node can see."""
    import torch

    if not uses_cuda(config.dist.backend):
        return
    visible = torch.cuda.device_count()
    require(visible > 0, "dist.backend", "nccl", "no CUDA device is visible; use auto or gloo")
    require(
        world.local_size <= visible,
        "--nproc-per-node",
        world.local_size,
        f"only {visible} GPU(s) visible on this node; use at most {visible} processes per node",
    )


def check_data(config: TrainConfig, world: World, held_out: bool = False) -> None:
    """Training: every process needs at least one full batch of its shard, or it never takes a
    step. Evaluation (held_out): every process needs a held-out sample; its last batch may be
    short, so any batch size does."""
    if held_out:
        samples, source = config.data.held_out_samples()
        if samples < world.size:
            fewer = f"on at most {samples} process(es), or " if samples else ""
            raise ConfigError(
                f"{source}: {samples} held-out sample(s) (one in {HELD_OUT}) for {world.size} "
                f"process(es), which need one each; evaluate {fewer}with more data"
            )
        return
    samples, source = config.data.training_samples()
    per_process = samples // world.size
    require(
        per_process >= config.data.batch_size,
        "data.batch_size",
        config.data.batch_size,
        f"each of {world.size} process(es) gets {per_process} of the {samples} training samples of "
        f"{source}; use a batch size of at most {per_process}",
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
    model = option_of(type(config.model))
    if model.reads is not None and not isinstance(config.data, model.reads):
        data = option_of(model.reads)
        raise ConfigError(f"model: {model.what} reads {data.what}; use data={data.name}")


def check_keys(node: DictConfig, prefix: str = "") -> None:
    """Hydra's `+key=value` adds a key even to a typed node; a key outside the schema is a typo
    that would otherwise be ignored. (nccl.env is a dict: its keys are nccl.config_errors'.)"""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    allowed = [f.name for f in dataclasses.fields(schema)]
    for key in node:
        if key not in allowed:
            raise ConfigError(f"{prefix}{key}: no such key; allowed: {', '.join(allowed)}")
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            check_keys(child, f"{prefix}{key}.")


def check_composed(
    cfg: DictConfig, world: World | None = None, this_node: bool = True, held_out: bool = False
) -> TrainConfig:
    """A config already composed (by Hydra for a run, by check.compose_and_check, from a
    checkpoint) as typed objects, checked; ConfigError names the bad key. The `hydra` node of a
    run's config is not ours: it is left out, and only says which NCCL profile was chosen.
    this_node=False skips what only this machine's GPUs decide (rendering k8s/ for a cluster);
    held_out=True checks the data for evaluation rather than training (check_data)."""
    world = world or World.from_env()
    chosen = OmegaConf.select(cfg, "hydra.runtime.choices.nccl")
    if "hydra" in cfg:
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            cfg.pop("hydra")
    check_keys(cfg)
    config: TrainConfig = OmegaConf.to_object(cfg)
    if chosen is not None:
        check_profile_name(config.nccl, chosen)
    if this_node:
        check_devices(config, world)
    check_data(config, world, held_out)
    check_combinations(config)
    check_accept_changes(config)
    return config


def check_profile_name(profile: NcclConfig, chosen: str) -> None:
    """nccl.profile names the profile in force, in logs, failure reports and the bench's figures:
    it must be the one that nccl=<name> chose."""
    require(
        profile.profile == chosen, "nccl.profile", profile.profile,
        f"must be {chosen}, the name of the profile nccl={chosen} chose; keep `profile: {chosen}` "
        f"in configs/nccl/{chosen}.yaml, and choose a profile with nccl=<name>",
    )  # fmt: skip


def config_keys(node: Any, prefix: str = "") -> set[str]:
    """Every group and leaf of a config, dotted: model, model.hidden_dim, ..."""
    if dataclasses.is_dataclass(node):
        children = {f.name: getattr(node, f.name, None) for f in fields(node)}
    elif isinstance(node, dict):
        children = node
    else:
        return set()
    keys = set()
    for name, child in children.items():
        keys |= {f"{prefix}{name}"} | config_keys(child, f"{prefix}{name}.")
    return keys


def check_accept_changes(config: TrainConfig) -> None:
    """trainer.accept_changes names keys a resume may change: each must be a group or a key of
    this config, or of another option of its groups (a resume that switches model=...)."""
    known = config_keys(config) | {
        f"{o.group}.{f.name}" for o in stored_options() for f in fields(o.schema)
    }
    for entry in config.trainer.accept_changes:
        if entry not in known:
            close = difflib.get_close_matches(entry, sorted(known), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"trainer.accept_changes: {entry or repr(entry)} is no key of the config; {hint}"
                "allowed: a group "
                f"({', '.join(f.name for f in fields(TrainConfig))}) or a key in one, e.g. trainer.lr"
            )


def from_saved(saved: dict[str, Any], overrides: list[str], held_out: bool = False) -> TrainConfig:
    """A checkpoint's config (the plain dict it holds) typed and checked again, with dotted
    key=value overrides on top; held_out=True checks its data for evaluation (check_data)."""
    parts: dict[str, Any] = {}
    for group, values in saved.items():
        schemas = [o.schema for o in stored_options() if o.group == group]
        if not schemas:
            parts[group] = values
            continue
        keys = set(values)
        schema = next((s for s in schemas if {f.name for f in dataclasses.fields(s)} == keys), None)
        if schema is None:
            raise ConfigError(
                f"{group}: the checkpoint's keys ({', '.join(sorted(keys))}) fit no {group} schema"
            )
        parts[group] = OmegaConf.merge(OmegaConf.structured(schema), values)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), parts)
        cfg.merge_with_dotlist(overrides)
    except OmegaConfBaseException as err:
        raise ConfigError(" ".join(str(err).split())) from None
    return check_composed(cfg, held_out=held_out)


# What NCCL reads as comma lists (NCCL_DEBUG_SUBSYS=INIT,NET, NCCL_IB_HCA=mlx5_0,mlx5_1, and
# many nccl.env variables: NCCL_ALGO=Ring,Tree) Hydra reads as a sweep, and a value that starts
# with NCCL's ^ (exclude) or = (exact match) it cannot read at all, unless quoted.
NCCL_TEXT_KEY = re.compile(
    r"(\+?\+?)(nccl\.(?:" + "|".join(nccl.TEXT_FIELDS) + r"|env\.[^=]*))=(.*)", re.DOTALL
)
# The deploy group's maps: their keys are the user's, so an override may add one.
MAP_KEY = re.compile(
    r"\+{0,2}deploy\.(node_selector|affinity|extra_resources|pod_labels|pod_annotations)[.=]"
)
SWEEP_FUNCTION = re.compile(r"\w+\(.*\)", re.DOTALL)  # choice(a,b), range(...), glob(...)


def nccl_text(value: str) -> str:
    """A value for a NCCL text key, quoted so that Hydra reads it as one string; a list
    [a,b] becomes the comma list 'a,b'. Quoted values, null, interpolations and sweep functions
    stay as they are."""
    as_given = value in ("", "null") or value[0] in "'\"" or "${" in value
    if as_given or SWEEP_FUNCTION.fullmatch(value):
        return value
    if value.startswith("[") and value.endswith("]"):
        value = ",".join(item.strip().strip("'\"") for item in value[1:-1].split(","))
    quote = "'" if "'" not in value else '"'
    return value if quote in value else f"{quote}{value}{quote}"


def hydra_overrides(overrides: list[str]) -> list[str]:
    """Overrides as Hydra must read them to mean what NCCL's syntax says, as the README and the
    remedies write them:
      nccl.debug_subsys=INIT,NET (or [INIT,NET])  ->  nccl.debug_subsys='INIT,NET'
      nccl.env.NCCL_ALGO=Ring                      ->  ++nccl.env.NCCL_ALGO='Ring'  (adds the key)
      nccl.env={NCCL_ALGO:Ring}                    ->  ++nccl.env={NCCL_ALGO:Ring}
      deploy.node_selector={pool:gpu}              ->  ++deploy.node_selector={pool:gpu}  (any deploy map)
    Under -m too: a bare comma list is NCCL's list, never a sweep; sweep with choice(Ring,Tree).
    Other arguments pass as given, and a rewritten override rewritten again stays the same."""
    rewritten = []
    for override in overrides:
        match = NCCL_TEXT_KEY.fullmatch(override)
        if match:
            plus, key, value = match.groups()
            plus = "++" if key.startswith("nccl.env.") else plus
            override = f"{plus}{key}={nccl_text(value)}"
        elif override.startswith("nccl.env="):  # a whole map, nccl.env={NCCL_ALGO:Ring}
            override = f"++{override}"
        elif MAP_KEY.match(override):  # deploy.node_selector={pool:gpu}, deploy.pod_labels.team=a
            override = f"++{override.lstrip('+')}"
        rewritten.append(override)
    return rewritten


def configs_folder() -> Path:
    """The configs/ that Hydra reads (pkg://<package>.configs): beside this module when
    installed, the project's configs/ in an editable install."""
    return Path(str(files(f"{__package__}.configs")))


GLOBAL_GROUPS = ("experiment", "local")  # their files set keys anywhere: # @package _global_
# Hydra reads `# @key value` lines up to the first other line, blank ones aside.
GLOBAL_HEADER = re.compile(r"(\s*#\s*@[^\n]*\n|\s*\n)*\s*#\s*@package\s+_global_\s*(\n|$)")


def yaml_problem(folder: Path) -> str | None:
    """The first file under `folder` that Hydra could not use, as one line naming the file, the
    line and the problem; None when all can be used. (Hydra's own report is a parser traceback of
    some 70 lines, or a key error about a group.)"""
    for path in sorted(folder.rglob("*.yaml")):
        shown = os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else str(path)
        problem = yaml_file_problem(path, path.relative_to(folder).parts[0])
        if problem:
            return f"{shown}{problem}"
    return None


@functools.cache
def hydras_yaml_loaders() -> tuple[type, type]:
    """(fast, exact): Hydra's YAML loader (OmegaConf's: a duplicate key is an error, 1e3 is a
    float), and the same on libyaml's parser where PyYAML has it. Every launch and check reads
    all of configs/ first: 6 ms that way, 48 in pure Python. What the fast one refuses is read
    again by the exact one, Hydra's own, whose verdict and messages stand."""
    import yaml
    from omegaconf._utils import get_yaml_loader

    exact = get_yaml_loader()
    if not yaml.__with_libyaml__:
        return exact, exact

    class Fast(yaml.cyaml.CParser, exact):
        def __init__(self, stream: str) -> None:
            yaml.cyaml.CParser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)

    return Fast, exact


def yaml_file_problem(path: Path, group: str) -> str | None:
    """What yaml_problem says of one file, after its name; None if Hydra can use it."""
    import yaml

    fast, exact = hydras_yaml_loaders()
    try:
        text = path.read_text(encoding="utf-8")
        try:
            loaded = yaml.load(text, Loader=fast)
        except yaml.YAMLError:
            loaded = yaml.load(text, Loader=exact)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(err.problem or err.context or "").split())
        if "'\\t'" in problem:
            problem += " (indent YAML with spaces)"
        elif err.context and err.problem:
            opened = err.context_mark
            since = f" from line {opened.line + 1}" if opened and opened is not mark else ""
            problem += f" ({err.context}{since})"
        return f"{where}: not YAML: {problem}"
    except yaml.YAMLError as err:
        return f": not YAML: {' '.join(str(err).split())}"
    except UnicodeDecodeError as err:
        return f": not UTF-8 text (byte {err.start}): not a YAML file"
    except OSError as err:
        return f": cannot be read ({err.strerror or err})"
    if loaded is not None and not isinstance(loaded, dict):
        return f": holds a {type(loaded).__name__}; a config file holds keys and values"
    if group in GLOBAL_GROUPS and not GLOBAL_HEADER.match(text):
        return (
            f": needs `# @package _global_` as its first line (as configs/experiment/smoke.yaml "
            f"has it): Hydra reads it there only, and without it puts the keys under `{group}`"
        )
    return None


def hydra_argv(argv: list[str]) -> list[str]:
    """train's command line before Hydra reads it: a configs/ file that is not YAML stops it in
    one line, and the overrides are rewritten as hydra_overrides says."""
    problem = yaml_problem(configs_folder())
    if problem:
        exit_with_error(f"config error: {problem}")
    return hydra_overrides(argv)


def exit_with_error(message: str, grace_s: float = 60) -> NoReturn:
    """Every local rank finds the same error. Local rank 0 prints it, once per node; the others
    wait for that, because torchrun stops all workers as soon as the first one exits."""
    if World.from_env().local_rank == 0:
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(grace_s)
    sys.exit(Exit.CONFIG_ERROR)


RUN_NAME_VAR = "DDP_RUN_NAME"  # the launcher names the run for its workers


def run_name_for(started: float, ident: str) -> str:
    """`<local start time>_<6 hex>`: runs sort by when they started."""
    return time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(started)) + f"_{ident[:6]}"


def start_time(pid: int) -> float:
    """When a process started, from /proc (the current time where /proc cannot tell)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        stat = Path("/proc/stat").read_text().split()
        boot = float(stat[stat.index("btime") + 1])
    except (OSError, IndexError, ValueError):
        return time.time()
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def run_name() -> str:
    """Resolver: one name per launch, the same in every worker of it. The launcher's
    (RUN_NAME_VAR); under torchrun alone, from torchrun, the workers' parent: its start time and
    run id; across several nodes, where the start times differ, `run-<rendezvous id>`; without
    torchrun, this process's start time."""
    given = os.environ.get(RUN_NAME_VAR)
    if given:
        return given
    world = World.from_env()
    run_id = world.run_id or "none"  # torchrun's own default is "none" too
    if world.size > world.local_size and run_id != "none":
        return f"run-{run_id}"
    parent = os.getppid() if world.launched else os.getpid()
    started = start_time(parent)
    ident = hashlib.sha1(f"{run_id}-{parent}-{started}".encode()).hexdigest()
    return run_name_for(started, ident)


def rank_zero_only(value: Any) -> Any:
    """Resolver: the value on global rank 0, None on the others (set by torchrun)."""
    return value if World.from_env().main else None


def register_configs() -> None:
    """Make the schemas and resolvers known to Hydra; call before Hydra composes."""
    store = ConfigStore.instance()
    store.store(name="train_schema", node=TrainConfig)
    # Groups whose options differ in shape: each option's YAML names its schema in `defaults`.
    for stored in stored_options():
        store.store(group=stored.group, name=stored.stored_as, node=stored.schema)
    OmegaConf.register_new_resolver("rank_zero_only", rank_zero_only, replace=True)
    OmegaConf.register_new_resolver("run_name", run_name, replace=True)

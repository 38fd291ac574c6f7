"""The checks of a whole config, composed by Hydra or read back from a checkpoint: what a single
group's schema (options.py, loggers.py, schema.py) cannot see alone, as one ConfigError that
names the key."""

from __future__ import annotations

import copy
import dataclasses
import difflib
from dataclasses import fields
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from ..core.suggest import did_you_mean
from ..core.world import World
from .error import ConfigError, require
from .optimizer import check_optimizer, upgraded
from .options import HELD_OUT
from .overrides import configs_folder
from .registry import (
    Option,
    fitting,
    keys_of,
    named,
    option_of,
    options,
    stored_groups,
    stored_options,
)
from .schema import (
    CheckpointFormat,
    CommHook,
    NcclConfig,
    Precision,
    Strategy,
    TrainConfig,
    uses_cuda,
)


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
    """Training: an epoch needs one optimizer step's samples (processes × data.batch_size ×
    trainer.grad_accumulation; data.StepBatches), or it never takes a step. Evaluation (held_out),
    and training that validates: every process needs a held-out sample; its last batch may be
    short, so any batch size does."""
    if held_out or config.trainer.val_every:
        samples, source = config.data.held_out_samples()
        if samples < world.size:
            fewer = f"on at most {samples} process(es), or " if samples else ""
            todo = (
                f"evaluate {fewer}with more data"
                if held_out
                else f"train {fewer}with more data, or with trainer.val_every=0 (no validation)"
            )
            raise ConfigError(
                f"{source}: {samples} held-out sample(s) (one in {HELD_OUT}) for {world.size} "
                f"process(es), which need one each; {todo}"
            )
    if held_out:
        return
    samples, source = config.data.training_samples()
    batch, accumulation = config.data.batch_size, config.trainer.grad_accumulation
    most = samples // (world.size * accumulation)  # the largest batch size an epoch has a step of
    todo = (
        f"use a batch size of at most {most}"
        if most
        else "use more data, fewer processes or a lower trainer.grad_accumulation"
    )
    require(
        most >= batch,
        "data.batch_size",
        batch,
        f"each optimizer step takes {world.size} process(es) × {batch} × "
        f"trainer.grad_accumulation {accumulation} = {world.size * batch * accumulation} of the "
        f"{samples} training samples of {source}; {todo}",
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
    check_strategy(config)
    model = option_of(type(config.model))
    if model.reads is not None and not isinstance(config.data, model.reads):
        data = option_of(model.reads)
        raise ConfigError(f"model: {model.what} reads {data.what}; use data={data.name}")


def check_strategy(config: TrainConfig) -> None:
    """dist.strategy=fsdp2 with what only DDP does, or what a sharded model cannot do."""
    dist, trainer = config.dist, config.trainer
    if dist.strategy is not Strategy.fsdp2:
        return
    require(
        trainer.checkpoint_format is CheckpointFormat.dcp,
        "trainer.checkpoint_format",
        "file",
        "rank 0 alone cannot write a model that dist.strategy=fsdp2 shards over every rank; "
        "set trainer.checkpoint_format=dcp",
    )
    require(
        trainer.precision is not Precision.fp16,
        "trainer.precision",
        "fp16",
        "dist.strategy=fsdp2 trains in bf16 or fp32 (fp16's grad scaler is DDP's here)",
    )
    require(
        dist.comm_hook is CommHook.default,
        "dist.comm_hook",
        dist.comm_hook.value,
        "a DDP comm hook: dist.strategy=fsdp2 reduce-scatters without one; set "
        "dist.comm_hook=default",
    )
    require(
        not dist.time_comm,
        "dist.time_comm",
        "true",
        "times DDP's all-reduces, which dist.strategy=fsdp2 has none of; set dist.time_comm=false",
    )


def check_keys(node: DictConfig, prefix: str = "") -> None:
    """Hydra's `+key=value` adds a key even to a typed node; a key outside the schema is a typo
    that would otherwise be ignored. (nccl.env is a dict: its keys are nccl.config_errors'.)"""
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    allowed = [f.name for f in dataclasses.fields(schema)]
    for key in node:
        if key not in allowed:
            hint = did_you_mean(key, allowed, prefix)
            raise ConfigError(f"{prefix}{key}: no such key; {hint}allowed: {', '.join(allowed)}")
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            check_keys(child, f"{prefix}{key}.")


def check_composed(
    cfg: DictConfig,
    world: World,
    *,
    this_node: bool = True,
    held_out: bool = False,
    nccl_choice: str | None = None,
) -> TrainConfig:
    """A config already composed (by Hydra for a run, by check.compose_and_check, from a
    checkpoint) as typed objects, checked; ConfigError names the bad key. The `hydra` node of a
    run's config is not ours: it is left out, and only says which NCCL profile was chosen.
    this_node=False skips what only this machine decides, its GPUs and the optimizer's class
    (rendering k8s/ for a cluster imports no torch); held_out=True checks the data for evaluation
    rather than training (check_data). nccl_choice: the profile nccl=<name> chose, for a config
    without its hydra node (train's task). `world`: the launch it is for, as the command decided
    it."""
    chosen = OmegaConf.select(cfg, "hydra.runtime.choices.nccl", default=nccl_choice)
    if "hydra" in cfg:
        cfg = copy.deepcopy(cfg)
        with open_dict(cfg):
            cfg.pop("hydra")
    check_keys(cfg)
    config: TrainConfig = OmegaConf.to_object(cfg)
    if chosen is not None:
        if config.nccl.profile is None:  # a profile file of one's own, without the line
            config.nccl.profile = chosen
        check_profile_name(config.nccl, chosen)
    if this_node:  # rendering k8s/ imports no torch: the pods' launcher checks these
        check_devices(config, world)
        check_optimizer(config.optimizer)
    check_data(config, world, held_out)
    check_combinations(config)
    check_accept_changes(config)
    if this_node and not held_out:  # a launch's: not k8s/'s rendering, nor evaluate's
        check_profile_ranks(config, world)
    return config


def check_profile_ranks(config: TrainConfig, world: World) -> None:
    """profile.ranks must be ranks of this launch: one beyond it would profile nothing, silently."""
    ranks = config.profile.ranks
    beyond = [rank for rank in ranks or [] if rank >= world.size]
    require(
        not (config.profile.on and beyond),
        "profile.ranks",
        ranks,
        f"rank(s) {beyond} are not in this launch of {world.size} process(es) (ranks 0 to "
        f"{world.size - 1}); null profiles every rank",
    )


def check_profile_name(profile: NcclConfig, chosen: str) -> None:
    """nccl.profile names the profile in force, in logs, failure reports and the bench's figures:
    it must be the one that nccl=<name> chose."""
    require(
        profile.profile == chosen,
        "nccl.profile",
        profile.profile,
        f"must be {chosen}, the name of the profile nccl={chosen} chose; keep `profile: {chosen}` "
        f"in configs/nccl/{chosen}.yaml, and choose a profile with nccl=<name>",
    )


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
                f"({', '.join(f.name for f in fields(TrainConfig))}) or a key in one, "
                "e.g. trainer.lr"
            )


def from_saved(
    saved: dict[str, Any],
    overrides: list[str],
    world: World,
    held_out: bool = False,
    recorded: dict[str, str] | None = None,
    told: dict[str, str] | None = None,
) -> TrainConfig:
    """A checkpoint's config (the plain dict it holds) typed and checked again, with dotted
    key=value overrides on top; held_out=True checks its data for evaluation (check_data).
    `recorded`: the checkpoint's options (registry.chosen), which pick each group's schema; `told`:
    those the user named (evaluate's model=<name>), for a checkpoint that records none."""
    parts: dict[str, Any] = {}
    if "profile" not in saved:  # a checkpoint from before the group: profile=none
        parts["profile"] = OmegaConf.load(configs_folder() / "profile" / "none.yaml")
    for group, values in upgraded(saved).items():
        if group not in stored_groups():
            parts[group] = values
            continue
        option = saved_option(group, values, (recorded or {}).get(group), (told or {}).get(group))
        parts[group] = OmegaConf.merge(OmegaConf.structured(option.schema), values)
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(TrainConfig), parts)
        cfg.merge_with_dotlist(overrides)
    except OmegaConfBaseException as err:
        raise ConfigError(" ".join(str(err).split())) from None
    return check_composed(cfg, world, held_out=held_out)


def saved_option(group: str, values: Any, recorded: Any, told: str | None) -> Option:
    """The option whose schema reads a checkpoint's `values` of `group`: the one it `recorded`;
    for a checkpoint that records none (written before checkpoints did), the one the user `told`,
    else the only one whose schema has its keys. A ConfigError when that is no option here, or
    when several fit and the user named none."""
    if not isinstance(values, dict):
        raise ConfigError(f"{group}: the checkpoint's is a {type(values).__name__}, not a dict")
    keys = set(values)
    listed = ", ".join(sorted(map(str, keys))) or "none"
    registered = ", ".join(o.name for o in options(group) if o.stored_as is not None)
    if recorded is not None:
        option = named(group, recorded)
        if told is not None and told != recorded:
            raise ConfigError(
                f"{group}={told}: the checkpoint was trained with {group}={recorded}, which "
                f"builds it; leave {group}= out"
            )
        if option is None or option.stored_as is None:
            raise ConfigError(
                f"{group}={recorded}: the checkpoint was trained with this option, which is not "
                f"registered here (registered: {registered}); register it again to read it"
            )
        if keys_of(option.schema) != keys:
            raise ConfigError(
                f"{group}={recorded}: the checkpoint's keys ({listed}) are not those of its schema "
                f"{option.schema.__name__} ({', '.join(sorted(keys_of(option.schema)))})"
            )
        return option
    fits = fitting(group, keys)
    if told is not None:
        option = named(group, told)
        if option is None or option.stored_as is None:
            raise ConfigError(f"{group}={told}: no such option; allowed: {registered}")
        if option not in fits:
            raise ConfigError(
                f"{group}={told}: its keys ({', '.join(sorted(keys_of(option.schema)))}) are not "
                f"the checkpoint's ({listed})"
            )
        return option
    if len(fits) == 1:
        return fits[0]
    if not fits:
        raise ConfigError(
            f"{group}: the checkpoint's keys ({listed}) fit no {group} schema "
            f"(registered: {registered})"
        )
    raise ConfigError(
        f"{group}: {unrecorded(group, listed, fits)}; say which it was trained with: "
        f"{' or '.join(f'{group}={o.name}' for o in fits)}"
    )


def unrecorded(group: str, listed: str, fits: list[Option]) -> str:
    """A checkpoint of before option names were recorded, whose keys fit several options."""
    names = ", ".join(f"{group}={o.name}" for o in fits)
    return (
        f"the checkpoint records no {group} option (it was written before checkpoints did), and "
        f"its keys ({listed}) fit {len(fits)}: {names}"
    )

"""A training config composed as train composes it, and checked: a bad one explained in one line.

ConfigCheck runs the check once Hydra has composed a run's config, before any run dir or process
group exists; the launcher, which the Kubernetes pods run, runs it before torchrun starts, all but
the optimizer's trial (try_optimizer), which imports dynamo: each worker's first line finds that.
Its exit code 2 is the one the Job's podFailurePolicy fails on at once (torchrun reports every
failure as 1).
It reads what train reads: every configs/ file as YAML, the overrides as overrides.hydra_overrides
rewrites them, and a data folder (token_files.check_folder).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from contextlib import AbstractContextManager
from pathlib import Path

from hydra import compose, initialize_config_dir, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from .. import PACKAGE
from ..core.exits import Exit, exit_with_error
from ..core.suggest import did_you_mean
from ..core.world import World
from . import logger_probes, optimizer
from .error import ConfigError
from .loggers import LoggersConfig
from .overrides import configs_folder, hydra_overrides, yaml_problem
from .registry import stored_options
from .schema import TrainConfig, register_configs, uses_cuda
from .validate import check_composed


def schema_keys(err: Exception) -> list[str]:
    """The keys allowed where an unknown one was given, from the schema the error names."""
    schema = getattr(err, "object_type", None)
    return [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else []


def one_line(err: Exception) -> str:
    """Hydra's and OmegaConf's multi-line messages, as one line that names the key."""
    if isinstance(err, OverrideParseException):
        reason = str(err).splitlines()[-2 if "Error parsing" in str(err) else 0]
        return f"{err.override}: not an override Hydra can read ({reason}); write key=value"
    cause = err if getattr(err, "full_key", None) else err.__cause__
    full_key = getattr(cause, "full_key", None)
    if full_key:
        reason = str(getattr(cause, "msg", cause)).strip().splitlines()[0]
        if "not in" in reason:
            allowed = schema_keys(cause)
            if not allowed:  # a map (deploy.node_selector): its keys are the user's to add
                return f"{full_key}: no such key; add it to the map with +{full_key}=..."
            parent, _, key = full_key.rpartition(".")
            hint = did_you_mean(key, allowed, prefix=f"{parent}." if parent else "")
            return f"{full_key}: no such key; {hint}allowed: {', '.join(allowed)}"
        if isinstance(cause, MissingMandatoryValue):
            return f"{full_key}: no value; set it in configs/ or as {full_key}=..."
        return f"{full_key}: {reason}"
    text = str(err)
    group = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
    if group:
        return no_such_option(*group.groups(), re.findall(r"^\t(\S+)$", text, re.MULTILINE))
    return " ".join(text.split())


def configs_at(folder: Path | None) -> AbstractContextManager:
    """Hydra reading a configs/ folder (a project's source), or the installed package's."""
    if folder is None:
        return initialize_config_module(config_module=f"{PACKAGE}.configs", version_base="1.3")
    return initialize_config_dir(config_dir=str(folder.resolve()), version_base="1.3")


def compose_train(overrides: list[str], folder: Path | None) -> DictConfig:
    """configs/train.yaml composed with `overrides` as train reads them (overrides.hydra_argv), with
    Hydra's node as a run has it (check_composed reads the chosen NCCL profile there)."""
    problem = yaml_problem(folder or configs_folder())
    if problem:
        raise ConfigError(problem)
    register_configs()
    with configs_at(folder):
        try:
            return compose(
                config_name="train", overrides=hydra_overrides(overrides), return_hydra_config=True
            )
        except MissingConfigException as err:
            raise ConfigError(unknown_option(err)) from None
        except AssertionError:  # OmegaConf's, for a key set below a null node
            problem = unchosen_logger(overrides)
            if problem is None:
                raise
            raise ConfigError(problem) from None


def compose_and_check(
    overrides: list[str],
    folder: Path | None = None,
    this_node: bool = True,
    world: World | None = None,
) -> TrainConfig:
    """The config train would run with `overrides`, composed here and checked (the loggers too);
    raises CONFIG_ERRORS on a bad one, which a command turns into its one line (describe). For
    code that has overrides, not a composed config: the commands and the tests. `world`: the
    launch the config is for (the launcher's, before torchrun starts it); None: this process's.
    A DictConfig already composed: validate.check_composed."""
    composed = compose_train(overrides, folder)
    config = check_composed(composed, world or World.from_env(), this_node=this_node)
    if this_node:
        check_loggers(config)
        try_optimizer(config)
    return config


def no_such_option(group: str, name: str, options: list[str]) -> str:
    return (
        f"{group}={name}: no such option; {did_you_mean(name, options)}"
        f"allowed: {', '.join(options)}"
    )


def unknown_option(err: MissingConfigException) -> str:
    """A config Hydra could not load, which it names without saying what there is: an option
    missing from a list (logger=[tensorboard,nope]), or a name in a defaults list of a group's
    YAML. Call inside configs_at."""
    found = re.search(r"In '([^']+)': Could not load '([^']+)'", str(err))
    if not found:
        return one_line(err)
    where, name = found.groups()
    group, _, option = name.rpartition("/")
    loader = GlobalHydra.instance().config_loader()
    options = loader.get_group_options(group) if group else []
    if where == "train" and options:
        return no_such_option(group, option, options)
    return missing_default(where, name, options)


def missing_default(where: str, name: str, options: list[str]) -> str:
    """configs/<where>.yaml's defaults list names a config there is none of: a schema named as
    an option of the group (- mlp_schema: the schemas are at the root), or a typo. Hydra writes
    a relative name with the group in front (model/mlp_schema), an absolute one without its /;
    `options`: the group's, if the name has one."""
    schemas = [stored.stored_as for stored in stored_options()]
    group, _, wanted = name.rpartition("/")
    said = f"configs/{where}.yaml: its defaults list names {name}, which is no config"
    if wanted in schemas:
        return f"{said}; a schema is named from the root: - /{wanted}"
    if options:
        hint = did_you_mean(wanted, options, prefix=f"{group}/")
        return f"{said}; {hint}the {group} options: {', '.join(options)}"
    hint = did_you_mean(wanted, schemas, prefix="/")
    return f"{said}; {hint}the schemas: {', '.join(f'/{schema}' for schema in schemas)}"


def unchosen_logger(overrides: list[str]) -> str | None:
    """logger.wandb.mode=online without wandb among the chosen loggers sets a key below null."""
    names = [f.name for f in dataclasses.fields(LoggersConfig)]
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        parts = key.split(".")
        if len(parts) > 2 and parts[0] == "logger" and parts[1] in names:
            return (
                f"{override}: {parts[1]} is not among the chosen loggers; choose it as well, "
                f"e.g. logger=[tensorboard,{parts[1]}]"
            )
    return None


def check_loggers(config: TrainConfig) -> None:
    """The chosen loggers' packages, and MLflow's server, as this machine finds them."""
    logger_probes.check(config.logger, timeout_s=min(logger_probes.PROBE_S, config.dist.timeout_s))


def try_optimizer(config: TrainConfig) -> None:
    """The optimizer built (and on CPU workers stepped) once with its keywords: in a command or a
    worker, where dynamo, which building one imports, is imported anyway (the launcher checks
    only what needs no instance)."""
    optimizer.try_optimizer(config.optimizer, config.trainer.lr, uses_cuda(config.dist.backend))


CONFIG_ERRORS = (ConfigError, HydraException, OmegaConfBaseException)


def describe(err: Exception) -> str:
    return str(err) if isinstance(err, ConfigError) else one_line(err)


def refused(err: Exception) -> int:
    """A one-process command's end on a bad config (CONFIG_ERRORS): its `config error:` line on
    stderr, and the exit code for the command to return. A launch's processes end with
    core.exits.exit_with_error instead, which prints once per node."""
    print(f"config error: {describe(err)}", file=sys.stderr, flush=True)
    return Exit.CONFIG_ERROR


def config_problem(overrides: list[str], world: World | None = None) -> str | None:
    """None if the config composed with `overrides` is valid (for the launch `world`; None: this
    process's), else one line naming the key."""
    try:
        compose_and_check(overrides, world=world)
    except CONFIG_ERRORS as err:
        return describe(err)
    return None


def sweep_problem(composed: DictConfig, config: TrainConfig, world: World) -> str | None:
    """A sweep (-m, hparams_search=) that cannot work, as one line; else None. Under torchrun
    every process would run a sweep of its own, each its own trials (a sampler's too), and make
    a process group per trial from one rendezvous: a sweep runs in one process per trial."""
    if world.launched:
        return (
            f"a sweep (-m, hparams_search=) under torchrun: each of the {world.size} process(es) "
            f"would run a sweep of its own; run it in one process, python -m {PACKAGE}.train -m "
            "..., or one Kubernetes Job per trial (docs/sweeps.md)"
        )
    sweeper = str(OmegaConf.select(composed, "hydra.sweeper._target_", default=""))
    if not sweeper.endswith(".BasicSweeper") and not config.trainer.val_every:
        return (
            f"trainer.val_every=0: the sweeper {sweeper.rpartition('.')[2]} minimises the "
            "val_loss train returns, which a run without validation has none of; set "
            "trainer.val_every"
        )
    return None


class ConfigCheck(Callback):
    """Hydra calls this (configs/train.yaml, hydra.callbacks) after composing a run's config and
    before it creates the run dir: a bad value stops every rank in one line, leaving nothing.
    RunDirGuard and train's main check the same config again where they need it typed (about
    10 ms): nothing passes between them but the config Hydra hands each. A callback is where
    Hydra hands the train command control: an exception raised here would be Hydra's traceback,
    so it ends the command itself."""

    def __init__(self) -> None:
        self.world = World.from_env()

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        self.check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        checked = self.check(config)  # the sweep's base config: a bad one starts no job
        problem = sweep_problem(config, checked, self.world)
        if problem:
            exit_with_error(f"config error: {problem}", self.world)

    def on_job_start(self, config: DictConfig, **kwargs: object) -> None:
        if OmegaConf.select(config, "hydra.mode") == RunMode.MULTIRUN:  # a run's one: on_run_start
            self.check(config)  # each job of a sweep, with its own overrides

    def check(self, composed: DictConfig) -> TrainConfig:
        """A job's composed config, checked, or one `config error:` line and exit 2 on
        every rank."""
        try:
            config = check_composed(composed, self.world)
            check_loggers(config)
            try_optimizer(config)
        except CONFIG_ERRORS as err:
            exit_with_error(f"config error: {describe(err)}", self.world)
        return config

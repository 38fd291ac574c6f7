"""One registry of the model, data and logger options: what each option's YAML fills (its schema)
and what builds it.

An option is a YAML file in configs/<group>/ and a schema, a dataclass registered with @option
(config.py). Its builder registers with @builds(schema) where it is defined, apart from the schema
because checking a config (and rendering k8s/) reads the schemas without importing torch:
  model   model.py    (cfg, data) -> nn.Module, with flops_per_token() for MFU
  data    data.py     (cfg, seed, held_out) -> Dataset
  logger  loggers.py  (cfg, run_dir, start_step, config) -> an object with log(row) and close(),
                      or None for nothing to start
Everything that differs between options reads these two: Hydra's ConfigStore
(config.register_configs), the model-and-data check (validate.check_combinations), the schema of a
checkpoint's config (validate.from_saved), the logger group's keys (logger_config.LoggersConfig) and their
packages, build_model, build_dataset and loggers.build.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

Schema = TypeVar("Schema", bound=type)
Builder = TypeVar("Builder", bound=Callable[..., Any])


@dataclass(frozen=True)
class Option:
    group: str  # model, data or logger: the folder configs/<group>/
    name: str  # its YAML, configs/<group>/<name>.yaml (a logger's: its key under logger)
    schema: type  # the dataclass that YAML fills: types and checks
    what: str  # how a message names what it is: "an MLP", "labelled points"
    # model and data: the name the YAML's defaults list gives its schema (mlp_schema); loggers
    # have none, as each sets a key of the one logger schema (logger_config.LoggersConfig)
    stored_as: str | None = None
    reads: type | None = None  # a model: the schema of the data it reads
    package: tuple[str, str] | None = None  # a logger: (the module it imports, its pip extra)


OPTIONS: dict[type, Option] = {}  # by schema, in the order registered
BUILDERS: dict[type, Callable[..., Any]] = {}  # by schema


def option(
    group: str,
    name: str,
    what: str = "",
    *,
    stored_as: str | None = None,
    reads: type | None = None,
    package: tuple[str, str] | None = None,
) -> Callable[[Schema], Schema]:
    """Register the decorated dataclass as the schema of configs/<group>/<name>.yaml."""

    def register(schema: Schema) -> Schema:
        taken = [o for o in OPTIONS.values() if (o.group, o.name) == (group, name)]
        if taken and taken[0].schema is not schema:
            raise ValueError(
                f"{group}={name}: registered twice ({taken[0].schema.__name__}, {schema.__name__})"
            )
        OPTIONS[schema] = Option(group, name, schema, what, stored_as, reads, package)
        return schema

    return register


def builds(schema: type) -> Callable[[Builder], Builder]:
    """Register the decorated class or function as what builds an option of `schema`."""

    def register(builder: Builder) -> Builder:
        BUILDERS[schema] = builder
        return builder

    return register


def options(group: str) -> list[Option]:
    return [o for o in OPTIONS.values() if o.group == group]


def stored_options() -> list[Option]:
    """The options whose YAML names a schema of their own (model, data). A saved config names
    none: its keys tell which it is."""
    return [o for o in OPTIONS.values() if o.stored_as is not None]


def option_of(schema: type) -> Option:
    return OPTIONS[schema]


def builder_of(config: Any) -> Callable[..., Any]:
    """What builds the option that `config` (a schema's instance) is."""
    schema = type(config)
    if schema not in BUILDERS:
        raise LookupError(
            f"{schema.__name__}: nothing builds it; register a builder with @builds({schema.__name__})"
        )
    return BUILDERS[schema]

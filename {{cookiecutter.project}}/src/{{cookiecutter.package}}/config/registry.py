"""One registry of the model, data and logger options: what each option's YAML fills (its schema)
and what builds it.

An option is a YAML file in configs/<group>/ and a schema, a dataclass registered with @option
(options.py, loggers.py). Its builder registers with @builds(schema) where it is defined, apart
from the schema because checking a config (and rendering k8s/) reads the schemas without
importing torch:
  model   model.py    (cfg, data) -> nn.Module, with flops_per_token() for MFU
  data    data.py     (cfg, seed, held_out) -> Dataset
  logger  loggers.py  (cfg, run_dir, start_step, config) -> an object with log(row) and close(),
                      or None for nothing to start
Everything that differs between options reads these two: Hydra's ConfigStore
(schema.register_configs), the model-and-data check (validate.check_combinations), the schema of a
checkpoint's config (validate.from_saved), the logger group's keys (loggers.LoggersConfig)
and their packages, build_model, build_dataset and loggers.build.

A checkpoint records the option of each group its values fill (chosen(): model=mlp, data=synthetic),
because two options may have the same keys: their values alone cannot tell which schema and
builder wrote them. So an option's name, and its schema's name in the ConfigStore (stored_as), are
its own within its group: a second registration of either is refused, in one line that names
both places (option()); found at import, where no caller can turn it into one line, it is raised
as ConfigError by the first use of the schemas (stored_options(): composing, checking). Schema
names are unique across groups too: the ConfigStore holds them at its root.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from .error import ConfigError

Schema = TypeVar("Schema", bound=type)
Builder = TypeVar("Builder", bound=Callable[..., Any])


@dataclass(frozen=True)
class Option:
    group: str  # model, data or logger: the folder configs/<group>/
    name: str  # its YAML, configs/<group>/<name>.yaml (a logger's: its key under logger)
    schema: type  # the dataclass that YAML fills: types and checks
    what: str  # how a message names what it is: "an MLP", "labelled points"
    # model and data: the name the YAML's defaults list gives its schema (mlp_schema); loggers
    # have none, as each sets a key of the one logger schema (loggers.LoggersConfig)
    stored_as: str | None = None
    reads: type | None = None  # a model: the schema of the data it reads
    package: tuple[str, str] | None = None  # a logger: (the module it imports, its pip extra)
    where: str = ""  # file:line of its @option, for a message that names two registrations


OPTIONS: dict[type, Option] = {}  # by schema, in the order registered
BUILDERS: dict[type, Callable[..., Any]] = {}  # by schema
CLASHES: list[str] = []  # registrations refused at import, each in its line: stored_options()


def option(
    group: str,
    name: str,
    what: str = "",
    *,
    stored_as: str | None = None,
    reads: type | None = None,
    package: tuple[str, str] | None = None,
) -> Callable[[Schema], Schema]:
    """Register the decorated dataclass as the schema of configs/<group>/<name>.yaml. A name or a
    stored_as that another schema of the group has already is not registered: the clash is kept
    for stored_options() to raise."""
    caller = sys._getframe(1)  # the @option line: where a collision message points
    where = f"{caller.f_code.co_filename}:{caller.f_lineno}"

    def register(schema: Schema) -> Schema:
        new = Option(group, name, schema, what, stored_as, reads, package, where)
        if stored_as in ROOT_NAMES:
            CLASHES.append(
                f"{group}={name}: stored_as={stored_as!r} ({schema.__name__} at {where}) is the "
                f"name of the primary config's own; each option's schema needs a name of its own, "
                f"e.g. stored_as='{name}_schema'"
            )
            return schema
        for old in [o for o in OPTIONS.values() if not same(o.schema, schema)]:
            clash = collision(old, new)
            if clash:
                CLASHES.append(clash)
                return schema
        for old in [s for s in OPTIONS if same(s, schema)]:  # its module imported again
            del OPTIONS[old]
        OPTIONS[schema] = new
        return schema

    return register


def same(one: type, other: type) -> bool:
    """One schema, or the same class defined again (its module reloaded)."""
    defined = (one.__module__, one.__qualname__)
    return one is other or defined == (other.__module__, other.__qualname__)


def collision(old: Option, new: Option) -> str | None:
    """Why `new` cannot join `old`, another schema's option, or None. Schemas are stored at the
    ConfigStore's root (schema.register_configs), one namespace for every group: it would keep
    only the newer of two schemas stored under one name, so that the other option trains the
    newer's class. Two options of one name in a group would leave its YAML two schemas."""
    here = f"{new.schema.__name__} at {new.where}"
    there = f"{old.schema.__name__} at {old.where}"
    if old.group == new.group and old.name == new.name:
        return (
            f"{new.group}={new.name}: registered twice, by {here} and by {there}; an option's name "
            f"is its YAML's (configs/{new.group}/<name>.yaml) and one schema's: rename one"
        )
    if new.stored_as is not None and old.stored_as == new.stored_as:
        return (
            f"{new.group}={new.name}: stored_as={new.stored_as!r} ({here}) is already "
            f"{old.group}={old.name}'s ({there}); each option's schema needs a name of its own, "
            f"e.g. stored_as='{new.name}_schema', named first in "
            f"configs/{new.group}/{new.name}.yaml"
        )
    return None


# The root configs that are no option's schema: the primary config and its schema (schema.py).
ROOT_NAMES = {"train", "train_schema"}


def builds(schema: type) -> Callable[[Builder], Builder]:
    """Register the decorated class or function as what builds an option of `schema`."""

    def register(builder: Builder) -> Builder:
        BUILDERS[schema] = builder
        return builder

    return register


def options(group: str) -> list[Option]:
    return [o for o in OPTIONS.values() if o.group == group]


def stored_options() -> list[Option]:
    """The options whose YAML names a schema of their own (model, data). Every command that
    composes or checks a config asks for them first (register_configs): a registration refused at
    import ends it here, as a bad config does."""
    if CLASHES:
        raise ConfigError(CLASHES[0])
    return [o for o in OPTIONS.values() if o.stored_as is not None]


def option_of(schema: type) -> Option:
    return OPTIONS[schema]


def stored_groups() -> list[str]:
    """The groups whose options each name a schema of their own (model, data)."""
    return list(dict.fromkeys(o.group for o in stored_options()))


def chosen(config: Any) -> dict[str, str]:
    """The option of each stored group that a whole config's values fill, by group: what a
    checkpoint records. From the typed values themselves (their schema's option), so that it
    names what was built, whatever the command line said."""
    return {group: option_of(type(getattr(config, group))).name for group in stored_groups()}


def named(group: str, name: object) -> Option | None:
    return next((o for o in options(group) if o.name == name), None)


def keys_of(schema: type) -> set[str]:
    return {f.name for f in fields(schema)}


def fitting(group: str, keys: Iterable[str]) -> list[Option]:
    """The options of `group` whose schema has exactly these keys: which a checkpoint written
    before checkpoints recorded their options may be."""
    keys = set(keys)
    return [o for o in options(group) if o.stored_as is not None and keys_of(o.schema) == keys]


def builder_of(config: Any) -> Callable[..., Any]:
    """What builds the option that `config` (a schema's instance) is."""
    schema = type(config)
    if schema not in BUILDERS:
        raise LookupError(
            f"{schema.__name__}: nothing builds it; register a builder with "
            f"@builds({schema.__name__}) in a module the command imports (model.py and data.py: "
            f"train, evaluate and bench do)"
        )
    return BUILDERS[schema]

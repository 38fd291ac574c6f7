"""train's command line before Hydra reads it: NCCL's comma lists and the deploy maps rewritten
as Hydra must read them, and every configs/ file checked to be YAML Hydra can use. dotted: a
config's keys as the command line names them (trainer.lr), for rundir's resume check and MLflow."""

from __future__ import annotations

import functools
import os
import re
from importlib.resources import files
from pathlib import Path
from typing import Any

from .. import PACKAGE
from ..nccl import decision as nccl
from .error import ConfigError

# What NCCL reads as comma lists (NCCL_DEBUG_SUBSYS=INIT,NET, NCCL_IB_HCA=mlx5_0,mlx5_1, and
# many nccl.env variables: NCCL_ALGO=Ring,Tree) Hydra reads as a sweep, and a value that starts
# with NCCL's ^ (exclude) or = (exact match) it cannot read at all, unless quoted.
NCCL_TEXT_KEY = re.compile(
    r"(\+?\+?)(nccl\.(?:" + "|".join(nccl.TEXT_FIELDS) + r"|env\.[^=]*))=(.*)", re.DOTALL
)
# The deploy group's maps: their keys are the user's, so an override may add one.
MAP_KEY = re.compile(
    r"\+{0,2}deploy\.(node_selector|affinity|extra_resources|pod_labels|pod_annotations|"
    r"env|secret_env)[.=]"
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
      deploy.node_selector={pool:gpu}              ->  ++deploy.node_selector={pool:gpu}
                                                       (and any other deploy map)
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
    return Path(str(files(f"{PACKAGE}.configs")))


GLOBAL_GROUPS = (
    "experiment",
    "local",
    "hparams_search",
)  # their files set keys anywhere: # @package _global_
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
    """train's command line before Hydra reads it: a configs/ file that is not YAML raises
    ConfigError, and the overrides are rewritten as hydra_overrides says."""
    problem = yaml_problem(configs_folder()) or sweeper_problem(argv)
    if problem:
        raise ConfigError(problem)
    return hydra_overrides(argv)


# hparams_search=<name>: the Hydra sweeper plugin its file overrides hydra/sweeper with, and the
# extra that installs it. Without it Hydra's error names neither.
SWEEPER_PLUGINS = {"optuna": ("hydra_plugins.hydra_optuna_sweeper", "sweep")}


def sweeper_problem(argv: list[str]) -> str | None:
    """hparams_search=<name> whose sweeper plugin is not installed, as one line; else None."""
    import importlib.util

    for arg in argv:
        key, _, name = arg.lstrip("+").partition("=")
        if key == "hparams_search" and name in SWEEPER_PLUGINS:
            module, extra = SWEEPER_PLUGINS[name]
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:  # no hydra_plugins at all
                found = False
            if not found:
                return (
                    f"{arg}: its sweeper plugin ({module}) is not installed; "
                    f"pip install -e '.[{extra}]'"
                )
    return None


def dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict's leaves by dotted key, as overrides name them: trainer.lr."""
    leaves: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            leaves |= dotted(value, f"{prefix}{key}.")
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves

"""A checkpoint found and read for the commands that use one outside training (evaluate, generate,
export): `ckpt=` resolved to a file or DCP folder (load refuses anything else in one line), the
model it holds rebuilt from its own config, the weights it holds (the trained ones or their EMA),
and the tokenizer its run saved."""

from __future__ import annotations

import pickle
import warnings
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config.error import ConfigError
from ..config.registry import option_of
from ..config.validate import saved_option
from . import checkpoint

NEEDED = ("step", "model", "config")  # what every reader of a checkpoint reads
ZIP = b"PK\x03\x04"  # torch.save's format: a zip archive
USAGE = "write ckpt=<file|run dir|latest> or key=value"
TOKENIZER = "tokenizer.json"  # HF tokenizers' file, saved in the run dir and the data folder
WEIGHTS = ("ema", "model")  # the checkpoint keys that hold weights: EMA ones first, when kept


def load(path: Path) -> dict[str, Any]:
    """The checkpoint in `path`; a ConfigError that names the file and why it is none.
    torch.load's own errors on a file that is not a checkpoint are cryptic (`KeyError: 101`
    for a text file), so the cheap cases are told apart first."""

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"ckpt={path}: {why}")

    if checkpoint.is_dcp(path):
        try:
            return checkpoint.read(path)
        except Exception as err:  # a share missing or cut short, no metadata: DCP's words
            raise refuse(f"cannot be loaded: {' '.join(str(err).split())[:200]}") from None
    try:
        with path.open("rb") as file:
            head = file.read(len(ZIP))
    except OSError as err:
        raise refuse(f"cannot be read: {err.strerror or err}") from None
    if not head:
        raise refuse("the file is empty")
    if head != ZIP and not head.startswith(b"\x80"):  # nor the legacy (pickle) format
        raise refuse(
            f"not a checkpoint: torch.save writes a zip archive; this file starts {head!r}"
        )
    if head == ZIP and not zipfile.is_zipfile(path):
        raise refuse(
            "truncated or corrupt: its zip archive has no end (a copy or write cut short?)"
        )
    try:
        with warnings.catch_warnings():  # torch warns of pickle protocols before refusing them
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise refuse(
            "holds Python objects beyond tensors and plain data, which no checkpoint of "
            "this project does; not loaded (torch.load weights_only)"
        ) from None
    except Exception as err:  # a damaged archive: torch says what it could not read
        raise refuse(f"cannot be loaded: {' '.join(str(err).split())[:200]}") from None
    if not isinstance(state, dict):
        raise refuse(f"not a training checkpoint: it holds a {type(state).__name__}, not a dict")
    missing = [key for key in NEEDED if key not in state]
    if missing:
        keys = ", ".join(sorted(map(str, state))[:8]) or "none"
        raise refuse(
            f"not a training checkpoint: it has no {', '.join(missing)} (its keys: {keys})"
        )
    return state


def newest_usable(runs: list[Path]) -> tuple[Path | None, dict[str, Any], list[str]]:
    """The newest checkpoint across `runs` (newest run first) that loads, its state, and what
    was passed over on the way, each with why."""
    passed = []
    for run in runs:
        paths = checkpoint.checkpoint_paths(run)
        if not paths:
            passed.append(f"{run} (no checkpoint)")
        for path in reversed(paths):
            try:
                return path, load(path), passed
            except ConfigError as err:
                passed.append(str(err).removeprefix("ckpt="))
    return None, {}, passed


def find_checkpoint(
    ckpt: str, outputs: Path = Path("outputs"), doing: str = "using"
) -> tuple[Path, dict[str, Any], str]:
    """A checkpoint from `ckpt`, its state, and a note when newer ones were passed over: a file;
    a run dir (its newest that loads); or latest (the newest that loads across the runs in
    outputs/, newest run first: run names sort by their start time). `doing`: the note's verb."""
    if not ckpt:
        raise ConfigError(f"ckpt= is empty; {USAGE}")
    path = Path(ckpt)
    try:
        kind = "dir" if path.is_dir() else "file" if path.is_file() else path.exists() and "other"
    except OSError as err:  # a name too long, say: nothing to find there
        shown = ckpt if len(ckpt) <= 120 else f"{ckpt[:100]}..."
        raise ConfigError(f"ckpt={shown}: {err.strerror or err}") from None
    if ckpt == "latest":
        try:
            runs = (
                sorted(  # not .compile-cache (core/caches.py): no run
                    (p for p in outputs.iterdir() if p.is_dir() and p.name[:1] != "."), reverse=True
                )
                if outputs.is_dir()
                else []
            )
        except OSError as err:
            raise ConfigError(
                f"ckpt=latest: cannot list {outputs}/: {err.strerror or err}"
            ) from None
        none, where = f"no run under {outputs}/ has a checkpoint", f"under {outputs}/"
    elif kind == "dir" and checkpoint.is_dcp(path):  # a step_<N>.dcp folder: one checkpoint
        return path, load(path), ""
    elif kind == "dir":
        if path.name == "checkpoints" and not (path / "checkpoints").is_dir():
            path = path.parent  # the run's checkpoints/ folder named instead of the run
        runs, where = [path], f"in {path / 'checkpoints'}"
        none = f"no checkpoint {where}"
    elif kind == "file":
        return path, load(path), ""
    else:
        what = "not a regular file nor a run dir" if kind else "no such file or run dir"
        raise ConfigError(f"ckpt={ckpt}: {what}")
    found, state, passed = newest_usable(runs)
    damaged = [p for p in passed if not p.endswith("(no checkpoint)")]
    if found is None and not damaged:
        raise ConfigError(f"ckpt={ckpt}: {none}")
    if found is None:
        raise ConfigError(f"ckpt={ckpt}: no checkpoint {where} loads; the newest: {damaged[0]}")
    note = ""
    if passed:
        more = f" and {len(passed) - 2} more" if len(passed) > 2 else ""
        note = (
            f"ckpt={ckpt}: {doing} {found}, the newest that loads; "
            f"passed over {'; '.join(passed[:2])}{more}"
        )
    return found, state, note


def model_and_data(
    path: Path, state: dict[str, Any], told: dict[str, str] | None = None
) -> tuple[Any, Any]:
    """The model and data options' schemas (typed, checked) that build the checkpoint's model,
    from its own config: its data's file is not read (a model is built from the data's shape,
    and the file may be on another machine). `told`: options the user named (model=<name>), for
    a checkpoint that records none."""
    config, recorded = state["config"], state.get("options") or {}
    for key, value in (("config", config), ("options", recorded)):
        if not isinstance(value, dict):
            raise ConfigError(f"ckpt={path}: its {key!r} is a {type(value).__name__}, not a dict")
    typed = []
    for group in ("model", "data"):
        values = config.get(group)
        option = saved_option(group, values, recorded.get(group), (told or {}).get(group))
        if "path" in values:
            values = {**values, "path": None}  # the shape only: no file to look for here
        try:
            typed.append(
                OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(option.schema), values))
            )
        except OmegaConfBaseException as err:
            raise ConfigError(f"ckpt={path}: {' '.join(str(err).split())[:200]}") from None
    model, data = typed
    reads = option_of(type(model)).reads
    if reads is not None and not isinstance(data, reads):
        raise ConfigError(
            f"ckpt={path}: its model ({option_of(type(model)).what}) reads "
            f"{option_of(reads).what}, and its data is {option_of(type(data)).what}"
        )
    return model, data


def chosen_weights(path: Path, state: dict[str, Any], asked: str = "") -> tuple[str, Mapping]:
    """Which weights to use and them: `asked` (ema or model), or else the EMA weights when the
    checkpoint keeps them (trainer.ema_decay), else the trained ones."""
    held = [key for key in WEIGHTS if state.get(key) is not None]
    for key in held:
        if not isinstance(state[key], Mapping):
            raise ConfigError(
                f"ckpt={path}: its {key!r} is a {type(state[key]).__name__}, not a state dict"
            )
    if asked and asked not in held:
        why = "no EMA weights (train with trainer.ema_decay)" if asked == "ema" else "no weights"
        raise ConfigError(f"weights={asked}: the checkpoint {path} holds {why}")
    which = asked or held[0]
    return which, state[which]


def load_weights(model: torch.nn.Module, weights: Mapping, path: Path, which: str) -> None:
    """`weights` into `model`, all of them; a ConfigError when they are not its."""
    try:
        model.load_state_dict(weights)
    except (RuntimeError, TypeError, AttributeError) as err:
        reason = " ".join(str(err).split())[:200]
        name = "EMA weights" if which == "ema" else "weights"
        raise ConfigError(
            f"ckpt={path}: its {name} do not fit its own config's model: {reason}"
        ) from None


def run_dir_of(path: Path) -> Path:
    """The run dir of a checkpoint in `<run dir>/checkpoints/`; the folder of any other."""
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def tokenizer_of(path: Path, state: dict[str, Any]) -> Path | None:
    """The tokenizer that made the checkpoint's tokens: its run dir's copy, else the one in its
    data's folder (data.path, a folder or a file in one); None when neither has one."""
    data = state["config"].get("data") if isinstance(state["config"], dict) else None
    places = [run_dir_of(path)]
    if isinstance(data, dict) and isinstance(data.get("path"), str) and data["path"]:
        source = Path(data["path"])
        places.append(source if source.is_dir() else source.parent)
    for place in places:
        if (place / TOKENIZER).is_file():
            return place / TOKENIZER
    return None

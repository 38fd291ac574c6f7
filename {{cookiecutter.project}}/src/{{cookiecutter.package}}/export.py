"""A checkpoint's model as files another program loads: bf16 safetensors and a config JSON.

    python -m {{ cookiecutter.package }}.export ckpt=latest out=exported/
    python -m {{ cookiecutter.package }}.export ckpt=outputs/<run>/checkpoints/step_000000300.dcp out=exported/ overwrite=true

`out` gets model.safetensors (the weights in bfloat16, nothing of the optimizer or the RNG: the EMA
weights when the checkpoint keeps them, weights=model for the trained ones), config.json (the
model's class and config, the data's shape it was built for, which weights) and tokenizer.json
when the run saved one. The folder is written beside `out` and renamed: `out` is whole or as it
was. Load it back with safetensors.torch.load_model(model, "out/model.safetensors"), which also
restores weights that two names share (the file keeps one copy; config.json's `shared` lists them).
"""  # noqa: E501

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import PACKAGE
from .config.error import ConfigError, require
from .config.options import DataConfig
from .config.registry import option_of, stored_groups
from .core.exits import Exit
from .core.files import PARTIAL
from .model import build_model
from .run.checkpoint import remove, replace_folder
from .run.saved import chosen_weights, find_checkpoint, load_weights, model_and_data, tokenizer_of

HELP = ("-h", "--help")
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"
KEYS = {
    "ckpt": "a checkpoint file or .dcp folder, a run dir, or latest (the default)",
    "out": "the folder to write (required); an existing one only with overwrite=true",
    "overwrite": "true: replace a folder `out` that holds files (default false)",
    "weights": "ema or model (default: ema when the checkpoint keeps EMA weights)",
}
USAGE = f"write key=value, with a key of: {', '.join(KEYS)}"


def parse(args: list[str]) -> tuple[str, Path, bool, str, dict[str, str]]:
    """ckpt, out, overwrite, weights, and the options named (model=<name>)."""
    ckpt, out, overwrite, weights, told = "latest", None, False, "", {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"{arg}: {USAGE}")
        if key == "ckpt":
            ckpt = value
        elif key == "out":
            require(value != "", "out", '""', "empty; give the folder to write")
            out = Path(value)
        elif key == "overwrite":
            require(value in ("true", "false"), key, value, "must be true or false")
            overwrite = value == "true"
        elif key == "weights":
            require(value in ("ema", "model"), key, value, "must be ema or model")
            weights = value
        elif key in stored_groups():
            told[key] = value
        else:
            raise ConfigError(f"{key}: no such key; {USAGE}")
    if out is None:
        raise ConfigError("no out=: give the folder to write, e.g. out=exported/")
    return ckpt, out, overwrite, weights, told


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse, before reading a checkpoint, an `out` that is not a folder, or one that holds
    files while overwrite=true is not given."""
    try:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"out={out}: not a folder")
        held = out.is_dir() and any(out.iterdir())
    except OSError as err:
        raise ConfigError(f"out={out}: {err.strerror or err}") from None
    if held and not overwrite:
        raise ConfigError(f"out={out}: holds files already; add overwrite=true to replace it")


def shape_of(data: DataConfig) -> dict[str, Any]:
    """What of the data the model was built for (vocab_size and seq_len; num_features and
    num_classes): its option's own keys, without those that say how data is read or found."""
    reading = {f.name for f in fields(DataConfig)} | {"path"}
    return {f.name: getattr(data, f.name) for f in fields(data) if f.name not in reading}


def write(model: nn.Module, folder: Path, config: dict[str, Any], tokenizer: Path | None) -> None:
    """The export's files into `folder` (made here)."""
    from safetensors import safe_open
    from safetensors.torch import save_model

    folder.mkdir()
    model = model.to(torch.bfloat16)  # its floating-point tensors; shared ones stay shared
    # save_model writes a tensor that two names share once, and names the other in its metadata
    save_model(model, str(folder / WEIGHTS_FILE), metadata={"format": "pt"}, force_contiguous=True)
    with safe_open(str(folder / WEIGHTS_FILE), "pt") as saved:  # it reads back; what it kept
        kept, named = set(saved.keys()), saved.metadata()
    config["shared"] = {name: named[name] for name in model.state_dict() if name not in kept}
    if tokenizer is not None:
        shutil.copyfile(tokenizer, folder / tokenizer.name)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    for path in folder.iterdir():  # durable before the rename makes them the export
        with path.open("rb") as file:
            os.fsync(file.fileno())


def export(
    ckpt: str, out: Path, overwrite: bool, weights: str, told: dict[str, str]
) -> tuple[Path, str]:
    """The export of checkpoint `ckpt` in `out`: the checkpoint's path, and the weights used."""
    check_out(out, overwrite)
    path, state, note = find_checkpoint(ckpt, doing="exporting")
    if note:
        print(note, file=sys.stderr)
    model_cfg, data = model_and_data(path, state, told)
    which, chosen = chosen_weights(path, state, weights)
    model = build_model(model_cfg, data)
    load_weights(model, chosen, path, which)
    tokenizer = tokenizer_of(path, state)
    config = {
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "model_option": option_of(type(model_cfg)).name,
        "model": {f.name: getattr(model_cfg, f.name) for f in fields(model_cfg)},
        "data_option": option_of(type(data)).name,
        "data": shape_of(data),
        "weights": which,
        "dtype": "bfloat16",
        "step": state["step"],
        "checkpoint": str(path),
        "tokenizer": tokenizer.name if tokenizer else None,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{PARTIAL}{out.name}-{os.getpid()}")
    try:
        write(model, partial, config, tokenizer)
        interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the renames go through whole
        try:
            replace_folder(partial, out)
        finally:
            signal.signal(signal.SIGINT, interrupt)
    except BaseException:  # Ctrl-C or a full disk: nothing of this export is left
        remove(partial)
        raise
    return path, which


def usage() -> str:
    keys = "\n".join(f"  {key:<10} {what}" for key, what in KEYS.items())
    return (
        f"usage: python -m {PACKAGE}.export [ckpt=<file|run dir|latest>] out=<folder> "
        f"[key=value ...]\n\n{__doc__.strip()}\n\nkeys:\n{keys}"
    )


def main() -> int:
    if any(arg in HELP for arg in sys.argv[1:]):  # before anything is read or written
        print(usage())
        return Exit.OK
    out = None
    try:
        ckpt, out, overwrite, weights, told = parse(sys.argv[1:])
        path, which = export(ckpt, out, overwrite, weights, told)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return Exit.CONFIG_ERROR
    except KeyboardInterrupt:
        print("export: stopped by Ctrl-C; nothing written", file=sys.stderr)
        return Exit.INTERRUPTED
    except OSError as err:  # an unwritable or full file system
        why = err.strerror or str(err)
        why = f"{err.filename}: {why}" if err.filename else why
        print(f"export: could not write {out}: {why}; nothing written", file=sys.stderr)
        return Exit.FAILED
    print(f"{path} ({which} weights) -> {out}")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())

"""Evaluate a checkpoint on the held-out data its run never trained on, on one or more processes.

    # the newest checkpoint of the newest run in outputs/
    python -m {{ cookiecutter.package }}.evaluate ckpt=latest
    # the newest checkpoint of that run
    python -m {{ cookiecutter.package }}.evaluate ckpt=outputs/<run>
    python -m {{ cookiecutter.package }}.evaluate ckpt=outputs/<run>/checkpoints/step_000000300.pt data.batch_size=512
    # a folder: trainer.checkpoint_format=dcp
    python -m {{ cookiecutter.package }}.evaluate ckpt=outputs/<run>/checkpoints/step_000000300.dcp
    torchrun --standalone --nproc-per-node 2 -m {{ cookiecutter.package }}.evaluate ckpt=latest

The model and data are the checkpoint's own (its config, and the options it records: model=mlp,
data=synthetic); overrides may change how the data is read (batch size, workers, backend), not
what it is. A checkpoint written before checkpoints recorded their options, whose keys fit two
options, needs model=<name> (or data=<name>) to say which. Each process scores its shard; the loss
and accuracy over all of them go to `<run dir>/eval/step_<N>.json` and to one printed line.
"""  # noqa: E501

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from . import PACKAGE
from .config.changeable import EVALUATE_SETS
from .config.error import ConfigError, require
from .config.registry import stored_groups
from .config.schema import TrainConfig, marked_keys, uses_cuda
from .config.validate import from_saved
from .core.exits import Exit
from .core.files import write_atomically
from .core.world import World
from .data import build_dataset
from .model import build_model
from .nccl import process_group
from .run import checkpoint, scoring
from .run.saved import USAGE, find_checkpoint, load_weights
from .run.trainer import autocast_for

# What an evaluation may change in the checkpoint's config: how the data is read and where.
ADJUSTABLE = marked_keys(EVALUATE_SETS)  # the rest comes from the checkpoint's config
HELP = ("-h", "--help")


def parse(args: list[str]) -> tuple[str, list[str], dict[str, str]]:
    """ckpt, the overrides, and the options named (model=<name>: validate.saved_option)."""
    ckpt, overrides, told = "latest", [], {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"{arg}: {USAGE}")
        if key == "ckpt":
            ckpt = value
        elif key in stored_groups():
            told[key] = value
        elif key in ADJUSTABLE:
            overrides.append(arg)
        else:
            raise ConfigError(
                f"{key}: the checkpoint's config decides it; an evaluation may set "
                f"{', '.join(ADJUSTABLE)}"
            )
    return ckpt, overrides, told


def held_out(cfg: TrainConfig, world: World, batch_given: bool) -> Dataset:
    """The held-out set; every process must have a sample of it to score, and a batch size given
    must fit a process's share (the checkpoint's own is simply capped by it)."""
    data = build_dataset(cfg.data, cfg.trainer.seed, held_out=True)
    count, per_process = len(data), len(data) // world.size
    _, source = cfg.data.held_out_samples()
    if per_process == 0:
        raise ConfigError(
            f"{source}: the checkpoint's data holds {count} held-out sample(s), fewer than the "
            f"{world.size} process(es) scoring it"
            + (f"; evaluate on at most {count} process(es)" if count else ": nothing to score")
        )
    if batch_given:
        require(
            per_process >= cfg.data.batch_size,
            "data.batch_size",
            cfg.data.batch_size,
            f"each of {world.size} process(es) scores {per_process} of the {count} held-out "
            f"samples of {source}; use a batch size of at most {per_process}",
        )
    return data


def evaluate(
    path: Path,
    state: dict[str, Any],
    overrides: list[str],
    world: World,
    told: dict[str, str] | None = None,
) -> dict:
    """Score the checkpoint `state` (read from `path`); `told`: the options the user named."""
    recorded = state.get("options")  # none in a checkpoint written before they were recorded
    for key, value in (("config", state["config"]), ("options", recorded or {})):
        if not isinstance(value, dict):
            raise ConfigError(f"ckpt={path}: its {key!r} is a {type(value).__name__}, not a dict")
    cfg = from_saved(state["config"], overrides, world, held_out=True, recorded=recorded, told=told)
    data = held_out(
        cfg, world, batch_given=any(o.startswith("data.batch_size=") for o in overrides)
    )
    cuda = uses_cuda(cfg.dist.backend)
    device = process_group.select_device(cuda, world)
    with process_group.initialized(world, device, timeout_s=cfg.dist.timeout_s):
        with device:
            model = build_model(cfg.model, cfg.data)
        load_weights(model, state["model"], path, "model")
        result = scoring.score(
            model,
            scoring.held_out_batches(data, cfg.data, world),
            device,
            autocast_for(device, cfg.trainer.precision),
            world,
        )
    return {
        "checkpoint": str(path),
        "step": state["step"],
        "loss": result.loss,
        "accuracy": result.accuracy,
        "held_out_predictions": result.predictions,
        "world_size": world.size,
        "overrides": overrides,
    }


def result_path(path: Path) -> Path:
    """`<run dir>/eval/step_<N>.json` for a run's checkpoint; `eval/` beside any other file."""
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return run / "eval" / f"{path.stem}.json"


def save(result: dict, out: Path) -> None:
    """Whole or not at all: a reader never finds half a JSON file, and two evaluations of one
    checkpoint at once each write their own before the rename."""
    out.parent.mkdir(exist_ok=True)
    write_atomically(out, json.dumps(result, indent=2) + "\n")


def usage() -> str:
    return (
        f"usage: python -m {PACKAGE}.evaluate [ckpt=<file|run dir|latest>] [key=value ...]\n\n"
        f"{__doc__.strip()}\n\nkey=value may set: {', '.join(ADJUSTABLE)}"
    )


def main() -> int:
    if any(arg in HELP for arg in sys.argv[1:]):  # before anything is read: no overrides, no files
        print(usage())
        return Exit.OK
    world = World.from_env()
    try:
        ckpt, overrides, told = parse(sys.argv[1:])
        path, state, note = find_checkpoint(ckpt, doing="scoring")
        if note and world.local_rank == 0:
            print(note, file=sys.stderr)
        result = evaluate(path, state, overrides, world, told)
    except (ConfigError, checkpoint.Incompatible) as err:
        if world.local_rank == 0:
            print(f"config error: {err}", file=sys.stderr)
        return Exit.CONFIG_ERROR
    except KeyboardInterrupt:
        if world.local_rank == 0:
            print(
                "evaluate: stopped by Ctrl-C before the score was complete; nothing saved",
                file=sys.stderr,
            )
        return Exit.INTERRUPTED
    if not world.main:
        return Exit.OK
    score = (
        f"{path}: loss {result['loss']:.4f}, accuracy {result['accuracy']:.3f} on "
        f"{result['held_out_predictions']} held-out predictions"
    )
    out = result_path(path)
    try:
        save(result, out)
    except OSError as err:  # the score was paid for: print it whatever the disk says
        print(score, flush=True)
        print(
            f"evaluate: could not save {out}: {err.strerror or err}; "
            "the score above is all there is",
            file=sys.stderr,
        )
        return Exit.FAILED
    print(f"{score} -> {out}")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())

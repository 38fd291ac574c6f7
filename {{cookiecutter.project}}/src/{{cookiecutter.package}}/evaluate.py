"""Evaluate a checkpoint on the held-out data its run never trained on, on one or more processes.

    python -m {{ cookiecutter.package }}.evaluate ckpt=latest                          # the newest checkpoint of the newest run in outputs/
    python -m {{ cookiecutter.package }}.evaluate ckpt=outputs/<run>                   # the newest checkpoint of that run
    python -m {{ cookiecutter.package }}.evaluate ckpt=outputs/<run>/checkpoints/step_000000300.pt data.batch_size=512
    torchrun --standalone --nproc-per-node 2 -m {{ cookiecutter.package }}.evaluate ckpt=latest

The model and data are the checkpoint's own (its config); overrides may change how the data is
read (batch size, workers, backend), not what it is. Each process scores its shard; the loss and
accuracy over all of them go to `<run dir>/eval/step_<N>.json` and to one printed line.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from {{ cookiecutter.package }} import checkpoint
from {{ cookiecutter.package }}.config import ConfigError, from_saved, uses_cuda
from {{ cookiecutter.package }}.data import build_dataset
from {{ cookiecutter.package }}.model import build_model
from {{ cookiecutter.package }}.trainer import AUTOCAST
from {{ cookiecutter.package }}.world import World

# What an evaluation may change in the checkpoint's config: how the data is read and where.
ADJUSTABLE = ("data.batch_size", "data.num_workers", "data.pin_memory", "dist.backend")


def find_checkpoint(ckpt: str, outputs: Path = Path("outputs")) -> Path:
    """A checkpoint file from `ckpt`: a file, a run dir (its newest), or latest (the newest run in
    outputs/ that has one: run names sort by their start time)."""
    if ckpt == "latest":
        runs = (
            sorted((p for p in outputs.iterdir() if p.is_dir()), reverse=True)
            if outputs.is_dir()
            else []
        )
        candidates = [p for p in runs if checkpoint.checkpoint_paths(p)]
        if not candidates:
            raise ConfigError(f"ckpt=latest: no run under {outputs}/ has a checkpoint")
        ckpt = str(candidates[0])
    path = Path(ckpt)
    if path.is_dir():
        found = checkpoint.newest_readable(path)
        if found is None:
            raise ConfigError(f"ckpt={ckpt}: no readable checkpoint in {path / 'checkpoints'}")
        return found[0]
    if not path.is_file():
        raise ConfigError(f"ckpt={ckpt}: no such file or run dir")
    return path


def parse(args: list[str]) -> tuple[str, list[str]]:
    ckpt, overrides = "latest", []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"{arg}: write ckpt=<file|run dir|latest> or key=value")
        if key == "ckpt":
            ckpt = value
        elif key in ADJUSTABLE:
            overrides.append(arg)
        else:
            raise ConfigError(
                f"{key}: the checkpoint's config decides it; an evaluation may set {', '.join(ADJUSTABLE)}"
            )
    return ckpt, overrides


def evaluate(path: Path, overrides: list[str], world: World) -> dict:
    state = checkpoint.read(path)
    cfg = from_saved(state["config"], overrides)
    cuda = uses_cuda(cfg.dist.backend)
    device = torch.device("cuda", world.local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    standalone = {} if world.launched else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=cfg.dist.timeout_s),
                            device_id=device if cuda else None, **standalone)  # fmt: skip
    try:
        with device:
            model = build_model(cfg.model, cfg.data)
        model.load_state_dict(state["model"])
        model.eval()
        data = build_dataset(cfg.data, cfg.trainer.seed, held_out=True)
        shard = DistributedSampler(
            data, num_replicas=world.size, rank=world.rank, shuffle=False, drop_last=True
        )
        loader = DataLoader(data, sampler=BatchSampler(shard, cfg.data.batch_size, drop_last=False),
                            batch_size=None, num_workers=cfg.data.num_workers)  # fmt: skip
        dtype = AUTOCAST.get(cfg.trainer.precision) if cuda else None
        sums = torch.zeros(
            3, device=device, dtype=torch.float64
        )  # loss x predictions, correct, predictions
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            for inputs, labels in loader:
                inputs, labels = inputs.to(device), labels.to(device)
                logits = model(inputs).flatten(0, -2)
                labels = labels.flatten()
                sums[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
                sums[1] += (logits.argmax(dim=-1) == labels).sum()
                sums[2] += labels.numel()
        dist.all_reduce(sums)
        loss_sum, correct, predictions = sums.tolist()
    finally:
        dist.destroy_process_group()
    return {
        "checkpoint": str(path),
        "step": state["step"],
        "loss": loss_sum / predictions,
        "accuracy": correct / predictions,
        "held_out_predictions": int(predictions),
        "world_size": world.size,
        "overrides": overrides,
    }


def main() -> int:
    world = World.from_env()
    try:
        ckpt, overrides = parse(sys.argv[1:])
        path = find_checkpoint(ckpt)
        result = evaluate(path, overrides, world)
    except (ConfigError, checkpoint.Incompatible) as err:
        if world.local_rank == 0:
            print(f"config error: {err}", file=sys.stderr)
        return 2
    if world.main:
        out = path.parent.parent / "eval" / f"{path.stem}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"{path}: loss {result['loss']:.4f}, accuracy {result['accuracy']:.3f} on "
              f"{result['held_out_predictions']} held-out predictions -> {out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The global batch: the samples of one optimizer step, processes × data.batch_size ×
trainer.grad_accumulation. Results depend on it, not on how many processes share it, so a run
resumed on another world size keeps it: the accumulation is adjusted, or the resume refused in
one line naming the figures. Pure functions: a launch's rank 0 checks before anything is written
(rundir.RunDirGuard), each worker adjusts the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GlobalBatch:
    processes: int
    batch_size: int  # data.batch_size: each process's micro-batch
    accumulation: int  # trainer.grad_accumulation: micro-batches per optimizer step

    @property
    def samples(self) -> int:
        return self.processes * self.batch_size * self.accumulation

    def __str__(self) -> str:
        return (
            f"{self.samples} samples ({self.processes} process(es) × data.batch_size "
            f"{self.batch_size} × trainer.grad_accumulation {self.accumulation})"
        )

    @classmethod
    def saved(cls, state: dict[str, Any]) -> GlobalBatch:
        """The figures a checkpoint was trained with: its config's, on its world size (those of
        one written before checkpoints recorded global_batch)."""
        config = state.get("config", {})
        figures = state.get("global_batch") or {
            "processes": state["world_size"],
            "batch_size": config["data"]["batch_size"],
            "accumulation": config["trainer"]["grad_accumulation"],
        }
        return cls(**figures)


KEYS = ("data.batch_size", "trainer.grad_accumulation")  # the config's figures of it


def accepted(accept_changes: list[str]) -> bool:
    """trainer.accept_changes names a figure of the global batch, or its group."""
    return any(key == name or key.startswith(f"{name}.") for key in KEYS for name in accept_changes)


class GlobalBatchChanged(Exception):
    """This world size cannot make the checkpoint's global batch from the config's batch size."""


def on_resume(
    saved: GlobalBatch, saved_config: dict[str, Any], now: GlobalBatch, accept: bool = False
) -> GlobalBatch:
    """The figures a resume trains with. The config's own, where they make the checkpoint's
    global batch, where `accept` (trainer.accept_changes names one of KEYS), or where
    data.batch_size or trainer.grad_accumulation was changed (a change the resume check refuses
    unless accepted); else, on another world size, the accumulation that keeps it; else
    GlobalBatchChanged."""
    as_saved = (
        saved_config.get("data", {}).get("batch_size") == now.batch_size
        and saved_config.get("trainer", {}).get("grad_accumulation") == now.accumulation
    )
    if now.samples == saved.samples or accept or not as_saved:
        return now
    per_micro_step = now.processes * now.batch_size
    if saved.samples % per_micro_step == 0:
        return GlobalBatch(now.processes, now.batch_size, saved.samples // per_micro_step)
    raise GlobalBatchChanged(
        f"the checkpoint's global batch is {saved}; {now.processes} process(es) cannot make "
        f"{saved.samples} from data.batch_size {now.batch_size}: {remedy(saved, now)}, or add "
        "trainer.accept_changes=[data.batch_size] to train on with another global batch"
    )


def remedy(saved: GlobalBatch, now: GlobalBatch) -> str:
    """The overrides that keep the global batch on now.processes, or the world sizes that can."""
    per_process, left = divmod(saved.samples, now.processes)
    if left == 0:
        batch = max(
            b for b in range(1, min(now.batch_size, per_process) + 1) if per_process % b == 0
        )
        return f"data.batch_size={batch} trainer.grad_accumulation={per_process // batch} keeps it"
    fits = [n for n in range(1, saved.samples + 1) if saved.samples % (n * now.batch_size) == 0]
    if not fits:
        return f"no batch size makes {saved.samples} samples on {now.processes} process(es)"
    return f"resume on {', '.join(map(str, fits[:8]))} process(es) to keep it"

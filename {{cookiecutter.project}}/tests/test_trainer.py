"""The loop's bookkeeping around its steps: when a log window's row reaches metrics.jsonl."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from {{ cookiecutter.package }} import metrics
from {{ cookiecutter.package }}.checkpoint import Checkpointer
from {{ cookiecutter.package }}.trainer import Trainer
from {{ cookiecutter.package }}.world import World


@pytest.fixture
def trainer_with(compose_train, tmp_path):
    def make(*overrides: str) -> Trainer:
        cfg = OmegaConf.to_object(compose_train("dist.backend=gloo", *overrides))
        (tmp_path / "run").mkdir(exist_ok=True)
        return Trainer(cfg, World(), torch.device("cpu"), tmp_path / "run")

    return make


def rows_in(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return (
        [json.loads(line)["step"] for line in path.read_text().splitlines()]
        if path.exists()
        else []
    )


def test_a_windows_row_is_on_disk_before_the_checkpoint_of_its_step(trainer_with, monkeypatch):
    """A row is written once the next step is queued, except at a checkpoint's step: a resume
    keeps the rows up to its checkpoint, so a kill before the next step must not lose it."""
    trainer = trainer_with(
        "trainer.max_steps=12", "trainer.log_every=2", "trainer.checkpoint_every=4"
    )
    seen, write = {}, Checkpointer.write

    def noting_rows(self, step):
        seen[step] = rows_in(trainer.run_dir)
        return write(self, step)

    monkeypatch.setattr(Checkpointer, "write", noting_rows)
    assert trainer.train() is False
    assert seen == {4: [2, 4], 8: [2, 4, 6, 8], 12: [2, 4, 6, 8, 10, 12]}


def test_a_step_that_fails_after_a_window_keeps_that_windows_row(trainer_with):
    trainer = trainer_with(
        "trainer.max_steps=20", "trainer.log_every=5", "trainer.checkpoint_every=0"
    )
    step = trainer.step

    def failing_at_step_6(*args, **kwargs):
        if trainer.progress.step == 5:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return step(*args, **kwargs)

    trainer.step = failing_at_step_6
    with pytest.raises(RuntimeError, match="illegal memory access"):
        trainer.train()
    assert rows_in(trainer.run_dir) == [5]


def test_a_row_whose_write_fails_is_not_written_again(trainer_with, monkeypatch):
    trainer = trainer_with(
        "trainer.max_steps=20", "trainer.log_every=5", "trainer.checkpoint_every=0"
    )
    calls = []

    def full_disk(self, row):
        calls.append(row["step"])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(metrics.RunRecord, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        trainer.train()
    assert calls == [5]

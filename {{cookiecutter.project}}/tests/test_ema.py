"""trainer.ema_decay and trainer.patience: the EMA's math, its validation and checkpoint state,
early stopping at the right validation, and both continued exactly by a resume."""

import logging
import shutil
import signal
import time

import pytest
import torch
from torch import nn

import ddp_project.data  # noqa: F401
import ddp_project.model  # noqa: F401
from ddp_project.record import metrics
from ddp_project.run import checkpoint, checkpoint_dcp, scoring, stopping
from ddp_project.run.ema import EMA
from ddp_project.run.trainer import Trainer


def signal_during_step(trainer: Trainer, step: int, signum: int) -> None:
    """`signum` arrives while `step` runs (as test_trainer's)."""
    trainer.preemption.signals = stopping.StopSignals()
    run_step = trainer.step

    def step_then_signal(*args, **kwargs):
        run_step(*args, **kwargs)
        if trainer.progress.step == step - 1:
            signal.raise_signal(signum)

    trainer.step = step_then_signal


def scored_as(monkeypatch, losses: list[float], weights: list | None = None) -> None:
    """Each scoring of the model's weights returns the next of `losses`; `weights` gets the
    first parameter of every module scored (the model's, then the EMA's)."""
    queue = list(losses)

    def score(model, *args, **kwargs):
        if weights is not None:
            weights.append(next(model.parameters()).detach().clone())
        loss = queue.pop(0) if queue else 9.0
        return scoring.Score(loss=loss, accuracy=0.5, predictions=10)

    monkeypatch.setattr(scoring, "score", score)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.norm = nn.BatchNorm1d(2)  # a buffer: running_mean
        self.out = nn.Linear(2, 2, bias=False)
        self.tied = self.out  # one weight under two names, as a tied GPT head


def test_each_update_moves_the_average_by_one_minus_decay_unless_skipped():
    module = Tiny()
    ema = EMA(module, decay=0.75)
    start = [p.detach().clone() for p in module.parameters()]
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    ema.update()
    for average, before, now in zip(ema.averages, start, module.parameters(), strict=True):
        assert torch.allclose(average, 0.75 * before + 0.25 * now)
    kept = [a.clone() for a in ema.averages]
    ema.update(skipped=torch.tensor(1.0))  # fp16's grad scaler skipped the step
    assert all(torch.equal(a, b) for a, b in zip(ema.averages, kept, strict=True))
    ema.update(skipped=torch.tensor(0.0))
    assert not any(torch.equal(a, b) for a, b in zip(ema.averages, kept, strict=True))
    assert all(a.dtype == torch.float32 for a in ema.averages)


def test_a_bf16_model_is_averaged_in_fp32():
    module = nn.Linear(4, 4).to(torch.bfloat16)
    ema = EMA(module, decay=0.999)
    assert all(a.dtype == torch.float32 for a in ema.averages)
    before = ema.averages[0].clone()
    with torch.no_grad():
        module.weight.add_(1.0)
    ema.update()
    expected = 0.999 * before + 0.001 * module.weight.float()
    assert torch.allclose(ema.averages[0], expected, rtol=0, atol=1e-7)
    assert not torch.equal(ema.averages[0], expected.bfloat16().float())  # finer than bf16


def test_its_state_is_keyed_as_the_models_and_loads_back_exactly():
    module = Tiny()
    ema = EMA(module, decay=0.5)
    with torch.no_grad():
        module.linear.weight.add_(2.0)
    ema.update()
    state, model_state = ema.state_dict(), module.state_dict()
    assert list(state) == list(model_state)  # out.weight and tied.weight, running_mean, ...
    assert state["out.weight"] is state["tied.weight"]
    assert torch.equal(state["norm.running_var"], model_state["norm.running_var"])
    assert torch.allclose(state["linear.weight"], model_state["linear.weight"] - 1.0)
    other = EMA(Tiny(), decay=0.5)
    other.load_state_dict({k: v.clone() for k, v in state.items()})
    assert all(torch.equal(a, b) for a, b in zip(other.averages, ema.averages, strict=True))
    with pytest.raises(KeyError):
        other.load_state_dict(state | {"extra.weight": torch.zeros(1)})


def test_swapped_in_scores_the_averages_and_puts_the_weights_back_bit_for_bit():
    module = Tiny()
    ema = EMA(module, decay=0.5)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(3.0)
    ema.update()
    weights = [p.detach().clone() for p in module.parameters()]
    averages = [a.clone() for a in ema.averages]
    with ema.swapped_in():
        assert all(torch.equal(p, a) for p, a in zip(module.parameters(), averages, strict=True))
    assert all(torch.equal(p, w) for p, w in zip(module.parameters(), weights, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(ema.averages, averages, strict=True))
    with pytest.raises(RuntimeError), ema.swapped_in():  # an error while scoring
        raise RuntimeError
    assert all(torch.equal(p, w) for p, w in zip(module.parameters(), weights, strict=True))


def test_the_trainer_averages_after_each_step_but_a_skipped_one(trainer_for):
    trainer = trainer_for("trainer.ema_decay=0.5", "trainer.on_nonfinite=skip")
    inputs, labels = torch.randn(128, 32), torch.randint(8, (128,))
    trainer.step([(inputs, labels)], ends_window=False)
    after_one = [a.clone() for a in trainer.ema.averages]
    bad = inputs.clone()
    bad[0, 0] = float("nan")
    trainer.step([(bad, labels)], ends_window=False)  # skipped: neither weights nor EMA move
    assert all(torch.equal(a, b) for a, b in zip(trainer.ema.averages, after_one, strict=True))
    before = [a.clone() for a in trainer.ema.averages]
    trainer.step([(inputs, labels)], ends_window=False)
    for average, old, weight in zip(
        trainer.ema.averages, before, trainer.module.parameters(), strict=True
    ):
        assert torch.allclose(average, 0.5 * old + 0.5 * weight)


def test_a_step_the_fp16_grad_scaler_skips_is_no_step_of_the_ema(trainer_for):
    """fp16 (on a GPU) drops a step with an inf gradient inside the grad scaler, with no sync:
    the EMA reads the scaler's finding on the device. Here a CPU scaler stands in for it."""
    trainer = trainer_for("trainer.ema_decay=0.5")
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    inputs, labels = torch.randn(128, 32), torch.randint(8, (128,))
    bad = inputs.clone()
    bad[0, 0] = float("inf")
    trainer.step([(inputs, labels)], ends_window=False)  # the average and the weights part
    kept = [a.clone() for a in trainer.ema.averages]
    trainer.step([(bad, labels)], ends_window=False)
    assert all(torch.equal(a, b) for a, b in zip(trainer.ema.averages, kept, strict=True))
    trainer.step([(inputs, labels)], ends_window=False)
    assert not any(torch.equal(a, b) for a, b in zip(trainer.ema.averages, kept, strict=True))


def test_validation_scores_the_ema_weights_too_and_the_checkpoint_holds_them(
    trainer_for, monkeypatch
):
    scored: list[torch.Tensor] = []
    scored_as(monkeypatch, [2.0, 1.5], scored)  # the model's, then the EMA's
    trainer = trainer_for(
        "trainer.ema_decay=0.9", "trainer.max_steps=4", "trainer.val_every=4", "trainer.log_every=4"
    )
    assert trainer.train() is False
    row = metrics.read_rows(trainer.run_dir)[-1]
    assert (row["val_loss"], row["val_loss_ema"]) == (2.0, 1.5)
    first = next(trainer.module.parameters())
    assert torch.equal(scored[0], first) and torch.equal(scored[1], trainer.ema.averages[0])
    assert not torch.equal(scored[0], scored[1])
    initial = trainer_for("trainer.ema_decay=0.9", run="initial").ema.averages[0]
    assert not torch.equal(scored[1], initial)  # four updates moved it
    saved = torch.load(trainer.run_dir / "checkpoints" / "step_000000004.pt", weights_only=True)
    assert list(saved["ema"]) == list(saved["model"])
    assert all(torch.equal(saved["ema"][k], v) for k, v in trainer.ema.state_dict().items())


def test_without_ema_no_column_is_filled_and_no_state_saved(trainer_for, monkeypatch):
    scored_as(monkeypatch, [2.0])
    trainer = trainer_for("trainer.max_steps=2", "trainer.val_every=2")
    assert trainer.ema is None and trainer.train() is False
    assert metrics.read_rows(trainer.run_dir)[-1]["val_loss_ema"] is None
    saved = torch.load(trainer.run_dir / "checkpoints" / "step_000000002.pt", weights_only=True)
    assert "ema" not in saved


EMA_RUN = (
    "trainer.ema_decay=0.8",
    "trainer.max_steps=12",
    "trainer.log_every=3",
    "trainer.checkpoint_every=100",
)


def test_a_stopped_and_resumed_run_keeps_the_ema_of_one_never_stopped(trainer_for):
    whole = trainer_for(*EMA_RUN, run="whole")
    assert whole.train() is False
    stopped = trainer_for(*EMA_RUN)
    signal_during_step(stopped, 7, signal.SIGTERM)
    assert stopped.train() is True
    resumed = trainer_for(*EMA_RUN)
    assert resumed.train() is False
    assert all(
        torch.equal(a, b) for a, b in zip(resumed.ema.averages, whole.ema.averages, strict=True)
    )
    initial = trainer_for(*EMA_RUN, run="initial").ema.averages  # the same seed's weights
    assert not any(
        torch.equal(a, b) for a, b in zip(initial, whole.ema.averages, strict=True)
    )  # it moved
    weights = zip(resumed.module.parameters(), whole.module.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in weights)


def test_a_dcp_checkpoint_holds_the_ema_of_its_step_not_of_a_step_during_its_write(
    trainer_for, monkeypatch
):
    """A DCP checkpoint's "ema" is in the shares, written in the background from a snapshot:
    the steps that run meanwhile must not reach it."""
    write = checkpoint_dcp.save

    def slow_write(*args, **kwargs):
        time.sleep(0.3)  # steps 5, 6, ... run meanwhile
        write(*args, **kwargs)

    monkeypatch.setattr(checkpoint_dcp, "save", slow_write)
    trainer = trainer_for(
        "trainer.ema_decay=0.5",
        "trainer.max_steps=8",
        "trainer.checkpoint_every=4",
        "trainer.checkpoint_format=dcp",
    )
    at_step_4 = {}
    run_step = trainer.step

    def step(*args, **kwargs):
        run_step(*args, **kwargs)
        if trainer.progress.step == 3:  # the step just run is step 4
            at_step_4.update({k: v.clone() for k, v in trainer.ema.state_dict().items()})

    trainer.step = step
    assert trainer.train() is False
    folder = trainer.run_dir / "checkpoints" / "step_000000004.dcp"
    assert "ema" not in torch.load(folder / "extra.pt", weights_only=True)
    saved = checkpoint.read(folder)["ema"]
    assert saved.keys() == at_step_4.keys()
    assert all(torch.equal(saved[k], v) for k, v in at_step_4.items())


def test_a_dcp_folder_with_its_ema_in_extra_pt_still_resumes_it(trainer_for, tmp_path):
    """Folders written before the EMA became a DCP share kept it in rank 0's extra.pt."""
    dcp_ema = ("trainer.ema_decay=0.5", "trainer.checkpoint_format=dcp")
    assert trainer_for(*dcp_ema, "trainer.max_steps=4").train() is False
    folder = tmp_path / "run" / "checkpoints" / "step_000000004.dcp"
    state = checkpoint.read(folder)
    extra = torch.load(folder / "extra.pt", weights_only=True) | {"ema": state["ema"]}
    shutil.rmtree(folder)
    tensors = {"model": state["model"], "optimizer": state["optimizer"]}
    checkpoint_dcp.save(folder, tensors, None, alone=True)
    torch.save(extra, folder / "extra.pt")
    resumed = trainer_for(*dcp_ema, "trainer.max_steps=6")
    resumed.resume()
    averages = resumed.ema.state_dict()
    assert all(torch.equal(averages[k], v) for k, v in state["ema"].items())
    assert not all(torch.equal(averages[k], state["model"][k]) for k in averages)  # an average


def test_ema_turned_on_at_a_resume_starts_from_the_checkpoints_weights(trainer_for, caplog):
    assert trainer_for("trainer.max_steps=3").train() is False
    with caplog.at_level(logging.INFO):
        resumed = trainer_for("trainer.max_steps=5", "trainer.ema_decay=0.9")
        resumed.resume()
    assert "trainer.ema_decay: the checkpoint has no EMA; it starts from its weights" in caplog.text
    weights = zip(resumed.ema.averages, resumed.module.parameters(), strict=True)
    assert all(torch.equal(a, w) for a, w in weights)


PATIENT = ("trainer.patience=2", "trainer.val_every=2", "trainer.log_every=2")


def test_patience_stops_at_the_validation_that_uses_it_up_with_a_checkpoint(
    trainer_for, monkeypatch, caplog
):
    """Validations at steps 2, 4, ...: 4 sets the best (1.0), 6 and 8 do not beat it (an equal
    loss is no new best): the run stops after step 8's, exit 0, with a checkpoint of step 8."""
    scored_as(monkeypatch, [3.0, 1.0, 1.5, 1.0, 0.5])
    trainer = trainer_for(*PATIENT, "trainer.max_steps=20", "trainer.checkpoint_every=100")
    with caplog.at_level(logging.INFO):
        assert trainer.train() is False  # a finished run, not a stopped one
    assert trainer.progress.step == 8
    assert (trainer.run_dir / "checkpoints" / "step_000000008.pt").exists()
    assert "early stopping at step 8: 2 validations without a val_loss below 1.0000" in caplog.text
    saved = torch.load(trainer.run_dir / "checkpoints" / "step_000000008.pt", weights_only=True)
    assert saved["patience"] == {"best": 1.0, "since_best": 2}

    # relaunched, it has nothing left to do
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = trainer_for(*PATIENT, "trainer.max_steps=20", "trainer.checkpoint_every=100")
        assert again.train() is False
    assert again.progress.step == 8 and "early stopping at step 8" in caplog.text
    # a larger patience at the resume counts on from 2: one more validation without a new best
    scored_as(monkeypatch, [1.2, 1.1])
    longer = trainer_for(
        "trainer.patience=3", *PATIENT[1:], "trainer.max_steps=20", "trainer.checkpoint_every=100"
    )
    assert longer.train() is False and longer.progress.step == 10


def test_a_new_best_resets_the_count(trainer_for, monkeypatch):
    scored_as(monkeypatch, [3.0, 3.5, 2.0, 2.5, 1.0, 1.1, 1.2])
    trainer = trainer_for(*PATIENT, "trainer.max_steps=40", "trainer.checkpoint_every=0")
    assert trainer.train() is False and trainer.progress.step == 14


def test_a_resume_stops_at_the_step_an_uninterrupted_run_stops_at(trainer_for, monkeypatch):
    """Stopped by SIGTERM at step 7 (after step 6's validation, one without a new best), the
    resumed run's count goes on from the checkpoint: it stops at step 8, as the whole run does."""
    losses = [3.0, 1.0, 1.5, 1.2, 0.5]
    run = (*PATIENT, "trainer.max_steps=20", "trainer.checkpoint_every=100")
    scored_as(monkeypatch, losses)
    whole = trainer_for(*run, run="whole")
    assert whole.train() is False and whole.progress.step == 8
    scored_as(monkeypatch, losses[:3])
    stopped = trainer_for(*run)
    signal_during_step(stopped, 7, signal.SIGTERM)
    assert stopped.train() is True and stopped.progress.step == 7
    scored_as(monkeypatch, losses[3:])
    resumed = trainer_for(*run)
    assert resumed.train() is False and resumed.progress.step == 8
    weights = zip(resumed.module.parameters(), whole.module.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in weights)

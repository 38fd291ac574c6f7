"""The training loop in-process, on one CPU process: its guards (a non-finite loss or gradient
stops a run or skips a step), its log windows (summed over ranks; a row reaches metrics.jsonl
before the checkpoint of its step), and how it stops for a signal."""

import gc
import json
import logging
import math
import signal
import weakref

import pytest
import torch
import torch.distributed as dist

# The options' builders, as train imports them.
import ddp_project.data  # noqa: F401
import ddp_project.model  # noqa: F401
from ddp_project.core.world import World
from ddp_project.record import metrics
from ddp_project.run import scoring, stopping
from ddp_project.run import trainer as trainer_module
from ddp_project.run.checkpoint import Checkpointer, Diverged
from ddp_project.run.trainer import Window, freeze_start_up_objects

ONE = World()


def checkpoint_names(run_dir) -> list[str]:
    """The step checkpoints, not best.pt (trainer.keep_best)."""
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))


def batch(value: float = 0.0):
    inputs = torch.randn(128, 32)
    inputs[0, 0] += value
    return inputs, torch.randint(8, (128,))


def test_a_non_finite_loss_stops_at_the_end_of_its_log_window(trainer_for):
    trainer = trainer_for("trainer.log_every=5")
    trainer.step([batch()], ends_window=False)
    trainer.step([batch(float("inf"))], ends_window=False)
    trainer.step([batch()], ends_window=True)
    with pytest.raises(Diverged, match="step 3: the loss is not finite"):
        trainer.log_row(3)


def test_skip_drops_the_update_of_a_non_finite_step_and_trains_on(trainer_for):
    trainer = trainer_for("trainer.on_nonfinite=skip")
    before = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    trainer.step([batch(float("nan"))], ends_window=False)
    assert all(torch.equal(before[k], v) for k, v in trainer.module.state_dict().items())
    trainer.step([batch()], ends_window=True)
    after = trainer.module.state_dict()
    assert not all(torch.equal(before[k], after[k]) for k in before)
    row = trainer.log_row(2)
    assert math.isfinite(row["loss"]) and row["grad_norm"] > 0  # the good step's


def test_skip_still_stops_when_every_step_of_a_window_is_non_finite(trainer_for):
    trainer = trainer_for("trainer.on_nonfinite=skip")
    for _ in range(2):
        trainer.step([batch(float("nan"))], ends_window=False)
    with pytest.raises(Diverged, match="every step since the last log line"):
        trainer.log_row(2)


def test_clipping_bounds_the_gradients_the_optimizer_sees_and_logs_the_norm(trainer_for):
    trainer = trainer_for("trainer.max_grad_norm=0.5")
    seen, step = [], trainer.optimizer.step

    def step_and_note(*args, **kwargs):
        grads = [p.grad for p in trainer.module.parameters() if p.grad is not None]
        seen.append(torch.nn.utils.get_total_norm(grads).item())
        return step(*args, **kwargs)

    trainer.optimizer.step = step_and_note
    trainer.step([batch(1e4)], ends_window=True)  # a large gradient
    assert seen == [pytest.approx(0.5, rel=1e-4)]
    assert trainer.log_row(1)["grad_norm"] > 10  # the norm before clipping is what is logged


def test_a_signal_before_the_first_step_stops_with_nothing_new_to_save(trainer_for, caplog):
    trainer_for("trainer.max_steps=5", "trainer.checkpoint_every=5").train()
    resumed = trainer_for("trainer.max_steps=50", "trainer.checkpoint_every=5")
    signals = resumed.preemption.signals = stopping.StopSignals()
    signals.signum = signal.SIGTERM  # came while the checkpoint loaded
    with caplog.at_level(logging.WARNING):
        assert resumed.train() is True
    assert resumed.progress.step == 5 and checkpoint_names(resumed.run_dir) == ["step_000000005.pt"]
    assert "SIGTERM: stopped before the first step, nothing new to save" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is not signals.handle  # handed back


def signal_during_step(trainer, step: int, signum: int) -> stopping.StopSignals:
    """`signum` arrives while `step` runs: after its micro-batches, before the ranks agree."""
    signals = trainer.preemption.signals = stopping.StopSignals()
    run_step = trainer.step

    def step_then_signal(*args, **kwargs):
        run_step(*args, **kwargs)
        if trainer.progress.step == step - 1:
            signal.raise_signal(signum)

    trainer.step = step_then_signal
    return signals


def test_sigint_stops_as_sigterm_does_and_exits_130(trainer_for, caplog):
    trainer = trainer_for("trainer.max_steps=50", "trainer.checkpoint_every=0")
    signals = signal_during_step(trainer, 3, signal.SIGINT)
    before = signal.getsignal(signal.SIGINT)  # pytest's, or what a test before this one left
    with caplog.at_level(logging.WARNING):
        assert trainer.train() is True
    assert trainer.progress.step == 3 and signals.exit_code == 130
    assert "SIGINT: stopped at step 3 (checkpoints are off)" in caplog.text
    assert signal.getsignal(signal.SIGINT) is before  # handed back


def test_sigterm_between_checkpoints_saves_at_the_step_it_stops_at(trainer_for, caplog):
    """The Trainer owns the stop: the step the ranks agree on is off the Checkpointer's
    schedule, and the Trainer has it saved there."""
    trainer = trainer_for("trainer.max_steps=50", "trainer.checkpoint_every=5")
    signals = signal_during_step(trainer, 7, signal.SIGTERM)
    with caplog.at_level(logging.WARNING):
        assert trainer.train() is True
    assert trainer.progress.step == 7 and signals.exit_code == 143
    assert checkpoint_names(trainer.run_dir) == ["step_000000005.pt", "step_000000007.pt"]
    assert "SIGTERM: stopped at step 7 with a checkpoint" in caplog.text
    assert signal.getsignal(signal.SIGTERM) is not signals.handle  # handed back


def test_a_run_stopped_mid_decay_resumes_to_the_weights_of_one_never_stopped(trainer_for):
    """Cosine decay over steps 3 to 12, a SIGTERM at step 7: the resumed run takes each step's
    rate from the step alone, and ends bit for bit where the uninterrupted run does, having
    logged the same rates, min_lr at the last step."""
    decaying = (
        "trainer.schedule=cosine",
        "trainer.warmup_steps=2",
        "trainer.max_steps=12",
        "trainer.log_every=3",
        "trainer.checkpoint_every=100",
    )
    whole = trainer_for(*decaying, run="whole")
    assert whole.train() is False
    stopped = trainer_for(*decaying)
    signal_during_step(stopped, 7, signal.SIGTERM)
    assert stopped.train() is True and checkpoint_names(stopped.run_dir) == ["step_000000007.pt"]
    resumed = trainer_for(*decaying)
    assert resumed.train() is False
    weights = resumed.module.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in whole.module.state_dict().items())
    logged = [
        [(row["step"], row["lr"]) for row in metrics.read_rows(trainer.run_dir)]
        for trainer in (whole, resumed)
    ]
    assert logged[0] == logged[1] and logged[0][-1] == (12, pytest.approx(0.0003))
    assert len({lr for _, lr in logged[0]}) == 4  # a rate of its own at every logged step


def test_a_log_window_sums_over_every_rank_and_all_stop_on_one_ranks_nan(monkeypatch):
    """Window.close all-reduces its sums: rank 0 logs the mean over every rank's samples, and a
    non-finite loss on any rank stops them all at the same step."""
    other_rank = {"loss": 30.0, "correct": 7.0, "nonfinite": 0.0, "failed_write": 0.0}  # its sums

    def all_reduce(tensor, *args, **kwargs):  # the other rank's share arrives
        tensor += torch.tensor(list(other_rank.values()))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    two = World(rank=0, size=2)
    window = Window(torch.device("cpu"), step=0)
    window.add(torch.tensor(1.0), samples=10, grad_norm=torch.tensor(2.0))
    window.add_accuracy(torch.eye(4)[[0, 1, 2, 3]], torch.tensor([0, 1, 2, 0]))  # 3 of 4 right
    totals = window.close(step=1, world=two)
    assert totals["loss"] == pytest.approx((10.0 + 30.0) / (10 * 2))
    assert totals["accuracy"] == pytest.approx((3 + 7) / (4 * 2))
    assert totals["failed_write"] is False
    # rank 0's background checkpoint write failed: every rank hears of it in the same sum
    other_rank["failed_write"] = 1.0
    window.add(torch.tensor(1.0), samples=10, grad_norm=None)
    assert window.close(step=2, world=two)["failed_write"] is True
    other_rank["loss"], other_rank["failed_write"] = math.nan, 0.0
    window.add(torch.tensor(1.0), samples=10, grad_norm=None)
    with pytest.raises(Diverged, match="step 3: the loss is not finite"):
        window.close(step=3, world=two)


def test_a_non_finite_gradient_norm_stops_even_when_the_loss_is_finite():
    """An overflowing gradient with a finite loss: the norm's own check stops the run."""
    window = Window(torch.device("cpu"), step=0)
    window.add(torch.tensor(1.0), samples=10, grad_norm=torch.tensor(math.inf))
    with pytest.raises(Diverged, match="step 1: the gradient norm is not finite"):
        window.close(step=1, world=ONE)


def rows_in(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return (
        [json.loads(line)["step"] for line in path.read_text().splitlines()]
        if path.exists()
        else []
    )


def test_a_windows_row_is_on_disk_before_the_checkpoint_of_its_step(trainer_for, monkeypatch):
    """A row is written once the next step is queued, except at a checkpoint's step: a resume
    keeps the rows up to its checkpoint, so a kill before the next step must not lose it."""
    trainer = trainer_for(
        "trainer.max_steps=12", "trainer.log_every=2", "trainer.checkpoint_every=4"
    )
    seen, write = {}, Checkpointer.write

    def noting_rows(self, step, *args, **kwargs):
        seen[step] = rows_in(trainer.run_dir)
        return write(self, step, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "write", noting_rows)
    assert trainer.train() is False
    assert seen == {4: [2, 4], 8: [2, 4, 6, 8], 12: [2, 4, 6, 8, 10, 12]}


def test_a_step_that_fails_after_a_window_keeps_that_windows_row(trainer_for):
    trainer = trainer_for(
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


def test_a_row_whose_write_fails_is_not_written_again(trainer_for, monkeypatch):
    trainer = trainer_for(
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


# --- validation while training, and the best checkpoint ---------------------------------------


def rows_of(run_dir) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").open())}


def test_sigterm_during_validation_cuts_it_short_and_saves_at_its_step(trainer_for, caplog):
    """A stop signal while the held-out data is scored: no more batches are scored, every rank
    learns of it at once, and the run stops at that step as between steps (a checkpoint, one
    line, exit 143); the figures cut short are neither logged nor a best checkpoint."""
    trainer = trainer_for(
        "trainer.max_steps=50",
        "trainer.checkpoint_every=10",
        "trainer.val_every=4",
        "trainer.log_every=100",
    )
    signals = trainer.preemption.signals = stopping.StopSignals()
    held_out, scored = trainer.held_out, []

    class SignalledDuring:
        """The held-out batches; at step 8's validation, SIGTERM after its first batch."""

        def __iter__(self):
            for i, batch in enumerate(held_out):
                if trainer.progress.step == 8 and i == 1:
                    signal.raise_signal(signal.SIGTERM)
                scored.append(trainer.progress.step)
                yield batch

    trainer.held_out = SignalledDuring()
    agreed_now, asked = trainer.preemption.agreed_now, []  # the blocking exchange, after each
    trainer.preemption.agreed_now = lambda: asked.append(trainer.progress.step) or agreed_now()
    with caplog.at_level(logging.INFO):
        assert trainer.train() is True
    assert len(held_out) > 3 and scored.count(4) == len(held_out) and scored.count(8) == 2
    assert asked == [4, 8]  # on several ranks the others learn of it there, not steps later
    assert trainer.progress.step == 8 and signals.exit_code == 143
    assert checkpoint_names(trainer.run_dir) == ["step_000000008.pt"]
    assert "SIGTERM: stopped at step 8 with a checkpoint, its validation cut short" in caplog.text
    rows = rows_of(trainer.run_dir)
    assert rows[4]["val_loss"] > 0 and rows[8]["val_loss"] is None and rows[8]["loss"] > 0
    best = torch.load(trainer.run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert (best["step"], best["val_loss"]) == (4, rows[4]["val_loss"])


def scored_as(monkeypatch, losses: list[float], weights: dict[int, dict] | None = None) -> None:
    """Each validation scores the next of `losses`; `weights` gets the model's, by step."""
    queue = list(losses)

    def score(model, *args, **kwargs):
        if weights is not None:
            weights[len(weights) + 1] = {k: v.clone() for k, v in model.state_dict().items()}
        return scoring.Score(loss=queue.pop(0), accuracy=0.5, predictions=10)

    monkeypatch.setattr(scoring, "score", score)


def test_the_best_checkpoint_survives_the_keep_policy_and_a_resume_goes_on_tracking_it(
    trainer_for, monkeypatch
):
    every = ("trainer.val_every=2", "trainer.checkpoint_every=2", "trainer.keep_checkpoints=2")
    weights: dict[int, dict] = {}
    scored_as(monkeypatch, [3.0, 1.0, 2.0, 4.0, 5.0], weights)  # steps 2, 4, ... 10
    trainer = trainer_for("trainer.max_steps=10", *every)
    assert not trainer.train()
    best_path = trainer.run_dir / "checkpoints" / "best.pt"
    assert checkpoint_names(trainer.run_dir) == ["step_000000008.pt", "step_000000010.pt"]
    best = torch.load(best_path, weights_only=True)
    assert (best["step"], best["val_loss"]) == (4, 1.0)
    assert all(torch.equal(best["model"][k], v) for k, v in weights[2].items())  # step 4's
    assert not all(torch.equal(best["model"][k], v) for k, v in weights[5].items())
    assert [rows_of(trainer.run_dir)[s]["val_loss"] for s in (2, 4, 6, 8, 10)] == [3, 1, 2, 4, 5]

    scored_as(monkeypatch, [1.5])  # worse than best.pt's 1.0: kept
    assert not trainer_for("trainer.max_steps=12", *every).train()
    assert torch.load(best_path, weights_only=True)["step"] == 4
    scored_as(monkeypatch, [0.5])  # better: replaced
    assert not trainer_for("trainer.max_steps=14", *every).train()
    assert torch.load(best_path, weights_only=True)["step"] == 14
    assert checkpoint_names(trainer.run_dir) == ["step_000000012.pt", "step_000000014.pt"]


def test_validation_is_off_at_val_every_0_and_keeps_no_best(trainer_for, monkeypatch):
    scored_as(monkeypatch, [])  # any validation would fail: none is queued
    trainer = trainer_for(
        "trainer.max_steps=4",
        "trainer.val_every=0",
        "trainer.log_every=2",
        "trainer.checkpoint_every=2",
    )
    assert trainer.held_out is None and not trainer.train()
    assert all(row["val_loss"] is None for row in rows_of(trainer.run_dir).values())
    assert not (trainer.run_dir / "checkpoints" / "best.pt").exists()


def test_a_resume_that_moves_max_steps_says_so_even_during_the_warm_up(trainer_for, caplog):
    """The rate of the next step is the same there, but where the decay ends has moved."""
    trainer = trainer_for("trainer.max_steps=80", "trainer.warmup_steps=20")
    trainer.progress.step = 10
    with caplog.at_level(logging.WARNING):
        trainer.report_stretched_decay(old_max_steps=60)
    assert "trainer.max_steps changed from 60 to 80:" in caplog.text
    assert "the decay now ends at step 80" in caplog.text


def test_a_signal_after_the_last_held_out_batch_keeps_the_scores_then_stops(trainer_for, caplog):
    trainer = trainer_for(
        "trainer.max_steps=50",
        "trainer.checkpoint_every=10",
        "trainer.val_every=4",
        "trainer.log_every=100",
    )
    trainer.preemption.signals = stopping.StopSignals()
    held_out = trainer.held_out

    class SignalledAfter:
        def __iter__(self):
            yield from held_out
            if trainer.progress.step == 8:
                signal.raise_signal(signal.SIGTERM)

    trainer.held_out = SignalledAfter()
    with caplog.at_level(logging.INFO):
        assert trainer.train() is True
    assert trainer.progress.step == 8 and checkpoint_names(trainer.run_dir) == ["step_000000008.pt"]
    assert "SIGTERM: stopped at step 8 with a checkpoint;" in caplog.text  # nothing was cut short
    rows = rows_of(trainer.run_dir)
    best = torch.load(trainer.run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert rows[8]["val_loss"] < rows[4]["val_loss"] and best["step"] == 8


def test_val_batches_caps_each_validation_and_each_batch_tells_the_watchdog(trainer_for):
    """A large held-out set: the first val_batches batches of each shard, and a heartbeat per
    batch, so that a long validation is never taken for a stalled collective."""
    trainer = trainer_for("trainer.max_steps=4", "trainer.val_every=2", "trainer.val_batches=3")
    beats = []
    trainer.watchdog = type("Heartbeat", (), {"beat": lambda self: beats.append(1)})()
    assert not trainer.train()
    rows = rows_of(trainer.run_dir)
    assert len(trainer.held_out) > 3 and [rows[s]["val_loss"] > 0 for s in (2, 4)] == [True, True]
    assert len(beats) == 4 + 2 * 3  # a beat per step, and one per scored batch


class Cycle:
    """Garbage only a full collection frees: it refers to itself."""

    def __init__(self):
        self.me = self


def test_start_up_objects_are_collected_and_frozen_on_a_gpu_and_left_alone_on_a_cpu():
    """Frozen objects are out of every later full collection, which is then short (figures in
    docs/performance.md); collected first, start-up's garbage is not kept for the whole run."""
    gc.unfreeze()
    gc.disable()  # no automatic collection frees the garbage before the one tested
    try:
        assert freeze_start_up_objects(torch.device("cpu")) is False
        assert gc.get_freeze_count() == 0
        garbage = weakref.ref(Cycle())
        assert garbage() is not None
        assert freeze_start_up_objects(torch.device("cuda")) is True  # touches no GPU: gc only
        assert garbage() is None and gc.get_freeze_count() > 10_000
    finally:
        gc.enable()
        gc.unfreeze()


def freezing_as_on_a_gpu(monkeypatch, trainer):
    """The loop's freeze made as on a GPU, for a trainer on the CPU: the devices it was asked
    for, and whether anything was frozen before each step."""
    calls, frozen_before_each_step = [], []

    def freeze(device):
        calls.append(device)
        return freeze_start_up_objects(torch.device("cuda"))

    monkeypatch.setattr(trainer_module, "freeze_start_up_objects", freeze)
    step = trainer.step

    def counted_step(*args, **kwargs):
        frozen_before_each_step.append(gc.get_freeze_count() > 0)
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer, "step", counted_step)
    return calls, frozen_before_each_step


def test_the_loop_freezes_start_up_objects_after_the_first_step_and_thaws_them_at_its_end(
    trainer_for, monkeypatch
):
    """Thawed: finish_together's collection frees DDP's cycles, and a sweep's jobs run one after
    another in a process, each one's model collectable once it ends."""
    trainer = trainer_for("trainer.max_steps=3", "trainer.val_every=0")
    calls, frozen_before_each_step = freezing_as_on_a_gpu(monkeypatch, trainer)
    try:
        assert not trainer.train()
        assert calls == [trainer.device] and frozen_before_each_step == [False, True, True]
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_a_loop_that_fails_after_its_first_step_thaws_too(trainer_for, monkeypatch):
    trainer = trainer_for("trainer.max_steps=3", "trainer.val_every=0")
    freezing_as_on_a_gpu(monkeypatch, trainer)
    step = trainer.step

    def failing_second(*args, **kwargs):
        if trainer.progress.step == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer, "step", failing_second)
    try:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            trainer.train()
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_a_cpu_loop_leaves_a_freeze_it_did_not_make(trainer_for):
    """A user's own gc.freeze (before forking workers, as Python's docs advise) is theirs."""
    trainer = trainer_for("trainer.max_steps=2", "trainer.val_every=0")
    gc.freeze()
    try:
        assert not trainer.train()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()

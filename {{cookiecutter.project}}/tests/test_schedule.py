"""The learning rate at chosen steps: the warm-up, then each schedule down to trainer.min_lr."""

import math

import pytest
from omegaconf import OmegaConf

from ddp_project.run.schedule import learning_rate

LR, MIN_LR = 0.003, 0.0003  # trainer.lr and trainer.min_lr, given so that the values below hold


@pytest.fixture
def rates(compose_train):
    """rates(schedule, warmup_steps, max_steps, steps): the learning rate at each of the steps."""

    def at(schedule: str, warmup: int, max_steps: int, steps: list[int]) -> list[float]:
        cfg = compose_train(
            f"trainer.schedule={schedule}",
            f"trainer.warmup_steps={warmup}",
            f"trainer.max_steps={max_steps}",
            f"trainer.lr={LR}",
            f"trainer.min_lr={MIN_LR}",
        )
        trainer = OmegaConf.to_object(cfg).trainer
        return [learning_rate(trainer, step) for step in steps]

    return at


# 10 steps of warm-up, 100 of decay: step 60 is half way, 85 three quarters, 110 the last.
STEPS = [1, 5, 10, 11, 60, 85, 110]
WARM_UP = [LR / 10, LR / 2, LR]


@pytest.mark.parametrize(
    ("schedule", "after_warm_up"),
    [
        ("constant", [LR, LR, LR, LR]),
        ("linear", [LR - (LR - MIN_LR) / 100, 0.00165, 0.000975, MIN_LR]),
        (
            "cosine",
            [
                MIN_LR + (LR - MIN_LR) * (1 + math.cos(math.pi / 100)) / 2,
                0.00165,
                MIN_LR + (LR - MIN_LR) * (1 - math.sqrt(0.5)) / 2,
                MIN_LR,
            ],
        ),
    ],
)
def test_a_linear_warm_up_then_the_schedule_down_to_min_lr_at_max_steps(
    rates, schedule, after_warm_up
):
    assert rates(schedule, 10, 110, STEPS) == pytest.approx(WARM_UP + after_warm_up, rel=1e-12)


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_the_last_step_runs_at_min_lr_exactly_and_so_do_steps_past_it(rates, schedule):
    """Past max_steps: the rate a finished run had gone on at, which a resume that raises
    max_steps compares with its own (Trainer.report_stretched_decay)."""
    assert rates(schedule, 10, 110, [110, 111, 500]) == [MIN_LR] * 3


def test_without_warm_up_the_first_step_runs_at_lr_or_just_below_it(rates):
    assert rates("constant", 0, 100, [1, 100]) == [LR, LR]
    first, last = rates("cosine", 0, 100, [1, 100])
    assert MIN_LR < first < LR and first == pytest.approx(LR, rel=1e-3) and last == MIN_LR


def test_a_warm_up_as_long_as_the_run_never_decays(rates):
    """warmup_steps >= max_steps is allowed: the run ends in its warm-up (at lr if equal)."""
    assert rates("cosine", 20, 10, [1, 10]) == pytest.approx([LR / 20, LR / 2], rel=1e-12)
    assert rates("linear", 20, 20, [20]) == [LR]


def test_min_lr_null_is_a_tenth_of_lr_so_an_lr_given_alone_brings_its_floor(compose_train):
    """The default: lowering trainer.lr alone lowers the floor with it (a number would stand
    above it and be refused)."""
    last = {}
    for lr in (0.003, 0.0001):
        cfg = OmegaConf.to_object(compose_train(f"trainer.lr={lr}", "trainer.max_steps=50"))
        assert cfg.trainer.min_lr is None
        last[lr] = learning_rate(cfg.trainer, 50)
    assert last == {0.003: pytest.approx(0.0003), 0.0001: pytest.approx(0.00001)}

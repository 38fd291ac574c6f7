"""The optimizer group: any torch.optim class by _target_, decay on matrices only, every bad key
one line before anything starts, and a resume that changes it refused unless accepted."""

import logging
import subprocess
import sys

import pytest
import torch
from conftest import PACKAGE, launch
from omegaconf import OmegaConf

import ddp_project.data  # noqa: F401
import ddp_project.model  # noqa: F401
from ddp_project.config.compose import config_problem
from ddp_project.config.error import ConfigError
from ddp_project.config.optimizer import check_optimizer, try_optimizer, upgraded
from ddp_project.core.world import World
from ddp_project.run import rundir
from ddp_project.run.trainer import Trainer

ONE = World()
TINY_GPT = (
    "model=gpt",
    "data=tokens",
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=16",
    "data.seq_len=8",
    "data.vocab_size=32",
)


def names_in(trainer: Trainer, group: dict) -> set[str]:
    ids = {id(p) for p in group["params"]}
    return {name for name, p in trainer.module.named_parameters() if id(p) in ids}


def test_weights_and_embeddings_decay_biases_and_layer_norms_do_not(trainer_for):
    trainer = trainer_for(*TINY_GPT, "optimizer.weight_decay=0.1")
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    decayed, other = trainer.optimizer.param_groups
    assert names_in(trainer, decayed) == {
        "tokens.weight",
        "positions.weight",
        "blocks.0.qkv.weight",
        "blocks.0.projection.weight",
        "blocks.0.mlp.0.weight",
        "blocks.0.mlp.2.weight",
        "head.weight",
    }
    assert "blocks.0.attention_norm.weight" in names_in(trainer, other)
    assert all(n.endswith("bias") or "norm" in n for n in names_in(trainer, other))
    assert (decayed["weight_decay"], other["weight_decay"]) == (0.1, 0.0)
    assert decayed["betas"] == other["betas"] == (0.9, 0.999) and decayed["eps"] == 1e-8


def test_betas_and_eps_reach_the_optimizer(trainer_for):
    trainer = trainer_for("optimizer.betas=[0.8,0.95]", "optimizer.eps=1e-6")
    for group in trainer.optimizer.param_groups:
        assert (group["betas"], group["eps"]) == ((0.8, 0.95), 1e-6)


def test_a_target_of_sgd_builds_sgd_over_the_same_groups_and_trains(trainer_for):
    trainer = trainer_for("optimizer=sgd", "trainer.max_steps=3", "trainer.checkpoint_every=0")
    assert type(trainer.optimizer) is torch.optim.SGD
    decayed, other = trainer.optimizer.param_groups
    assert all(p.dim() >= 2 for p in decayed["params"]) and decayed["params"]
    assert all(p.dim() < 2 for p in other["params"]) and other["params"]
    assert (decayed["weight_decay"], other["weight_decay"]) == (0.0001, 0.0)
    assert decayed["momentum"] == 0.9 and decayed["nesterov"] is True
    before = [p.clone() for p in trainer.module.parameters()]
    assert trainer.train() is False
    assert all(
        not torch.equal(a, b) for a, b in zip(before, trainer.module.parameters(), strict=True)
    )
    assert "momentum_buffer" in trainer.optimizer.state[decayed["params"][0]]


REFUSED = [
    (
        "optimizer._target_=torch.nn.Linear",
        "optimizer._target_=torch.nn.Linear: must be a torch.optim.Optimizer subclass by import "
        "path, e.g. torch.optim.AdamW or torch.optim.SGD",
    ),
    ("optimizer._target_=torch.optim.Adamm", "optimizer._target_=torch.optim.Adamm: must be a"),
    ("optimizer._target_=", "optimizer._target_=: must be a torch.optim.Optimizer subclass"),
    ("optimizer._target_=torch.optim.LBFGS", "optimizer._target_=torch.optim.LBFGS: needs a"),
    (
        "+optimizer.kwargs.momentum=0.9",
        "optimizer.kwargs.momentum: torch.optim.AdamW takes no keyword momentum; it takes: "
        "amsgrad, capturable, differentiable, foreach, maximize",
    ),
    ("+optimizer.kwargs.lr=1", "optimizer.kwargs.lr: set trainer.lr, the schedule's peak"),
    ("+optimizer.kwargs.amsgrad=maybe", "optimizer.kwargs.amsgrad=maybe: must be true or false"),
    ("+optimizer.kwargs.amsgrad=1", "optimizer.kwargs.amsgrad=1: must be true or false"),
    ("optimizer=sgd optimizer.kwargs.momentum=fast", "optimizer.kwargs.momentum=fast: must be a"),
    ("optimizer=sgd optimizer.kwargs.momentum=true", "optimizer.kwargs.momentum=True: must be a"),
    (
        "optimizer=sgd optimizer.betas=[0.9,0.99]",
        "optimizer.betas=[0.9, 0.99]: torch.optim.SGD takes none; set it to null",
    ),
    (
        "optimizer=sgd optimizer.kwargs.momentum=-1",
        "optimizer: torch.optim.SGD refuses its keywords: Invalid momentum value: -1",
    ),
    (
        "+optimizer.kwargs.capturable=true dist.backend=gloo",
        "optimizer: torch.optim.AdamW fails a step on the CPU with its keywords: If "
        "capturable=True, params and state_steps must be on supported devices:",
    ),
    (
        "optimizer._target_=torch.optim.Rprop optimizer.betas=null optimizer.eps=null",
        "optimizer.weight_decay=0.01: torch.optim.Rprop has no weight decay; set it to 0",
    ),
    ("optimizer.betas=[0.9,1.0]", "optimizer.betas=[0.9, 1.0]: must be null (the optimizer's"),
    ("optimizer.betas=[-0.1,0.9]", "optimizer.betas=[-0.1, 0.9]: must be null"),
    ("optimizer.betas=[0.9]", "optimizer.betas=[0.9]: must be null"),
    ("optimizer.eps=0", "optimizer.eps=0.0: must be null (the optimizer's default) or a finite"),
    ("optimizer.eps=-1e-8", "optimizer.eps=-1e-08: must be null"),
    ("optimizer.eps=nan", "optimizer.eps=nan: must be null"),
    ("optimizer.weight_decay=-1", "optimizer.weight_decay=-1.0: must be a finite number, 0 or"),
    ("trainer.ema_decay=1", "trainer.ema_decay=1.0: must be null (no EMA) or a number between"),
    ("trainer.ema_decay=0", "trainer.ema_decay=0.0: must be null (no EMA)"),
    ("trainer.ema_decay=nan", "trainer.ema_decay=nan: must be null (no EMA)"),
    ("trainer.patience=0", "trainer.patience=0: must be null (no early stopping) or at least 1"),
    (
        "trainer.patience=3 trainer.val_every=0",
        "trainer.patience=3: counts validations without a new best val_loss: set "
        "trainer.val_every above 0, or trainer.patience=null",
    ),
]


@pytest.mark.parametrize(("overrides", "line"), REFUSED)
def test_each_bad_optimizer_ema_or_patience_key_is_one_line(overrides, line):
    problem = config_problem(overrides.split())
    assert problem is not None and "\n" not in problem
    assert problem.startswith(line), problem


def test_a_keyword_only_a_gpu_takes_passes_for_workers_on_gpus(compose_train):
    """capturable=true fails a step on the CPU, not on a GPU: a worker on a GPU leaves that to
    its first step, rather than hold the GPU for a trial."""
    cfg = OmegaConf.to_object(compose_train("+optimizer.kwargs.capturable=true"))
    try_optimizer(cfg.optimizer, cfg.trainer.lr, on_cuda=True)
    with pytest.raises(ConfigError, match="fails a step on the CPU"):
        try_optimizer(cfg.optimizer, cfg.trainer.lr, on_cuda=False)


def test_the_launcher_checks_the_keywords_without_building_the_optimizer(compose_train):
    """Building one imports dynamo (seconds): the launcher checks what the class takes, each
    worker what it accepts, as its first line."""
    cfg = OmegaConf.to_object(compose_train("optimizer=sgd", "optimizer.kwargs.momentum=-1"))
    check_optimizer(cfg.optimizer)
    with pytest.raises(ConfigError, match="refuses its keywords: Invalid momentum value: -1"):
        try_optimizer(cfg.optimizer, cfg.trainer.lr, on_cuda=False)


def test_a_value_the_class_refuses_ends_the_launch_in_the_workers_first_line(tmp_path):
    """Through the real launcher: one line, exit 2, no run dir."""
    momentum = ("optimizer=sgd", "optimizer.kwargs.momentum=-1")
    done = launch(tmp_path, "--nproc-per-node", "1", *momentum, "hydra.run.dir=run")
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines() == [
        "config error: optimizer: torch.optim.SGD refuses its keywords: Invalid momentum value: -1"
    ]
    assert list(tmp_path.iterdir()) == []


def test_other_optimizers_and_their_keywords_pass():
    assert config_problem(["optimizer=sgd"]) is None
    assert config_problem(["+optimizer.kwargs.amsgrad=true"]) is None
    rprop = ["optimizer._target_=torch.optim.Rprop", "optimizer.weight_decay=0"]
    assert config_problem([*rprop, "optimizer.betas=null", "optimizer.eps=null"]) is None


def test_train_refuses_a_bad_target_with_exit_2_before_any_process(tmp_path):
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", f"hydra.run.dir={run}"]
        + ["optimizer._target_=torch.optim.Nope"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("config error: optimizer._target_=torch.optim.Nope: must be")
    assert done.stderr.count("\n") == 1 and not run.exists()


def test_a_resume_that_changes_the_optimizer_is_refused_unless_accepted(
    trainer_for, compose_train, caplog
):
    steps = ("trainer.max_steps=4", "trainer.checkpoint_every=2")
    first = trainer_for(*steps)
    assert first.train() is False

    def problem(*overrides):
        cfg = OmegaConf.to_object(compose_train(*steps, *overrides))
        return rundir.resume_problem(first.run_dir, cfg, ONE)

    assert problem() is None
    assert "optimizer.betas [0.9, 0.999] -> [0.9, 0.95]" in problem("optimizer.betas=[0.9,0.95]")
    assert "trainer.accept_changes=[optimizer.betas]" in problem("optimizer.betas=[0.9,0.95]")
    refused = problem("optimizer=sgd")
    assert "optimizer._target_ 'torch.optim.AdamW' -> 'torch.optim.SGD'" in refused
    assert "trainer.accept_changes=[optimizer._target_," in refused
    assert problem("optimizer=sgd", "trainer.accept_changes=[optimizer]") is None
    assert "trainer.ema_decay None -> 0.9" in problem("trainer.ema_decay=0.9")

    # accepted: the new settings train, not the checkpoint's
    betas = trainer_for("trainer.max_steps=6", "optimizer.betas=[0.5,0.6]")
    betas.resume()
    assert all(g["betas"] == (0.5, 0.6) for g in betas.optimizer.param_groups)
    assert betas.optimizer.state  # AdamW's moments came back
    with caplog.at_level(logging.WARNING):
        sgd = trainer_for("trainer.max_steps=6", "optimizer=sgd")
        sgd.resume()
    assert "optimizer._target_ changed from torch.optim.AdamW to torch.optim.SGD" in caplog.text
    assert not sgd.optimizer.state and sgd.optimizer.param_groups[0]["momentum"] == 0.9
    assert sgd.train() is False and sgd.progress.step == 6


def test_a_checkpoint_from_before_the_optimizer_group_reads_as_the_adamw_it_trained_with(
    compose_train,
):
    now = OmegaConf.to_container(compose_train("optimizer.betas=null", "optimizer.eps=null"))
    old = {key: value for key, value in now.items() if key != "optimizer"}
    old["trainer"] = {
        key: value for key, value in now["trainer"].items() if key not in ("ema_decay", "patience")
    } | {"weight_decay": 0.01, "fused_optimizer": True}
    assert upgraded(old)["optimizer"] == now["optimizer"]
    assert upgraded(old)["trainer"] == now["trainer"]
    assert upgraded(now) is now

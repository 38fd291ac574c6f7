"""A model and a data set added through the registry alone, as the README's "Adding a model, a
dataset or a logger" says: a YAML file in configs/<group>/ and a registered schema and builder for
each, no other edit. They compose, are checked, train and are scored, in this process."""

import json
import shutil
from dataclasses import dataclass
from importlib.resources import files

import pytest
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING
from torch import nn
from torch.utils.data import TensorDataset

from ddp_project import evaluate, registry
from ddp_project.check import compose_and_check
from ddp_project.config import HELD_OUT, DataConfig, register_configs
from ddp_project.config_error import ConfigError, require
from ddp_project.trainer import Trainer
from ddp_project.world import World


@dataclass
class SignsConfig(DataConfig):
    """The signs option (its YAML, signs.yaml, written into a copy of configs/data): Gaussian points
    labelled by the sign of their sum."""

    width: int = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.width >= 1, "data.width", self.width, "must be at least 1")


def signs(cfg: SignsConfig, seed: int, held_out: bool) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed + held_out)
    inputs = torch.randn(
        cfg.num_samples // (HELD_OUT if held_out else 1), cfg.width, generator=generator
    )
    return TensorDataset(inputs, (inputs.sum(dim=1) > 0).long())


@dataclass
class ToyConfig:
    """The toy option (toy.yaml, written into a copy of configs/model): one linear layer."""

    bias: bool = MISSING


class Toy(nn.Linear):
    def __init__(self, cfg: ToyConfig, data: SignsConfig) -> None:
        super().__init__(data.width, 2, bias=cfg.bias)

    def flops_per_token(self) -> int:
        return 6 * self.weight.numel()


YAML = {
    "data/signs.yaml": "defaults:\n  - signs_schema\n  - _self_\n\nnum_samples: 640\nwidth: 4\n"
    "batch_size: 16\nnum_workers: 0\npin_memory: false\non_device: false\n",
    "model/toy.yaml": "defaults:\n  - toy_schema\n  - _self_\n\nbias: true\n",
}


@pytest.fixture
def configs(tmp_path, monkeypatch):
    """A project's configs/ with the two YAML files added, and their schemas and builders
    registered (for this test only)."""
    monkeypatch.setattr(registry, "OPTIONS", dict(registry.OPTIONS))
    monkeypatch.setattr(registry, "BUILDERS", dict(registry.BUILDERS))
    registry.option("data", "signs", "signed points", stored_as="signs_schema")(SignsConfig)
    registry.builds(SignsConfig)(signs)
    registry.option("model", "toy", "a toy", stored_as="toy_schema", reads=SignsConfig)(ToyConfig)
    registry.builds(ToyConfig)(Toy)
    folder = tmp_path / "configs"
    shutil.copytree(str(files("ddp_project.configs")), folder)
    for name, text in YAML.items():
        (folder / name).write_text(text)
    register_configs()
    yield folder
    repo = ConfigStore.instance().repo
    repo["data"].pop("signs_schema.yaml")
    repo["model"].pop("toy_schema.yaml")


def test_a_model_and_data_added_through_the_registry_compose_check_train_and_are_scored(
    configs, tmp_path
):
    toy = ["model=toy", "data=signs", "dist.backend=gloo", "logger=csv"]
    config = compose_and_check(toy, configs)
    assert isinstance(config.model, ToyConfig) and isinstance(config.data, SignsConfig)
    assert (config.model.bias, config.data.width) == (True, 4)

    # Checked: the schema's own check, and what the model reads (validate.check_combinations).
    with pytest.raises(ConfigError, match=r"^data.width=0: must be at least 1$"):
        compose_and_check([*toy, "data.width=0"], configs)
    with pytest.raises(ConfigError, match=r"^model: a toy reads signed points; use data=signs$"):
        compose_and_check(["model=toy", "dist.backend=gloo", "logger=csv"], configs)
    with pytest.raises(
        ConfigError, match=r"^model: an MLP reads labelled points; use data=synthetic$"
    ):
        compose_and_check(["data=signs", "dist.backend=gloo", "logger=csv"], configs)

    # Trained, with its FLOPs per token for the MFU column.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    steps = ["trainer.max_steps=20", "trainer.log_every=10", "trainer.checkpoint_every=20",
             "trainer.lr=0.05"]  # fmt: skip
    trainer = Trainer(
        compose_and_check([*toy, *steps], configs), World(), torch.device("cpu"), run_dir
    )
    assert trainer.flops_per_token == 6 * 2 * 4
    assert trainer.train() is False  # ran to the end
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [10, 20]

    # Scored: the checkpoint's config finds its schemas in the registry (validate.from_saved).
    path = run_dir / "checkpoints" / "step_000000020.pt"
    result = evaluate.evaluate(path, evaluate.load(path), [], World())
    assert result["step"] == 20 and result["held_out_predictions"] == 640 // HELD_OUT
    assert result["accuracy"] > 0.9  # the sign of a sum: a linear layer learns it in 20 steps


def test_every_registered_option_has_a_builder():
    """The package's own options (their builders registered when model, data and loggers are
    imported, as the trainer imports them): a schema without one would fail only once chosen."""
    assert [o.name for o in registry.OPTIONS.values() if o.schema not in registry.BUILDERS] == []

"""A model and a data set added through the registry alone, as docs/configuration.md's "Adding a
model, a dataset or a logger" says: a YAML file in configs/<group>/ and a registered schema and
builder for each, no other edit. They compose, are checked, train and are scored, in this
process. A model with the same keys as another is told apart by the option its checkpoints
record; a registration that takes another's name is refused where the schemas are first used."""

import inspect
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import pytest
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING
from torch import nn
from torch.utils.data import TensorDataset

# The options' builders, as train imports them.
import ddp_project.data  # noqa: F401
from ddp_project import evaluate
from ddp_project.config import options, registry, validate
from ddp_project.config.compose import compose_and_check
from ddp_project.config.error import ConfigError, require
from ddp_project.config.options import (
    HELD_OUT,
    DataConfig,
    MlpConfig,
    PointsConfig,
)
from ddp_project.config.schema import register_configs
from ddp_project.core.world import World
from ddp_project.model import build_model
from ddp_project.run import checkpoint, rundir
from ddp_project.run.saved import load as read_checkpoint
from ddp_project.run.trainer import Trainer


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


@dataclass
class ResMlpConfig:
    """The resmlp option (resmlp.yaml): the README's recipe followed for a model whose keys are
    model=mlp's, as a copy of MlpConfig has them."""

    hidden_dim: int = MISSING
    depth: int = MISSING


class ResMlp(nn.Module):
    """Residual blocks over data=synthetic's points: another module than the Mlp, whose weights
    no Mlp loads."""

    def __init__(self, cfg: ResMlpConfig, data: PointsConfig) -> None:
        super().__init__()
        self.stem = nn.Linear(data.num_features, cfg.hidden_dim)
        self.blocks = nn.ModuleList(
            nn.Linear(cfg.hidden_dim, cfg.hidden_dim) for _ in range(cfg.depth)
        )
        self.head = nn.Linear(cfg.hidden_dim, data.num_classes)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.stem(inputs)
        for block in self.blocks:
            hidden = hidden + torch.relu(block(hidden))
        return self.head(hidden)


YAML = {
    "data/signs.yaml": "defaults:\n  - /signs_schema\n  - _self_\n\nnum_samples: 640\nwidth: 4\n"
    "batch_size: 16\nnum_workers: 0\npin_memory: false\non_device: false\n",
    "model/toy.yaml": "defaults:\n  - /toy_schema\n  - _self_\n\nbias: true\n",
    "model/resmlp.yaml": "defaults:\n  - /resmlp_schema\n  - _self_\n\nhidden_dim: 32\ndepth: 2\n",
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
    registry.option(
        "model", "resmlp", "a residual MLP", stored_as="resmlp_schema", reads=PointsConfig
    )(ResMlpConfig)
    registry.builds(ResMlpConfig)(ResMlp)
    folder = tmp_path / "configs"
    shutil.copytree(str(files("ddp_project.configs")), folder)
    for name, text in YAML.items():
        (folder / name).write_text(text)
    register_configs()
    yield folder
    repo = ConfigStore.instance().repo
    repo.pop("signs_schema.yaml")
    repo.pop("toy_schema.yaml")
    repo.pop("resmlp_schema.yaml")


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
    steps = [
        "trainer.max_steps=20",
        "trainer.log_every=10",
        "trainer.checkpoint_every=20",
        "trainer.lr=0.05",
    ]
    trainer = Trainer(
        compose_and_check([*toy, *steps], configs), World(), torch.device("cpu"), run_dir
    )
    assert trainer.flops_per_token == 6 * 2 * 4
    assert trainer.train() is False  # ran to the end
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [10, 20]

    # Scored: the checkpoint's config finds its schemas in the registry (validate.from_saved).
    path = run_dir / "checkpoints" / "step_000000020.pt"
    result = evaluate.evaluate(path, read_checkpoint(path), [], World())
    assert result["step"] == 20 and result["held_out_predictions"] == 640 // HELD_OUT
    assert result["accuracy"] > 0.9  # the sign of a sum: a linear layer learns it in 20 steps


def test_every_registered_option_has_a_builder():
    """The package's own options (their builders registered when model, data and loggers are
    imported, as the trainer imports them): a schema without one would fail only once chosen."""
    assert [o.name for o in registry.OPTIONS.values() if o.schema not in registry.BUILDERS] == []


RESMLP = [
    "model=resmlp",
    "dist.backend=gloo",
    "logger=csv",
    "trainer.max_steps=20",
    "trainer.log_every=10",
    "trainer.checkpoint_every=20",
]


@pytest.fixture
def resmlp_run(configs, tmp_path):
    """run/, trained 20 steps with model=resmlp (validated at the last), in this process."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = compose_and_check(RESMLP, configs)
    assert isinstance(config.model, ResMlpConfig)  # the keys model=mlp has, its own schema
    assert Trainer(config, World(), torch.device("cpu"), run_dir).train() is False
    return run_dir


def test_a_model_with_another_models_keys_is_scored_and_resumed_as_itself(
    configs, resmlp_run, monkeypatch, capsys
):
    path = resmlp_run / "checkpoints" / "step_000000020.pt"
    state = checkpoint.read(path)
    assert state["options"] == {"data": "synthetic", "model": "resmlp"}
    assert set(state["config"]["model"]) == {"hidden_dim", "depth"}  # model=mlp's keys too

    # Scored as the ResMlp it trained: the score its validation at step 20 gave.
    saved = validate.from_saved(
        state["config"], [], World(), held_out=True, recorded=state["options"]
    )
    assert isinstance(build_model(saved.model, saved.data), ResMlp)
    result = evaluate.evaluate(path, read_checkpoint(path), [], World())
    (row,) = [r for r in map(json.loads, (resmlp_run / "metrics.jsonl").open()) if r["step"] == 20]
    assert (result["loss"], result["accuracy"]) == (row["val_loss"], row["val_accuracy"])
    with pytest.raises(ConfigError) as told:  # the checkpoint's option is no user's to change
        evaluate.evaluate(path, read_checkpoint(path), [], World(), told={"model": "mlp"})
    assert str(told.value) == (
        "model=mlp: the checkpoint was trained with model=resmlp, which builds it; leave model= out"
    )

    # Resumed only as itself: its config and model=mlp's compare equal but for the values.
    resume = ["trainer.max_steps=30", "hydra.run.dir=run"]
    resumed = compose_and_check([*RESMLP, *resume], configs)
    assert rundir.resume_problem(resmlp_run, resumed, World()) is None
    as_mlp = compose_and_check([*RESMLP, "model=mlp", "model.hidden_dim=32", *resume], configs)
    assert rundir.changes_on_resume(state["config"], as_mlp) == []  # what let it through before
    assert rundir.resume_problem(resmlp_run, as_mlp, World()) == (
        f"model=mlp: the checkpoint in {resmlp_run} (step_000000020.pt) was trained with "
        "model=resmlp; resume with model=resmlp, add trainer.accept_changes=[model] to switch, or "
        "choose another hydra.run.dir"
    )
    as_mlp.trainer.accept_changes = ["model"]  # a switch asked for
    assert rundir.resume_problem(resmlp_run, as_mlp, World()) is None
    as_mlp.trainer.accept_changes = ["model.hidden_dim", "model.depth"]  # its keys are no switch
    assert rundir.resume_problem(resmlp_run, as_mlp, World()).startswith(
        "model=mlp: the checkpoint in "
    )


def test_a_checkpoint_that_records_no_option_is_read_by_its_keys_and_refused_when_two_fit(
    configs, resmlp_run, monkeypatch, capsys
):
    """A checkpoint written before checkpoints recorded their options: its config alone."""
    path = resmlp_run / "checkpoints" / "step_000000020.pt"
    state = checkpoint.read(path)
    score = evaluate.evaluate(path, state, [], World())
    del state["options"]
    torch.save(state, path)

    # Its keys fit model=mlp and model=resmlp: evaluate names both and asks which.
    monkeypatch.chdir(resmlp_run.parent)
    monkeypatch.setattr(sys, "argv", ["evaluate", "ckpt=run"])
    assert evaluate.main() == 2
    assert capsys.readouterr().err == (
        "config error: model: the checkpoint records no model option (it was written before "
        "checkpoints did), and its keys (depth, hidden_dim) fit 2: model=mlp, model=resmlp; say "
        "which it was trained with: model=mlp or model=resmlp\n"
    )
    monkeypatch.setattr(sys, "argv", ["evaluate", "ckpt=run", "model=resmlp"])
    assert evaluate.main() == 0, capsys.readouterr().err
    scored = json.loads((resmlp_run / "eval" / "step_000000020.json").read_text())
    assert scored["loss"] == score["loss"]
    # data=synthetic is the only data option with its keys: no need to name it
    assert (
        validate.from_saved(state["config"], [], World(), told={"model": "resmlp"}).data.num_classes
        == 8
    )

    # A resume names both too, and what makes it go on.
    config = compose_and_check([*RESMLP, "trainer.max_steps=30"], configs)
    assert rundir.resume_problem(resmlp_run, config, World()) == (
        f"hydra.run.dir={resmlp_run} resumes from step_000000020.pt: the checkpoint records no "
        "model option (it was written before checkpoints did), and its keys (depth, hidden_dim) "
        "fit 2: model=mlp, model=resmlp; to resume it as model=resmlp add "
        "trainer.accept_changes=[model], or choose another hydra.run.dir"
    )
    config.trainer.accept_changes = ["model"]
    assert rundir.resume_problem(resmlp_run, config, World()) is None


def line_of(module, text: str) -> str:
    """file:line of the first line of `module` that holds `text`."""
    source = inspect.getsourcefile(module)
    lines = Path(source).read_text().splitlines()
    return f"{source}:{next(n for n, line in enumerate(lines, 1) if text in line)}"


@pytest.fixture
def own_registry(monkeypatch):
    """Registrations made in a test stay in it."""
    monkeypatch.setattr(registry, "OPTIONS", dict(registry.OPTIONS))
    monkeypatch.setattr(registry, "CLASHES", [])


def refusal() -> str:
    """The line a command ends on: the first use of the schemas raises the clash."""
    with pytest.raises(ConfigError) as refused:
        registry.stored_options()
    return str(refused.value)


def here(offset: int = 1) -> str:
    """file:line of the caller's line `offset` lines down."""
    caller = inspect.currentframe().f_back
    return f"{caller.f_code.co_filename}:{caller.f_lineno + offset}"


def test_a_schema_name_taken_in_its_group_is_refused_naming_both_places(own_registry):
    """A decorator copied with only its name changed: ConfigStore would have kept the copy
    under mlp_schema, and model=mlp trained the copy's class."""
    mlp = line_of(options, '@option("model", "mlp"')
    at = here()
    registry.option("model", "resmlp", "a residual MLP", stored_as="mlp_schema")(ResMlpConfig)
    assert refusal() == (
        f"model=resmlp: stored_as='mlp_schema' (ResMlpConfig at {at}) is already "
        f"model=mlp's (MlpConfig at {mlp}); each option's schema needs a name of its own, e.g. "
        f"stored_as='resmlp_schema', named first in {Path('configs', 'model', 'resmlp.yaml')}"
    )
    assert registry.option_of(MlpConfig).name == "mlp" and ResMlpConfig not in registry.OPTIONS


def test_an_option_name_taken_in_its_group_is_refused_naming_both_places(own_registry):
    mlp = line_of(options, '@option("model", "mlp"')
    at = here()
    registry.option("model", "mlp", "a residual MLP", stored_as="resmlp_schema")(ResMlpConfig)
    assert refusal() == (
        f"model=mlp: registered twice, by ResMlpConfig at {at} and by MlpConfig at "
        f"{mlp}; an option's name is its YAML's (configs/model/<name>.yaml) and one schema's: "
        "rename one"
    )
    assert registry.option_of(MlpConfig).name == "mlp" and ResMlpConfig not in registry.OPTIONS


def test_names_are_an_options_own_within_its_group_only_and_a_module_may_register_again(
    own_registry, capsys
):
    """A data option named mlp clashes with no model: Hydra keeps each group's options apart. A
    module imported again (importlib.reload) registers its schemas again, as the same options."""
    registry.option("data", "mlp", "points", stored_as="points_mlp_schema")(ResMlpConfig)
    source = (
        "from dataclasses import dataclass\n"
        "@registry.option('model', 'again', 'twice', stored_as='again_schema')\n"
        "@dataclass\nclass Again:\n    width: int = 0\n"
    )
    for _ in range(2):
        exec(source, {"__name__": "reloaded", "registry": registry})
    assert [o.name for o in registry.options("model")].count("again") == 1
    assert registry.CLASHES == [] and capsys.readouterr().err == ""


@pytest.mark.parametrize(
    ("stored_as", "line"),
    [
        ("mlp_schema", "is already model=mlp's"),  # another group's: one root namespace
        ("train_schema", "is the name of the primary config's own"),
        ("train", "is the name of the primary config's own"),
    ],
)
def test_a_schema_name_is_its_own_across_groups_and_beside_the_primary_config(
    own_registry, stored_as, line
):
    """The schemas share the ConfigStore's root with each other and with train_schema: a data
    schema stored as mlp_schema would replace the model's."""
    registry.option("data", "points2", "points", stored_as=stored_as)(ResMlpConfig)
    refused = refusal()
    assert refused.startswith(f"data=points2: stored_as={stored_as!r} ") and line in refused
    assert "\n" not in refused and ResMlpConfig not in registry.OPTIONS


@pytest.mark.parametrize("command", ["check", "train"])
def test_a_collision_in_a_users_module_ends_a_command_in_one_line(tmp_path, command):
    """A module that registers model=mlp before config/options.py does: `python -m <package>.check`
    and train end as it composes, with one line and exit 2, no traceback."""
    (tmp_path / "mine.py").write_text(
        "from dataclasses import dataclass\n\n"
        "from ddp_project.config.registry import option\n\n\n"
        "@option('model', 'mlp', 'my MLP', stored_as='my_mlp_schema')\n"
        "@dataclass\nclass MyMlpConfig:\n    width: int = 0\n"
    )
    module = f"ddp_project.{command}"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import mine, runpy; runpy.run_module({module!r}, run_name='__main__')",
            "model=mlp",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-3000:]
    mlp = line_of(options, '@option("model", "mlp"')
    assert done.stderr == (
        f"config error: model=mlp: registered twice, by MlpConfig at {mlp} and by MyMlpConfig at "
        f"{tmp_path / 'mine.py'}:6; an option's name is its YAML's (configs/model/<name>.yaml) and "
        "one schema's: rename one\n"
    )

"""Sweeps (-m, hparams_search=): train returns each run's lowest val_loss to the sweeper, in one
process per trial; a sweep that cannot work (under torchrun, without a metric) is one line."""

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap

import pytest
import yaml
from conftest import ROOT, make_line
from omegaconf import OmegaConf, open_dict

from ddp_project.config import overrides
from ddp_project.config.compose import ConfigCheck, sweep_problem
from ddp_project.config.validate import check_composed
from ddp_project.core.world import World
from ddp_project.record import metrics

PACKAGE = "ddp_project"
SHORT = ["experiment=smoke", "trainer.max_steps=6", "trainer.val_every=3"]

# A sweeper that keeps what each job returned, as Optuna's reads it: Hydra's basic sweeper, whose
# results it writes to returns.json in the sweep dir. Hydra finds it as it finds any plugin.
RECORDING = """
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore


class RecordingSweeper(BasicSweeper):
    def sweep(self, arguments):
        batches = super().sweep(arguments)
        values = [job.return_value for batch in batches for job in batch]
        Path(self.config.hydra.sweep.dir, "returns.json").write_text(json.dumps(values))
        return batches


@dataclass
class RecordingSweeperConf:
    _target_: str = "hydra_plugins.recording_sweeper.RecordingSweeper"
    max_batch_size: Optional[int] = None
    params: Optional[dict] = None


ConfigStore.instance().store(group="hydra/sweeper", name="recording", node=RecordingSweeperConf)
"""


def sweep(tmp_path, *args, pythonpath=None):
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", *args, "hydra.sweep.dir=sweep"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def lowest_val_loss(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return min(row["val_loss"] for row in rows if row.get("val_loss") is not None)


def test_a_sweep_gets_each_runs_lowest_val_loss_and_profiles_nothing(tmp_path):
    plugins = tmp_path / "plugins" / "hydra_plugins"
    plugins.mkdir(parents=True)
    (plugins / "recording_sweeper.py").write_text(textwrap.dedent(RECORDING))
    done = sweep(
        tmp_path,
        "-m",
        *SHORT,
        "trainer.lr=0.001,0.01",
        "hydra/sweeper=recording",
        pythonpath=plugins.parent,
    )
    assert done.returncode == 0, done.stderr
    swept = tmp_path / "sweep"
    returned = json.loads((swept / "returns.json").read_text())
    assert returned == [lowest_val_loss(swept / "0"), lowest_val_loss(swept / "1")]
    assert returned[0] != returned[1]  # each job's own
    assert not list(swept.glob("*/profile"))  # profile=none: no folder, no file


@pytest.mark.slow  # a search of several jobs: the test above sweeps through the same return
@pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None
    if importlib.util.find_spec("hydra_plugins")
    else True,
    reason="hydra-optuna-sweeper is not installed: pip install -e '.[sweep]'",
)
def test_the_optuna_search_minimises_the_val_loss_train_returns(tmp_path):
    done = sweep(tmp_path, "hparams_search=optuna", *SHORT, "hydra.sweeper.n_trials=2")
    assert done.returncode == 0, done.stderr
    swept = tmp_path / "sweep"
    best = yaml.safe_load((swept / "optimization_results.yaml").read_text())["best_value"]
    assert best == min(lowest_val_loss(swept / "0"), lowest_val_loss(swept / "1"))


def sweeping(compose_train, *args, sweeper="hydra._internal.core_plugins.BasicSweeper"):
    composed = compose_train(*args)
    with open_dict(composed):
        composed.hydra = {"sweeper": {"_target_": sweeper}}
    return composed


def test_the_metric_is_the_runs_lowest_val_loss_rows_before_a_resume_too(tmp_path):
    rows = "step,val_loss\n1,\n2,2.0\n4,1.0\n6,1.5\n"  # worse at the end: the lowest counts
    (tmp_path / "metrics.csv").write_text(rows)
    assert metrics.best_val_loss(tmp_path) == 1.0
    (tmp_path / "metrics.csv").write_text("step,val_loss\n1,\n")
    assert metrics.best_val_loss(tmp_path) is None  # no validation: a grid sweep's jobs


def test_a_sweep_under_torchrun_is_refused_before_any_job(compose_train, capsys, monkeypatch):
    """Each worker would run a sweep of its own (its own sampler's trials, a process group per
    trial from one rendezvous): refused on every rank as the sweep starts, in one line."""
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stopped:
        ConfigCheck().on_multirun_start(config=sweeping(compose_train), task_function=None)
    assert stopped.value.code == 2
    line = capsys.readouterr().err
    assert line.startswith("config error: a sweep (-m, hparams_search=) under torchrun: each of")
    assert f"python -m {PACKAGE}.train -m" in line and line.count("\n") == 1


def test_one_process_sweeps_and_a_sweeper_that_minimises_needs_validation(compose_train):
    world = World()
    basic = sweeping(compose_train, "trainer.val_every=0")
    assert sweep_problem(basic, check_composed(basic, world), world) is None  # a grid, no metric
    optuna = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    minimising = sweeping(compose_train, "trainer.val_every=0", sweeper=optuna)
    problem = sweep_problem(minimising, check_composed(minimising, world), world)
    assert problem.startswith("trainer.val_every=0: the sweeper OptunaSweeper minimises")
    validating = sweeping(compose_train, sweeper=optuna)
    assert sweep_problem(validating, check_composed(validating, world), world) is None


def test_hparams_search_without_its_plugin_says_what_to_install(monkeypatch):
    def nothing_found(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", nothing_found)
    assert overrides.sweeper_problem(["hparams_search=optuna"]) == (
        "hparams_search=optuna: its sweeper plugin (hydra_plugins.hydra_optuna_sweeper) is not "
        "installed; pip install -e '.[sweep]'"
    )
    assert overrides.sweeper_problem(["hparams_search=null", "trainer.lr=0.1"]) is None


def test_the_optuna_search_is_a_global_config_that_sweeps_without_minus_m(compose_train):
    from ddp_project.config.overrides import configs_folder

    text = (configs_folder() / "hparams_search" / "optuna.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    search = OmegaConf.create(yaml.safe_load(text))
    assert search.hydra.mode == "MULTIRUN" and search.hydra.sweeper.direction == "minimize"
    assert set(search.hydra.sweeper.params) == {"trainer.lr", "optimizer.weight_decay"}
    # Each swept key is one the training config has (without optuna installed, too): a key moved
    # to another group fails here, not in the first trial of a user's search.
    cfg = compose_train()
    for key in search.hydra.sweeper.params:
        assert OmegaConf.select(cfg, key, default="absent") != "absent", key


def test_the_per_trial_job_lines_render_the_trials_manifests_as_the_page_says(tmp_path):
    """docs/sweeps.md's one Job per trial, its lines as written: the image tag make builds, the
    trial's folder of manifests under its own name and image; a training key on the render line
    is refused, as the page says."""
    page = (ROOT / "docs" / "sweeps.md").read_text().split("one Kubernetes Job per trial")[1]
    lines = [ln.strip() for ln in page.replace("\\\n", "").splitlines() if ln.startswith("    ")]
    build, _, render, apply = lines
    project = tmp_path / "project"
    shutil.copytree(ROOT / "configs", project / "configs")
    shutil.copy(ROOT / "pyproject.toml", project)
    image = shlex.split(build)[-1].removeprefix("IMAGE=")
    assert make_line(build) == ["docker", "build", "-t", image, "."]
    words = shlex.split(render)
    assert words[:3] == ["python", "-m", f"{PACKAGE}.k8s"]
    done = subprocess.run([sys.executable, *words[1:]], cwd=project, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert apply == "kubectl apply -f k8s-lr1/"
    flavor = yaml.safe_load((project / "configs/deploy/default.yaml").read_text())["flavor"]
    manifests = list(yaml.safe_load_all((project / "k8s-lr1" / f"{flavor}.yaml").read_text()))
    assert manifests[0]["metadata"]["name"] == "trial-lr1"
    assert f"image: {image}" in (project / "k8s-lr1" / f"{flavor}.yaml").read_text()
    command = [sys.executable, "-m", f"{PACKAGE}.k8s", "--out", "k8s-x", "trainer.lr=0.001"]
    refused = subprocess.run(command, cwd=project, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: trainer.lr=0.001: k8s/ is rendered from deploy.*")
    assert not (project / "k8s-x").exists()

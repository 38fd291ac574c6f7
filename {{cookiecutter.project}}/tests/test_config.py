"""The real configs/ compose, and bad values fail before any process starts, naming the key."""

import re

import pytest
import torch
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from ddp_project.config.error import ConfigError
from ddp_project.config.schema import Backend, TrainConfig
from ddp_project.config.validate import check_composed
from ddp_project.core.world import World
from ddp_project.nccl import decision as nccl

PROFILE_ENV = {
    "auto": {},
    "nccl_default": {},
    "pcie_safe": {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"},
    "socket": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"},
    "infiniband": {"NCCL_IB_DISABLE": "0"},
}


def test_the_default_config_is_what_each_groups_yaml_says(compose_train):
    """Each group's file is composed as written, into the typed schema of its option."""
    from importlib.resources import files

    import yaml

    from ddp_project.config import options

    config = OmegaConf.to_object(compose_train())
    assert isinstance(config, TrainConfig)
    assert isinstance(config.model, options.MlpConfig) and isinstance(
        config.data, options.PointsConfig
    )
    # Where Hydra finds them (pkg://): in the installed package, the project's configs/
    # in an editable install.
    configs = files("ddp_project.configs")
    for group, option in [
        ("model", "mlp"),
        ("data", "synthetic"),
        ("trainer", "default"),
        ("dist", "default"),
    ]:
        written = yaml.safe_load((configs / group / f"{option}.yaml").read_text())
        written.pop("defaults", None)
        composed = OmegaConf.to_container(
            OmegaConf.structured(getattr(config, group)), enum_to_str=True
        )
        assert composed == written, group


@pytest.mark.parametrize("profile", sorted(PROFILE_ENV))
def test_each_profile_sets_exactly_its_variables(compose_train, profile):
    config = OmegaConf.to_object(compose_train(f"nccl={profile}"))
    assert config.nccl.auto is (profile in ("auto", "infiniband"))
    assert nccl.decide(config.nccl, None, inherited={}).env == PROFILE_ENV[profile]


def test_overrides_reach_the_config(compose_train):
    cfg = compose_train(
        "nccl=pcie_safe",
        "nccl.p2p_disable=false",
        "nccl.debug=INFO",
        "+nccl.env.NCCL_ALGO=Ring",
        "trainer.max_steps=7",
    )
    config = OmegaConf.to_object(cfg)
    assert config.trainer.max_steps == 7
    assert nccl.decide(config.nccl, None, inherited={}).env == {
        "NCCL_P2P_DISABLE": "0",
        "NCCL_IB_DISABLE": "1",
        "NCCL_DEBUG": "INFO",
        "NCCL_ALGO": "Ring",
    }


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("nccl.p2p_disable=maybe", "nccl.p2p_disable: "),
        ("nccl.p2p_disabel=true", "nccl.p2p_disabel: no such key"),
        ("nccl.debug=LOUD", "nccl.debug: Invalid value 'LOUD'"),
        ("trainer.max_steps=many", "trainer.max_steps: Value 'many'"),
        ("dist.backend=mpi", "dist.backend: Invalid value 'mpi'"),
        ("nccl=fastest", "nccl=fastest: no such option"),
    ],
)
def test_bad_override_fails_at_compose_in_one_line_that_starts_with_the_key(
    compose_train, override, key
):
    from ddp_project.config.compose import describe

    with pytest.raises(ConfigCompositionException) as failure:
        compose_train(override)
    assert describe(failure.value).startswith(key)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.max_steps=-1", "trainer.max_steps=-1: must be at least 1"),
        ("dist.timeout_s=0", r"dist.timeout_s=0: must be 1 to 604800 seconds \(a week\)"),
        ("data.batch_size=0", "data.batch_size=0: must be at least 1"),
        ("+nccl.env.LD_PRELOAD=x.so", "nccl.env.LD_PRELOAD: keys must be NCCL_*"),
    ],
)
def test_out_of_range_value_fails_before_training_naming_the_key(compose_train, override, message):
    with pytest.raises(ConfigError, match=message):
        OmegaConf.to_object(compose_train(override))


@pytest.mark.parametrize(
    ("backend", "visible", "procs", "message"),
    [
        ("nccl", 0, 1, "dist.backend=nccl: no CUDA device is visible"),
        ("auto", 2, 4, "--nproc-per-node=4: only 2 GPU(s) visible on this node"),
    ],
)
def test_more_processes_than_gpus_is_refused(
    compose_train, monkeypatch, backend, visible, procs, message
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: visible > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    world = World(size=procs, local_size=procs)
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_composed(compose_train(f"dist.backend={backend}"), world)


def test_gloo_ignores_gpu_count(compose_train, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    composed = compose_train("dist.backend=gloo")
    assert check_composed(composed, World(size=8, local_size=8)).dist.backend is Backend.gloo


def test_a_local_override_file_applies_after_the_experiment(tmp_path):
    """configs/local/default.yaml: this machine's overrides, optional and git-ignored."""
    import shutil
    from importlib.resources import files

    from hydra import compose, initialize_config_dir

    from ddp_project.config.schema import register_configs

    register_configs()
    configs = tmp_path / "configs"
    shutil.copytree(str(files("ddp_project.configs")), configs)
    (configs / "local").mkdir(exist_ok=True)  # an install without local files has no folder
    (configs / "local" / "default.yaml").write_text(
        "# @package _global_\ntrainer:\n  max_steps: 7\ndata:\n  batch_size: 512\n"
    )
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        local = compose(config_name="train", overrides=["experiment=smoke"])
    assert local.trainer.max_steps == 7  # over the experiment's 20
    assert local.data.batch_size == 512 and local.trainer.log_every == 5  # the rest stays
    (configs / "local" / "default.yaml").unlink()
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        assert compose(config_name="train", overrides=["experiment=smoke"]).trainer.max_steps == 20


def test_nccl_overrides_are_rewritten_once_and_only_theirs():
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ddp_project.config.overrides import hydra_overrides

    given = [
        "-m",
        "--cfg",
        "job",
        "trainer.accept_changes=[trainer.lr,data.batch_size]",
        "hydra.sweep.dir=a,b",
        "nccl=infiniband",
        "nccl.debug=INFO,WARN",
        "nccl.debug_subsys=INIT,NET",
        "+nccl.env.NCCL_ALGO=Ring",
        "nccl.ib_hca=null",
        "nccl.env.NCCL_PROTO=choice(LL,Simple)",
        "nccl.socket_ifname=${oc.env:IFACE}",
        "~nccl.env.NCCL_X",
    ]
    rewritten = hydra_overrides(given)
    changed = {new for old, new in zip(given, rewritten, strict=True) if old != new}
    assert changed == {
        "nccl.debug_subsys='INIT,NET'",
        "++nccl.env.NCCL_ALGO='Ring'",
        "++nccl.env.NCCL_PROTO=choice(LL,Simple)",
    }
    assert hydra_overrides(rewritten) == rewritten
    # Under -m a bare comma list is still NCCL's list; choice() is how to sweep over values.
    parsed = OverridesParser.create().parse_overrides(rewritten[6:])
    sweeps = [override.key_or_group for override in parsed if override.is_sweep_override()]
    assert sweeps == ["nccl.debug", "nccl.env.NCCL_PROTO"]


def test_configs_are_found_where_the_configs_package_is_not_beside_overrides_py(monkeypatch):
    """An editable install maps <package>.configs to the project's configs/, away from overrides.py
    (the Quick start's make test failed on that); overrides.py's place must not matter."""
    from pathlib import Path

    from ddp_project import configs
    from ddp_project.config import overrides

    package = Path(configs.__file__).parent
    monkeypatch.setattr(overrides, "__file__", "/nowhere/overrides.py")
    assert overrides.configs_folder() == package and (package / "train.yaml").is_file()

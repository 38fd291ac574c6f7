"""Every config error is one line that names the key and what is allowed, before anything starts."""

import logging
import re
import subprocess
import sys

import pytest
import yaml
from conftest import PACKAGE
from hydra.types import RunMode
from omegaconf import open_dict

from ddp_project.config.compose import config_problem
from ddp_project.core.world import World

BAD = [
    ("nccl.p2p_disable=maybe", "nccl.p2p_disable: Value 'maybe' is not a valid bool"),
    (
        "nccl.p2p_disabel=true",
        "nccl.p2p_disabel: no such key; did you mean nccl.p2p_disable? allowed: auto, p2p_disable, "
        "p2p_level, ib_disable",
    ),
    ("trainer.max_steps=-1", "trainer.max_steps=-1: must be at least 1"),
    (
        "trainer.max_steps=many",
        "trainer.max_steps: Value 'many' of type 'str' could not be converted to Integer",
    ),
    ("trainer.lr=0", "trainer.lr=0.0: must be a finite number above 0"),
    ("trainer.lr=inf", "trainer.lr=inf: must be a finite number above 0"),
    ("trainer.lr=nan", "trainer.lr=nan: must be a finite number above 0"),
    (
        "optimizer.weight_decay=-inf",
        "optimizer.weight_decay=-inf: must be a finite number, 0 or more",
    ),
    ("trainer.val_every=-1", "trainer.val_every=-1: must be 0 (no validation) or more"),
    (
        "data.num_samples=9 data.batch_size=4",
        "data.num_samples=9: 0 held-out sample(s) (one in 10) for 1 process(es), which need one "
        "each; train with more data, or with trainer.val_every=0 (no validation)",
    ),
    (
        "trainer.min_lr=-0.001",
        "trainer.min_lr=-0.001: must be null (trainer.lr/10) or a finite number from 0 to "
        "trainer.lr=0.003",
    ),
    (
        "trainer.min_lr=nan",
        "trainer.min_lr=nan: must be null (trainer.lr/10) or a finite number from 0 to "
        "trainer.lr=0.003",
    ),
    (
        "trainer.lr=0.0001 trainer.min_lr=0.0003",
        "trainer.min_lr=0.0003: must be null (trainer.lr/10) or a finite number from 0 to "
        "trainer.lr=0.0001",
    ),
    (
        "trainer.val_batches=0",
        "trainer.val_batches=0: must be null (every held-out batch) or at least 1",
    ),
    (
        "trainer.schedule=step",
        "trainer.schedule: Invalid value 'step', expected one of [constant, linear, cosine]",
    ),
    (
        "trainer.max_grad_norm=0",
        "trainer.max_grad_norm=0.0: must be null (no clipping) or a finite",
    ),
    (
        "trainer.max_grad_norm=nan",
        "trainer.max_grad_norm=nan: must be null (no clipping) or a finite",
    ),
    (
        "trainer.on_nonfinite=ignore",
        "trainer.on_nonfinite: Invalid value 'ignore', expected one of [stop, skip]",
    ),
    ("model=gpt", "model: a GPT reads token sequences; use data=tokens"),
    ("data=tokens", "model: an MLP reads labelled points; use data=synthetic"),
    (
        "model=gpt data=tokens model.d_model=100 model.n_head=3",
        "model.d_model=100: must be a positive multiple of model.n_head=3",
    ),
    (
        "model=gpt data=tokens model.depth=3",
        "model.depth: no such key; allowed: n_layer, n_head, d_model",
    ),
    ("data=tokens model=gpt data.vocab_size=1", "data.vocab_size=1: must be at least 2"),
    ("data=tokens model=gpt data.seq_len=0", "data.seq_len=0: must be at least 1"),
    ("data.num_classes=1", "data.num_classes=1: must be at least 2"),
    ("data.num_features=0", "data.num_features=0: must be at least 1"),
    ("model.hidden_dim=0", "model.hidden_dim=0: must be at least 1"),
    (
        "trainer.precision=fp8",
        "trainer.precision: Invalid value 'fp8', expected one of [bf16, fp16, fp32]",
    ),
    ("trainer.keep_checkpoints=1", "trainer.keep_checkpoints=1: must be at least 2"),
    (
        "trainer.async_checkpoint=maybe",
        "trainer.async_checkpoint: Value 'maybe' is not a valid bool",
    ),
    (
        "trainer.checkpoint_every=-1",
        "trainer.checkpoint_every=-1: must be 0 (no checkpoints) or more",
    ),
    ("trainer.grad_accumulation=0", "trainer.grad_accumulation=0: must be at least 1"),
    ("dist.bucket_cap_mb=0", "dist.bucket_cap_mb=0: must be at least 1"),
    ("dist.comm_hook=zip", "dist.comm_hook: Invalid value 'zip'"),
    (
        "dist.static_graph=true trainer.grad_accumulation=2",
        "dist.static_graph=true: DDP's static graph cannot skip",
    ),
    (
        "data.on_device=true data.num_workers=2",
        "data.num_workers=2: must be 0 with data.on_device=true",
    ),
    (
        "experiment=huge",
        "experiment=huge: no such option; allowed: gpt2_small, gpt_sample, mlp_134m, smoke",
    ),
    # A typo gets the closest name (difflib), between "no such ..." and "allowed:"; the lists
    # hold the options a user may choose, never a schema's name (mlp_schema: config/options.py).
    (
        "experiment=smok",
        "experiment=smok: no such option; did you mean smoke? allowed: gpt2_small,",
    ),
    ("model=mpl", "model=mpl: no such option; did you mean mlp? allowed: gpt, mlp"),
    ("data=tokenz", "data=tokenz: no such option; did you mean tokens? allowed: synthetic, tokens"),
    ("model=mlp_schema", "model=mlp_schema: no such option; allowed: gpt, mlp"),
    ("nccl=pcie-safe", "nccl=pcie-safe: no such option; did you mean pcie_safe? allowed: auto,"),
    ("trainer.lrr=1", "trainer.lrr: no such key; did you mean trainer.lr? allowed: max_steps, lr,"),
    (
        "+trainer.lrr=1",
        "trainer.lrr: no such key; did you mean trainer.lr? allowed: max_steps, lr,",
    ),
    ("trainr.lr=1", "trainr: no such key; did you mean trainer? allowed: model, data, logger,"),
    ("+trainr.lr=1", "trainr: no such key; did you mean trainer? allowed: model, data, logger,"),
    ("deploy.imag=x", "deploy.imag: no such key; did you mean deploy.image? allowed: name, image,"),
    (
        "+deploy.imag=x",
        "deploy.imag: no such key; did you mean deploy.image? allowed: name, image,",
    ),
    ("trainer.zzz=1", "trainer.zzz: no such key; allowed: max_steps, lr,"),  # nothing close
    ("+trainer.zzz=1", "trainer.zzz: no such key; allowed: max_steps, lr,"),
    ("dist.timeout_s=0", "dist.timeout_s=0: must be 1 to 604800 seconds (a week)"),
    ("dist.backend=mpi", "dist.backend: Invalid value 'mpi', expected one of [auto, nccl, gloo]"),
    ("dist.async_error_handling=5", "dist.async_error_handling=5: must be null, 0, 1, 2 or 3"),
    ("data.batch_size=0", "data.batch_size=0: must be at least 1"),
    (
        "nccl=fastest",
        "nccl=fastest: no such option; allowed: auto, infiniband, nccl_default, pcie_safe, socket",
    ),
    (
        "+nccl.env.LD_PRELOAD=x.so",
        "nccl.env.LD_PRELOAD: keys must be NCCL_*, TORCH_NCCL_* or GLOO_*",
    ),
    (
        "nccl.env.LD_PRELOAD=x.so",
        "nccl.env.LD_PRELOAD: keys must be NCCL_*, TORCH_NCCL_* or GLOO_*",
    ),
    ("nccl.env.nccl_algo=Ring", "nccl.env.nccl_algo: keys must be NCCL_*, TORCH_NCCL_* or GLOO_*"),
    (
        "nccl.env.NCCL_P2P_DISABLE=1",
        "nccl.env.NCCL_P2P_DISABLE: set it with nccl.p2p_disable instead",
    ),
    (
        "nccl.env.TORCH_NCCL_ASYNC_ERROR_HANDLING=3",
        "nccl.env.TORCH_NCCL_ASYNC_ERROR_HANDLING: set it with dist.async_error_handling instead",
    ),
    (
        "nccl.env.NCCL_NVLS_ENABLE=true",
        "nccl.env.NCCL_NVLS_ENABLE=true: NCCL reads a number here, not a bool; write 1 or 0",
    ),
    ("nccl.env.NCCL_ALGO=", "nccl.env.NCCL_ALGO: empty; give a value, or null"),
    ("nccl.env.NCCL_ALGO=[]", "nccl.env.NCCL_ALGO: empty; give a value, or null"),
    ("nccl.env.NCCL_ALGO=" + "R" * 5000, "nccl.env.NCCL_ALGO: 5000 characters;"),
    ("nccl.env=5", "nccl.env: Cannot assign int to Dict"),
    ("nccl.debug_subsys=''", "nccl.debug_subsys: empty; give a value, or null"),
    ("nccl.p2p_level=FAST", "nccl.p2p_level=FAST: must be one of LOC, NVL, PIX, PXB, PHB, SYS"),
    ("nccl.ib_gid_index=256", "nccl.ib_gid_index=256: must be -1 (NCCL picks) to 255"),
    ("nccl.ib_gid_index=three", "nccl.ib_gid_index: Value 'three' of type 'str' could not be"),
    (
        "trainer.max_steps",
        "trainer.max_steps: not an override Hydra can read "
        "(missing EQUAL at '<EOF>'); write key=value",
    ),
    ("+trainer.foo=1", "trainer.foo: no such key; allowed: max_steps, lr,"),
    (
        "+foo=1",
        "foo: no such key; allowed: model, data, logger, trainer, optimizer, dist, nccl, deploy",
    ),
    ("+model.width=3", "model.width: no such key; allowed: hidden_dim, depth"),
    ("+deploy.extra.key=1", "deploy.extra: no such key; allowed: name, image,"),
    (
        "trainer.accept_changes=[trainer.lr",
        "trainer.accept_changes=[trainer.lr: not an override Hydra can read "
        "(no viable alternative at input '[trainer.lr')",
    ),
    ("dist.timeout_s=99999999999999", "dist.timeout_s=99999999999999: must be 1 to 604800 seconds"),
    ("dist.checkpoint_timeout_s=-1", "dist.checkpoint_timeout_s=-1: must be 1 to 604800 seconds"),
    ("trainer.seed=-5", "trainer.seed=-5: must be 0 to 2**63-1"),
    ("trainer.seed=9223372036854775808", "trainer.seed=9223372036854775808: must be 0 to 2**63-1"),
    ("data.num_workers=100000", "data.num_workers=100000: must be 0 to 64"),
    (
        "trainer.max_steps=1.5",
        "trainer.max_steps: Value '1.5' of type 'float' could not be converted to Integer",
    ),
    ("trainer.lr=-inf", "trainer.lr=-inf: must be a finite number above 0"),
    ("trainer.lr=null", "trainer.lr: field 'trainer.lr' is not Optional"),
    ("deploy.max_restarts=-1", "deploy.max_restarts=-1: must be 0 to 2147483647"),
    (
        "deploy.flavor=mpijob",
        "deploy.flavor: Invalid value 'mpijob', expected one of "
        "[job, jobset, pytorchjob, trainjob]",
    ),
]


@pytest.mark.parametrize(("override", "message"), BAD, ids=[o[:60] for o, _ in BAD])
def test_each_bad_value_is_one_line_naming_the_key(override, message):
    problem = config_problem(override.split())
    assert problem is not None and "\n" not in problem
    assert problem.startswith(message), problem


def test_more_processes_than_visible_gpus_is_one_line(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "99")
    problem = config_problem(["dist.backend=nccl"])
    assert re.fullmatch(
        r"(dist\.backend=nccl: no CUDA device is visible.*|--nproc-per-node=99: only \d+ GPU.*)",
        problem,
    )


def test_a_good_config_has_no_problem():
    assert (
        config_problem(["nccl=pcie_safe", "trainer.max_steps=10", "hydra.run.dir=/tmp/x"]) is None
    )


def test_check_command_exits_2_with_one_line():
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.check", "dist.timeout_s=0"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr == "config error: dist.timeout_s=0: must be 1 to 604800 seconds (a week)\n"
    ok = subprocess.run([sys.executable, "-m", f"{PACKAGE}.check"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout == "config ok\n"


def test_a_shard_smaller_than_a_batch_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    problem = config_problem(["data.num_samples=200"])
    assert problem == (
        "data.batch_size=128: each optimizer step takes 2 process(es) × 128 × "
        "trainer.grad_accumulation 1 = 256 of the 200 training samples of data.num_samples=200; "
        "use a batch size of at most 100"
    )


@pytest.mark.parametrize("command", ["check", "bench", "k8s"])
def test_every_command_refuses_a_key_added_with_plus_like_a_typo(tmp_path, command):
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.{command}", "+trainer.foo=1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("config error: trainer.foo: no such key; allowed: max_steps,")
    assert len(done.stderr.splitlines()) == 1 and list(tmp_path.iterdir()) == []


# As the README, the NCCL docs and the remedy texts write them; the shell has taken any quotes.
NCCL_FORMS = [
    (
        "nccl.debug=INFO nccl.debug_subsys=INIT,NET",
        {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"},
    ),
    ("nccl.debug_subsys=[INIT,NET]", {"NCCL_DEBUG_SUBSYS": "INIT,NET"}),
    ("nccl.debug_subsys=^ALLOC", {"NCCL_DEBUG_SUBSYS": "^ALLOC"}),
    ("nccl.ib_hca=mlx5_0,mlx5_1", {"NCCL_IB_HCA": "mlx5_0,mlx5_1"}),
    ("nccl.ib_hca='mlx5_0,mlx5_1'", {"NCCL_IB_HCA": "mlx5_0,mlx5_1"}),
    ("nccl.ib_hca==mlx5_0:1", {"NCCL_IB_HCA": "=mlx5_0:1"}),
    ("nccl.socket_ifname=^lo,docker", {"NCCL_SOCKET_IFNAME": "^lo,docker"}),
    ("nccl.env.NCCL_ALGO=Ring", {"NCCL_ALGO": "Ring"}),
    ("+nccl.env.NCCL_ALGO=Ring,Tree", {"NCCL_ALGO": "Ring,Tree"}),
    (
        "nccl.env.NCCL_IBEXT_DISABLE=1 nccl.env.NCCL_BUFFSIZE=8388608",
        {"NCCL_IBEXT_DISABLE": "1", "NCCL_BUFFSIZE": "8388608"},
    ),
    ("nccl.env.TORCH_NCCL_BLOCKING_WAIT=1", {"TORCH_NCCL_BLOCKING_WAIT": "1"}),
    ("nccl.env={NCCL_ALGO:Tree,NCCL_PROTO:LL} nccl.env.NCCL_ALGO=null", {"NCCL_PROTO": "LL"}),
]


@pytest.mark.parametrize(("overrides", "env"), NCCL_FORMS, ids=[o for o, _ in NCCL_FORMS])
def test_nccl_values_work_as_nccl_writes_them(overrides, env):
    from ddp_project.config.compose import compose_and_check
    from ddp_project.nccl import decision as nccl

    config = compose_and_check(["nccl=nccl_default", *overrides.split()])
    assert nccl.decide(config.nccl, None, inherited={}).env == env


def test_train_reads_nccl_values_as_nccl_writes_them(tmp_path):
    """train's own command line (overrides.hydra_argv), which the launcher hands the
    overrides to."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            f"{PACKAGE}.train",
            "--cfg",
            "job",
            "nccl.debug_subsys=INIT,NET",
            "nccl.env.NCCL_ALGO=Ring,Tree",
            "nccl.socket_ifname=^lo",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    nccl = yaml.safe_load(done.stdout)["nccl"]
    assert (nccl["debug_subsys"], nccl["socket_ifname"]) == ("INIT,NET", "^lo")
    assert nccl["env"] == {"NCCL_ALGO": "Ring,Tree"}
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def configs_copy(tmp_path):
    """A project's configs/, to break."""
    import shutil
    from importlib.resources import files

    configs = tmp_path / "configs"
    shutil.copytree(str(files(f"{PACKAGE}.configs")), configs)
    (configs / "local").mkdir(exist_ok=True)
    return configs


@pytest.mark.parametrize("profile", ["auto", "nccl_default", "pcie_safe", "socket", "infiniband"])
def test_the_config_names_the_nccl_profile_it_was_composed_with(profile):
    """What the NCCL report, a failure's remedy block and the bench show, and k8s writes to."""
    from ddp_project.config.compose import compose_and_check

    assert compose_and_check([f"nccl={profile}"], this_node=False).nccl.profile == profile


def test_a_profile_name_other_than_the_chosen_profiles_is_one_line(configs_copy):
    """Set on the command line, or a profile file copied from another without its name changed."""
    from ddp_project.config.compose import compose_and_check, describe
    from ddp_project.config.error import ConfigError

    assert config_problem(["nccl=pcie_safe", "nccl.profile=socket"]) == (
        "nccl.profile=socket: must be pcie_safe, the name of the profile nccl=pcie_safe chose; "
        "keep `profile: pcie_safe` in configs/nccl/pcie_safe.yaml, and choose a profile with "
        "nccl=<name>"
    )
    nccl = configs_copy / "nccl"
    (nccl / "mine.yaml").write_text((nccl / "socket.yaml").read_text())
    with pytest.raises(ConfigError) as failure:
        compose_and_check(["nccl=mine"], configs_copy)
    assert describe(failure.value).startswith("nccl.profile=socket: must be mine, the name of")


@pytest.fixture
def unnamed_profile(configs_copy):
    """A profile of one's own, `mine`: socket's profile without its `profile:` line, as one
    written before nccl.profile existed."""
    nccl = configs_copy / "nccl"
    mine = "".join(
        line
        for line in (nccl / "socket.yaml").read_text().splitlines(keepends=True)
        if not line.startswith("profile:")
    )
    (nccl / "mine.yaml").write_text(mine)


def test_a_profile_file_of_ones_own_without_its_name_is_named_by_its_file(
    configs_copy, unnamed_profile
):
    """A profile written before nccl.profile existed, or without the line: the file's name."""
    from ddp_project.config.compose import compose_and_check

    assert compose_and_check(["nccl=mine"], configs_copy, this_node=False).nccl.profile == "mine"


def test_train_s_task_config_keeps_the_profile_its_hydra_node_chose(configs_copy, unnamed_profile):
    """Hydra hands train's task function the config without its hydra node; main says which
    profile nccl=<name> chose, so a profile file of one's own without `profile:` is still named."""
    from ddp_project.config.compose import compose_train
    from ddp_project.config.validate import check_composed

    composed = compose_train(["nccl=mine"], configs_copy)
    with open_dict(composed):
        composed.pop("hydra")  # as Hydra hands the task function its config
    checked = check_composed(composed, World(), this_node=False, nccl_choice="mine")
    assert checked.nccl.profile == "mine"


NOT_YAML = [
    (
        b"trainer:\n\tmax_steps: 3\n",
        "line 2, column 1: not YAML: found character '\\t' that cannot start any token "
        "(indent YAML with spaces)",
    ),
    (
        b"trainer: [1, 2\nfoo: 1\n",
        "line 2, column 4: not YAML: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence from line 1)",
    ),
    (
        b"trainer:\n  a: 1\n  a: 2\n",
        "line 3, column 3: not YAML: found duplicate key a "
        "(while constructing a mapping from line 2)",
    ),
    (b"\xff\xfe\x00", ": not UTF-8 text (byte 0): not a YAML file"),
    (b"42\n", ": holds a int; a config file holds keys and values"),
    (b"- trainer\n", ": holds a list; a config file holds keys and values"),
    # Hydra reads the header up to the first plain comment: this one puts the keys under local.
    (
        b"# this machine\n# @package _global_\ntrainer:\n  max_steps: 3\n",
        ": needs `# @package _global_` as its first line (as configs/experiment/smoke.yaml "
        "has it): Hydra reads it there only, and without it puts the keys under `local`",
    ),
]


@pytest.mark.parametrize(
    ("text", "message"),
    NOT_YAML,
    ids=["tab", "bracket", "duplicate", "binary", "int", "list", "header"],
)
def test_a_configs_file_hydra_cannot_use_is_one_line_naming_file_and_line(
    configs_copy, text, message
):
    from ddp_project.config.compose import compose_and_check, describe
    from ddp_project.config.error import ConfigError

    (configs_copy / "local" / "default.yaml").write_bytes(text)
    with pytest.raises(ConfigError) as failure:
        compose_and_check([], configs_copy)
    where = f"{configs_copy / 'local' / 'default.yaml'}"
    assert describe(failure.value) == where + ("" if message.startswith(":") else ", ") + message


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        # As the schemas were named before they moved to the root of Hydra's store.
        (
            "mlp_schema",
            "its defaults list names model/mlp_schema, which is no config; a schema is named "
            "from the root: - /mlp_schema",
        ),
        (
            "/mlp_schem",
            "its defaults list names mlp_schem, which is no config; did you mean /mlp_schema? "
            "the schemas: /points_schema, /tokens_schema, /mlp_schema, /gpt_schema",
        ),
        ("/zzz", "its defaults list names zzz, which is no config; the schemas: /points_schema,"),
        (
            "/logger/csvv",
            "its defaults list names logger/csvv, which is no config; did you mean "
            "logger/csv? the logger options: csv, mlflow, tensorboard, wandb",
        ),
    ],
)
def test_a_defaults_entry_that_names_no_config_is_one_line_naming_the_file(
    configs_copy, entry, message
):
    from ddp_project.config.compose import compose_and_check, describe
    from ddp_project.config.error import ConfigError

    mlp = configs_copy / "model" / "mlp.yaml"
    mlp.write_text(mlp.read_text().replace("  - /mlp_schema ", f"  - {entry} ", 1))
    with pytest.raises(ConfigError) as failure:
        compose_and_check([], configs_copy)
    assert describe(failure.value).startswith(f"configs/model/mlp.yaml: {message}")


def test_the_fast_yaml_loader_reads_what_hydras_reads_and_refuses_what_it_refuses(configs_copy):
    """overrides.hydras_yaml_loaders: libyaml's parser under OmegaConf's constructor, checked
    against OmegaConf's own loader on every file the project ships and on each refused above."""
    from ddp_project.config.overrides import hydras_yaml_loaders

    fast, exact = hydras_yaml_loaders()
    assert fast is not exact  # PyYAML's wheels carry libyaml
    for path in sorted(configs_copy.rglob("*.yaml")):
        text = path.read_text()
        assert yaml.load(text, Loader=fast) == yaml.load(text, Loader=exact), path
    for text, _ in NOT_YAML[:3]:
        for loader in (fast, exact):
            with pytest.raises(yaml.YAMLError):
                yaml.load(text.decode(), Loader=loader)
    assert type(yaml.load("a: 1e3\n", Loader=fast)["a"]) is float  # YAML 1.1 reads a string


def test_a_configs_folder_where_a_file_should_be_is_one_line(configs_copy):
    from ddp_project.config.compose import compose_and_check
    from ddp_project.config.error import ConfigError

    (configs_copy / "local" / "default.yaml").mkdir()
    with pytest.raises(ConfigError, match=r"default.yaml: cannot be read \(Is a directory\)$"):
        compose_and_check([], configs_copy)


def test_train_stops_on_a_configs_file_that_is_not_yaml_in_one_line(configs_copy):
    """train's command line (overrides.hydra_argv) reads configs/ before Hydra does: it raises,
    and train's __main__ ends on it, in one line and exit 2."""
    (configs_copy / "local" / "default.yaml").write_text("trainer:\n\tmax_steps: 3\n")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import runpy; from pathlib import Path; from {PACKAGE}.config import overrides; "
            f"overrides.configs_folder = lambda: Path({str(configs_copy)!r}); "
            f"runpy.run_module('{PACKAGE}.train', run_name='__main__')",
            "trainer.max_steps=3",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    where = configs_copy / "local" / "default.yaml"
    assert line.startswith(f"config error: {where}, line 2, column 1: not YAML: found character")


def test_k8s_stops_on_a_configs_file_that_is_not_yaml_in_one_line(configs_copy):
    project = configs_copy.parent
    (project / "pyproject.toml").write_text("")
    (configs_copy / "local" / "default.yaml").write_text("deploy: {nodes: 2\n")
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.k8s"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    where = "configs/local/default.yaml, line 2, column 1"
    assert done.stderr.startswith(f"config error: {where}: not YAML: expected ',' or '}}'")
    assert len(done.stderr.splitlines()) == 1 and not (project / "k8s").exists()


@pytest.mark.parametrize(
    ("nproc", "message"),
    [
        ("0", "error: --nproc-per-node=0: must be at least 1"),
        ("-1", "error: --nproc-per-node=-1: must be at least 1"),
        (
            "4",
            "config error: data.batch_size=128: each optimizer step takes 4 process(es) × 128 × "
            "trainer.grad_accumulation 1 = 512 of the 300 training samples",
        ),
    ],
)
def test_check_for_a_number_of_processes(monkeypatch, capsys, nproc, message):
    """--nproc-per-node checks a node of that many: its shards too, not only its GPUs."""
    from ddp_project.check import main

    monkeypatch.setenv("WORLD_SIZE", "1")  # main sets both; monkeypatch puts them back
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    argv = ["check", "--nproc-per-node", nproc, "data.num_samples=300", "dist.backend=gloo"]
    monkeypatch.setattr(sys, "argv", argv)
    assert main() == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(message)


@pytest.mark.parametrize("hook", ["on_run_start", "on_multirun_start", "on_job_start"])
def test_a_run_a_sweep_and_each_job_of_a_sweep_are_checked(compose_train, capsys, hook):
    from ddp_project.config.compose import ConfigCheck

    with pytest.raises(SystemExit) as stopped:
        bad = compose_train("trainer.max_steps=-1")
        if hook == "on_job_start":  # a sweep's job: a run's one is checked on_run_start
            with open_dict(bad):
                bad.hydra = {"mode": RunMode.MULTIRUN}
        getattr(ConfigCheck(), hook)(config=bad, task_function=None)  # as Hydra calls them
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "config error: trainer.max_steps=-1: must be at least 1\n"


def test_a_runs_one_job_is_checked_once_before_its_run_dir_exists(compose_train):
    """In a run (not a sweep), on_run_start has checked the job's config: on_job_start, which
    Hydra calls after creating the run dir, does not check it again."""
    from ddp_project.config.compose import ConfigCheck

    bad = compose_train("trainer.max_steps=-1")
    with open_dict(bad):
        bad.hydra = {"mode": RunMode.RUN}
    ConfigCheck().on_job_start(config=bad, task_function=None)  # no exit: left to on_run_start


@pytest.mark.parametrize(
    ("argv", "jobs"),
    [(["nccl=socket"], 1), (["-m", "nccl=socket", "trainer.seed=1,2"], 2)],
    ids=["run", "sweep"],
)
def test_train_checks_each_jobs_config_once(tmp_path, monkeypatch, argv, jobs):
    """train's main under Hydra, in this process as `python -m` runs it: ConfigCheck checks each
    job's config (the deploy checks with it) before its run dir exists, and main trains that job's
    own config, read from what Hydra hands it. A sweep checks its base config too, first."""
    from ddp_project import train
    from ddp_project.config import compose as check
    from ddp_project.config import deploy as deploy_config
    from ddp_project.run import rundir

    checked, deploy_checks, trained = [], [], []
    real_check, real_deploy_errors = check.ConfigCheck.check, deploy_config.deploy_errors

    def counted_check(self, cfg):
        checked.append(real_check(self, cfg))
        return checked[-1]

    def counted_deploy_errors(values):
        deploy_checks.append(values)
        return real_deploy_errors(values)

    monkeypatch.setattr(check.ConfigCheck, "check", counted_check)
    monkeypatch.setattr(deploy_config, "deploy_errors", counted_deploy_errors)
    monkeypatch.setattr(train, "main_worker", lambda cfg, *where: trained.append(cfg))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train", *argv, "hydra.run.dir=run", "hydra.sweep.dir=sweep"])
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        train.register_configs()  # as train's __main__ does, before Hydra composes
        train.main()
    finally:  # Hydra's job logging and the run dir's lock: this process goes on
        for handler in set(root.handlers) - set(handlers):
            handler.close()
        root.handlers[:], root.level = handlers, level
        for held in [tmp_path / "run", *(tmp_path / "sweep").glob("*")]:
            rundir.release(held)
    sweep_base = 1 if jobs > 1 else 0
    assert len(checked) == jobs + sweep_base
    assert len(deploy_checks) >= len(checked)
    assert len(trained) == jobs
    assert trained == checked[sweep_base:]  # equal values: each job's own config
    assert [cfg.nccl.profile for cfg in trained] == ["socket"] * jobs  # the name, in the config
    if jobs > 1:  # each job ran with its own checked config
        assert [cfg.trainer.seed for cfg in trained] == [1, 2]

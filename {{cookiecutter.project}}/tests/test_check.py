"""Every config error is one line that names the key and what is allowed, before anything starts."""

import re
import subprocess
import sys

import pytest
from conftest import PACKAGE

from {{ cookiecutter.package }}.check import config_problem

BAD = [
    ("nccl.p2p_disable=maybe", "nccl.p2p_disable: Value 'maybe' is not a valid bool"),
    (
        "nccl.p2p_disabel=true",
        "nccl.p2p_disabel: no such key; allowed: auto, p2p_disable, p2p_level, ib_disable",
    ),
    ("trainer.max_steps=-1", "trainer.max_steps=-1: must be at least 1"),
    (
        "trainer.max_steps=many",
        "trainer.max_steps: Value 'many' of type 'str' could not be converted to Integer",
    ),
    ("trainer.lr=0", "trainer.lr=0.0: must be a finite number above 0"),
    ("trainer.lr=inf", "trainer.lr=inf: must be a finite number above 0"),
    ("trainer.lr=nan", "trainer.lr=nan: must be a finite number above 0"),
    ("trainer.weight_decay=-inf", "trainer.weight_decay=-inf: must be a finite number, 0 or more"),
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
    (
        "trainer.precision=fp8",
        "trainer.precision: Invalid value 'fp8', expected one of [bf16, fp16, fp32]",
    ),
    ("trainer.keep_checkpoints=1", "trainer.keep_checkpoints=1: must be at least 2"),
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
    ("experiment=huge", "experiment=huge: no such option; allowed: gpt2_small, mlp_134m, smoke"),
    ("dist.timeout_s=0", "dist.timeout_s=0: must be 1 to 604800 seconds (a week)"),
    ("dist.backend=mpi", "dist.backend: Invalid value 'mpi', expected one of [auto, nccl, gloo]"),
    ("dist.async_error_handling=5", "dist.async_error_handling=5: must be null, 0, 1, 2 or 3"),
    ("data.batch_size=0", "data.batch_size=0: must be at least 1"),
    (
        "nccl=fastest",
        "nccl=fastest: no such option; allowed: auto, infiniband, nccl_default, pcie_safe, socket",
    ),
    ("+nccl.env.LD_PRELOAD=x.so", "nccl.env.LD_PRELOAD: keys must be NCCL_* variable names"),
    ("nccl.env.NCCL_P2P_DISABLE=1", "nccl.env.NCCL_P2P_DISABLE: no such key"),
    (
        "trainer.max_steps",
        "trainer.max_steps: not an override Hydra can read (missing EQUAL at '<EOF>'); write key=value",
    ),
    ("+trainer.foo=1", "trainer.foo: no such key; allowed: max_steps, lr,"),
    ("+foo=1", "foo: no such key; allowed: model, data, logger, trainer, dist, nccl, deploy"),
    ("+model.width=3", "model.width: no such key; allowed: hidden_dim, depth"),
    ("+deploy.extra.key=1", "deploy.extra: no such key; allowed: name, image,"),
    (
        "trainer.accept_changes=[trainer.lr",
        "trainer.accept_changes=[trainer.lr: not an override Hydra can read (no viable alternative at input '[trainer.lr')",
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
    ("deploy.max_restarts=-1", "deploy.max_restarts=-1: must be 0 or more"),
    (
        "deploy.flavor=mpijob",
        "deploy.flavor: Invalid value 'mpijob', expected one of [job, jobset, pytorchjob, trainjob]",
    ),
]


@pytest.mark.parametrize(("override", "message"), BAD, ids=[o for o, _ in BAD])
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
        "data.batch_size=128: each of 2 process(es) gets 100 of the 200 training samples of data.num_samples=200; "
        "use a batch size of at most 100"
    )


@pytest.mark.parametrize("command", ["check", "bench", "k8s"])
def test_every_command_refuses_a_key_added_with_plus_like_a_typo(tmp_path, command):
    done = subprocess.run([sys.executable, "-m", f"{PACKAGE}.{command}", "+trainer.foo=1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith("config error: trainer.foo: no such key; allowed: max_steps,")
    assert len(done.stderr.splitlines()) == 1 and list(tmp_path.iterdir()) == []

"""End to end on CPU: torchrun with 2 processes over gloo, as users and the Job launch it."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import (
    PACKAGE,
    RUN_NAME,
    launch_command,
    read_metrics,
    shared_folder,
    torchrun,
    train_command,
)
from tolerance import max_abs_diff, reordered
from torch.utils.data import DataLoader, TensorDataset

from ddp_project.run import batches as batches_module

# Installed as sitecustomize in the workers: records each rank's NCCL_* variables at the moment
# init_process_group is called, then lets the call proceed.
RECORD_ENV_AT_INIT = textwrap.dedent(
    """
    import json, os
    import torch.distributed as dist

    _init = dist.init_process_group

    def _recording_init(*args, **kwargs):
        seen = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        path = os.path.join(
            os.environ["INIT_ENV_RECORD_DIR"], f"rank{os.environ.get('RANK', 0)}.json"
        )
        with open(path, "w") as out:
            json.dump(seen, out)
        return _init(*args, **kwargs)

    dist.init_process_group = _recording_init
    """
)


STEPS_COMPARED = ("trainer.max_steps=150", "trainer.checkpoint_every=150")


def record_nccl_env_in(folder: Path) -> dict[str, str]:
    """The environment for a launch whose every rank writes its NCCL env at init_process_group
    as rank<N>.json into folder/records."""
    hook, records = folder / "hook", folder / "records"
    hook.mkdir()
    records.mkdir()
    (hook / "sitecustomize.py").write_text(RECORD_ENV_AT_INIT)
    return {
        "PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}",
        "INIT_ENV_RECORD_DIR": str(records),
    }


@pytest.fixture
def record_nccl_env(tmp_path, monkeypatch):
    """Directory where each rank's NCCL env at init_process_group lands as rank<N>.json."""
    for name, value in record_nccl_env_in(tmp_path).items():
        monkeypatch.setenv(name, value)
    return tmp_path / "records"


def recorded(records, world_size=2) -> list[dict]:
    return [json.loads((records / f"rank{r}.json").read_text()) for r in range(world_size)]


def python_train(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m <package>.train`: one process, no torchrun; one thread, as torchrun gives each
    worker (torch's own default, a thread per core, spends more CPU on spinning than on steps)."""
    return subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def launched_run(request) -> tuple[Path, subprocess.CompletedProcess, Path]:
    """`<project> train` with 2 processes in a default run dir, 150 steps, under nccl=pcie_safe
    with two overrides and NCCL_* inherited from the environment, each rank's NCCL env at init
    recorded: (launch dir, the launch, the records). Batches of 128 from 2 DataLoader workers,
    with a checkpoint at the end: the run that test_gradient_accumulation_matches_one_large_batch
    and test_batches_cut_on_the_device_are_the_ones_the_loader_gives must match."""
    folder = shared_folder(request)
    cwd = folder / "launch"
    cwd.mkdir()
    env = {
        **os.environ,
        **record_nccl_env_in(folder),
        "NCCL_IB_DISABLE": "0",
        "NCCL_SOCKET_IFNAME": "lo",
    }
    done = subprocess.run(
        launch_command(
            "--nproc-per-node",
            "2",
            "nccl=pcie_safe",
            "nccl.p2p_disable=false",
            "nccl.debug=WARN",
            *STEPS_COMPARED,
            "trainer.log_every=25",
            "data.num_workers=2",
        ),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd, done, folder / "records"


def test_two_processes_learn_in_one_run_dir(launched_run):
    cwd, _, _ = launched_run
    (run_dir,) = (cwd / "outputs").iterdir()  # both ranks chose the same dir
    assert sorted(p.name for p in cwd.iterdir()) == ["outputs"]  # nothing outside it
    assert (
        RUN_NAME.fullmatch(run_dir.name)
        and f"run {run_dir.name}" in (run_dir / "train.log").read_text()
    )
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [25, 50, 75, 100, 125, 150]
    assert rows[-1]["loss"] < 0.75 * rows[0]["loss"]
    assert rows[-1]["accuracy"] > rows[0]["accuracy"] + 0.05
    assert all(row["world_size"] == 2 and row["samples_per_s"] > 0 for row in rows)
    assert (run_dir / ".hydra" / "config.yaml").exists()
    log = (run_dir / "train.log").read_text()
    assert "world size 2, backend gloo" in log and "step 150/150" in log
    assert "plot metrics.png" in log and (run_dir / "metrics.png").stat().st_size > 10_000


def test_validation_on_two_processes_is_what_evaluate_scores_on_two(launched_run):
    """Every trainer.val_every steps (100) and at the last: each rank scores its shard of the
    held-out data, all-reduced; evaluate's two processes score the final checkpoint the same."""
    cwd, _, _ = launched_run
    (run_dir,) = (cwd / "outputs").iterdir()
    rows = {row["step"]: row for row in read_metrics(run_dir)}
    assert [step for step, row in rows.items() if row["val_loss"] is not None] == [100, 150]
    assert all(rows[step]["val_time_s"] > 0 for step in (100, 150))
    assert rows[150]["val_loss"] < rows[100]["val_loss"]
    done = subprocess.run(
        [*train_command(nproc=2)[:-2], "-m", f"{PACKAGE}.evaluate", f"ckpt={run_dir}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    scored = json.loads((run_dir / "eval" / "step_000000150.json").read_text())
    assert scored["world_size"] == 2
    assert (scored["loss"], scored["accuracy"]) == (
        rows[150]["val_loss"],
        rows[150]["val_accuracy"],
    )


def test_the_profile_and_overrides_are_in_place_on_every_rank_at_init(launched_run):
    """nccl=pcie_safe sets its fields, nccl.p2p_disable=false flips one, nccl.debug adds one; the
    profile's NCCL_IB_DISABLE=1 beats the 0 inherited from the environment, which keeps what the
    config does not set."""
    _, done, records = launched_run
    for env in recorded(records):
        assert env == {
            "NCCL_P2P_DISABLE": "0",
            "NCCL_IB_DISABLE": "1",
            "NCCL_DEBUG": "WARN",
            "NCCL_SOCKET_IFNAME": "lo",
        }
    # over gloo NCCL is not in play: the run keeps quiet (test_nccl.py checks the warning)
    assert "NCCL_IB_DISABLE" not in done.stdout + done.stderr


def test_explicit_run_dir_holds_everything_with_checkpoints_off_and_auto_gives_every_rank_one_env(
    tmp_path,
):
    """nccl=auto: every rank gets the same env, from one probe written by local rank 0."""
    cwd = tmp_path / "launch"
    cwd.mkdir()
    run_dir = cwd / "runs" / "first"
    done = torchrun(
        cwd,
        "nccl=auto",
        "trainer.max_steps=10",
        "trainer.log_every=10",
        "trainer.checkpoint_every=0",
        f"hydra.run.dir={run_dir}",
        env=record_nccl_env_in(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in cwd.iterdir()) == ["runs"]
    assert not (run_dir / "checkpoints").exists()
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [10] and rows[0]["step_time_ms"] > 0
    assert not (run_dir / "metrics.png").exists()  # one row draws no curve
    rank0, rank1 = recorded(tmp_path / "records")
    assert rank0 == rank1 and rank0["NCCL_IB_DISABLE"] == "1"
    # Written once, by local rank 0:
    assert len(list((run_dir / "nccl").glob("probe-*.json"))) == 1
    log = (run_dir / "train.log").read_text()
    assert "node probe:" not in log and "NCCL environment" not in log  # gloo uses none of it
    assert "on CPU trainer.precision=bf16 and data.pin_memory=true apply to GPUs only" in log


def test_bad_override_fails_before_any_process_group(tmp_path, record_nccl_env):
    """In one process (python -m): the worker's own check, as under torchrun."""
    done = python_train(tmp_path, "nccl.p2p_disable=maybe")
    assert done.returncode != 0
    assert "nccl.p2p_disable" in done.stderr
    assert list(record_nccl_env.iterdir()) == []  # init_process_group was never reached
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook", "records"]  # no outputs/


def test_out_of_range_value_stops_in_one_line_and_leaves_nothing(tmp_path, record_nccl_env):
    """Two processes: each finds it, one line says it."""
    done = torchrun(tmp_path, "trainer.max_steps=-1", timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("config error:")]
    assert errors == ["config error: trainer.max_steps=-1: must be at least 1"]
    assert list(record_nccl_env.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hook", "records"]  # no outputs/


def final_weights(run_dir):
    import torch

    (last,) = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1:]
    return torch.load(last, weights_only=True)["model"]


def large_batch_run(launched_run) -> Path:
    """The run dir of launched_run: batches of 128 from 2 DataLoader workers."""
    (run_dir,) = (launched_run[0] / "outputs").iterdir()
    return run_dir


def test_gradient_accumulation_matches_one_large_batch_and_torchrun_names_its_run_dir(
    tmp_path, launched_run
):
    """Two micro-batches of 64 with the sync only on the second (DDP no_sync) take the same step
    as one batch of 128: the sampler cuts the same shuffled order into halves. Launched by
    torchrun alone, in a default run dir: named as every launch mode names it
    (test_every_launch_mode_names_its_run_dir_the_same_way), agreed by both ranks."""
    accumulated = torchrun(
        tmp_path,
        *STEPS_COMPARED,
        "data.batch_size=64",
        "trainer.grad_accumulation=2",
    )
    assert accumulated.returncode == 0, accumulated.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs").iterdir()  # both ranks chose the same dir
    assert RUN_NAME.fullmatch(run_dir.name), run_dir.name
    assert f"run {run_dir.name}" in (run_dir / "train.log").read_text()
    difference = max_abs_diff(final_weights(large_batch_run(launched_run)), final_weights(run_dir))
    assert difference <= reordered(terms=2 * 128, steps=150)  # 2 ranks' 128 samples a step
    assert [row["step"] for row in read_metrics(run_dir)] == [25, 50, 75, 100, 125, 150]


def test_batches_cut_on_the_device_are_the_ones_the_loader_gives(tmp_path, launched_run):
    on_device = torchrun(
        tmp_path,
        *STEPS_COMPARED,
        "data.on_device=true",
        f"hydra.run.dir={tmp_path / 'on_device'}",
    )
    assert on_device.returncode == 0, on_device.stderr[-3000:]
    assert (
        max_abs_diff(
            final_weights(large_batch_run(launched_run)), final_weights(tmp_path / "on_device")
        )
        == 0
    )


def signal_mask(pid: int, field: str) -> int:
    """SigBlk, SigIgn...: the bit of signal n is 1 << (n - 1)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1], 16)
    raise LookupError(field)


def test_loader_workers_survive_sigterm_and_sigint_from_the_moment_they_fork():
    """torchrun sends SIGTERM to each trainer's process group, and Ctrl-C sends SIGINT to all of
    it, loader workers included: one that died of either, even just after its fork, would end
    the run without a checkpoint."""
    loader = DataLoader(
        TensorDataset(torch.arange(8.0)),
        batch_size=2,
        num_workers=2,
        persistent_workers=True,
        worker_init_fn=batches_module.ignore_sigterm,
    )
    batches = batches_module.epoch_batches(loader)
    stop_signals = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))
    try:
        next(batches), next(batches)  # batch i comes from worker i % 2: both have run their init
        workers = [
            int(pid)
            for task in Path("/proc/self/task").iterdir()
            for pid in (task / "children").read_text().split()
        ]
        assert len(workers) == 2
        for pid in workers:
            assert signal_mask(pid, "SigBlk") & stop_signals == stop_signals  # from the fork on
            assert signal_mask(pid, "SigIgn") & stop_signals == stop_signals  # then ignored
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        assert len(list(batches)) == 2
    finally:
        batches._shutdown_workers()  # a failed assert would keep them, and pytest, alive
    assert not signal_mask(os.getpid(), "SigBlk") & stop_signals  # the trainer still hears them


@pytest.fixture(scope="module")
def gpt_run(request) -> Path:
    """model=gpt on data=tokens under plain python (one process, no torchrun), in a default run
    dir: the launch dir."""
    cwd = shared_folder(request)
    done = python_train(
        cwd,
        "model=gpt",
        "data=tokens",
        "model.d_model=64",
        "model.n_layer=2",
        "data.seq_len=32",
        "data.vocab_size=64",
        "trainer.lr=0.01",
        "trainer.max_steps=60",
        "trainer.log_every=20",
        "trainer.compile=true",  # eager on a CPU, with a line that says so
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd


def test_compile_on_a_cpu_runs_eager_and_says_so(gpt_run):
    (run_dir,) = (gpt_run / "outputs").iterdir()
    log = (run_dir / "train.log").read_text()
    assert "trainer.compile=true: eager on cpu (torch.compile is used on CUDA only)" in log
    assert "torch.compile: the first step took" not in log


def test_the_gpt_learns_the_token_rule_and_no_better(gpt_run):
    """model=gpt on data=tokens: each next token is a fixed function of the one before plus one
    of NOISE values, so the loss falls from log(vocab) to near log(NOISE), never under it."""
    import math

    from ddp_project.data import NOISE

    (run_dir,) = (gpt_run / "outputs").iterdir()
    losses = [row["loss"] for row in read_metrics(run_dir)]
    assert losses[0] < math.log(64) and losses[-1] < math.log(NOISE) + 0.25
    assert min(losses) > math.log(NOISE) - 0.05


def test_every_launch_mode_names_its_run_dir_the_same_way(tmp_path, launched_run, gpt_run):
    """A sortable start time and a short id, agreed by every rank: under the launcher
    (launched_run), under plain python (gpt_run), and for a -m sweep (numbered runs below it);
    torchrun alone:
    test_gradient_accumulation_matches_one_large_batch_and_torchrun_names_its_run_dir."""
    sweep = python_train(tmp_path, "-m", "trainer.max_steps=1,2")
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    runs = {
        "launcher": (launched_run[0] / "outputs", 150),
        "python": (gpt_run / "outputs", 60),
        "sweep": (tmp_path / "outputs", None),
    }
    for mode, (outputs, steps) in runs.items():
        (run_dir,) = outputs.iterdir()  # every rank chose the same one
        assert RUN_NAME.fullmatch(run_dir.name), (mode, run_dir.name)
        if mode == "sweep":
            assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["0", "1"]
        else:
            assert read_metrics(run_dir)[-1]["step"] == steps
            assert f"run {run_dir.name}" in (run_dir / "train.log").read_text()

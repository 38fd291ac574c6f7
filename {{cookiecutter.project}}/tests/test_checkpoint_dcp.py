"""trainer.checkpoint_format=dcp: every rank writes a share of one step_<N>.dcp folder, which
loads on any world size and in either direction of a format switch, and keeps the file format's
guarantees (counted once whole, a full disk one line, partial folders removed, best.dcp linked)."""

import errno
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import PACKAGE, shared_folder, torchrun
from tolerance import max_abs_diff, reordered

from ddp_project.core.world import World
from ddp_project.run import checkpoint
from ddp_project.run.checkpoint import Checkpointer, Progress

ONE = World()


@pytest.fixture(scope="module")
def dcp_run(request):
    """2 processes, 40 steps, a DCP checkpoint every 10 (3 kept) and best.dcp."""
    folder = shared_folder(request)
    done = torchrun(
        folder,
        "trainer.max_steps=40",
        "trainer.checkpoint_every=10",
        "trainer.val_every=10",
        "trainer.checkpoint_format=dcp",
        "hydra.run.dir=run",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return folder / "run"


def test_every_rank_writes_a_share_and_the_keep_policy_counts_folders(dcp_run):
    folders = sorted(p.name for p in (dcp_run / "checkpoints").iterdir())
    assert folders == ["best.dcp", "step_000000020.dcp", "step_000000030.dcp", "step_000000040.dcp"]
    newest = dcp_run / "checkpoints" / "step_000000040.dcp"
    shares = {p.name: p.stat().st_size for p in newest.glob("*.distcp")}
    assert sorted(shares) == ["__0_0.distcp", "__1_0.distcp"]
    # DDP's replicated tensors dealt out between the two ranks, not all written by rank 0
    assert min(shares.values()) > 0.25 * sum(shares.values()), shares
    state = checkpoint.read(newest)
    assert state["step"] == 40 and state["world_size"] == 2 and state["format"] == "dcp"
    assert state["data"]["samples_in_epoch"] > 0 and len(state["rng"]) == 2
    # best.dcp: the same files as its step's folder, not a second write
    best = dcp_run / "checkpoints" / "best.dcp"
    step = checkpoint.read(best, mmap=True)["step"]
    source = dcp_run / "checkpoints" / f"step_{step:09d}.dcp"
    assert all(os.path.samefile(f, source / f.name) for f in best.iterdir())


@pytest.mark.parametrize(
    ("nproc", "written_as"),
    [(2, "trainer.checkpoint_format=dcp"), (1, "trainer.checkpoint_format=file")],
)
def test_a_resume_on_the_same_or_another_world_size_ends_where_the_uninterrupted_run_did(
    dcp_run, tmp_path, nproc, written_as
):
    """From step 20 to 40: on 2 processes bit for bit; on 1 (accumulating 2 micro-batches, the
    same samples) but for the order of the sums, and writing the file format from there."""
    run = tmp_path / "run"
    shutil.copytree(dcp_run, run)
    for later in ("step_000000030.dcp", "step_000000040.dcp"):
        shutil.rmtree(run / "checkpoints" / later)
    done = torchrun(tmp_path, "trainer.max_steps=40", written_as, "hydra.run.dir=run", nproc=nproc)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from the checkpoint of step 20 (epoch 0, sample 5120 of it)" in done.stdout
    suffix = ".dcp" if nproc == 2 else ".pt"
    resumed = checkpoint.read(run / "checkpoints" / f"step_000000040{suffix}")
    uninterrupted = checkpoint.read(dcp_run / "checkpoints" / "step_000000040.dcp")
    assert resumed["data"] == uninterrupted["data"]
    # 1 process adds each step's 256 samples in another order than 2 do, for 20 steps
    apart = 0 if nproc == 2 else reordered(terms=256, steps=20)
    assert max_abs_diff(resumed["model"], uninterrupted["model"]) <= apart


@pytest.mark.slow  # a long end-to-end run: file reads and DCP writes each have faster tests
def test_a_file_format_run_goes_on_in_dcp(dcp_run, tmp_path):
    """The other direction: step_<N>.pt resumed, the next checkpoints folders."""
    run = tmp_path / "run"
    done = torchrun(
        tmp_path, "trainer.max_steps=20", "trainer.checkpoint_every=10", "hydra.run.dir=run"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    done = torchrun(
        tmp_path,
        "trainer.max_steps=40",
        "trainer.checkpoint_every=10",
        "trainer.checkpoint_format=dcp",
        "hydra.run.dir=run",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from the checkpoint of step 20" in done.stdout
    resumed = checkpoint.read(run / "checkpoints" / "step_000000040.dcp")
    uninterrupted = checkpoint.read(dcp_run / "checkpoints" / "step_000000040.dcp")
    assert max_abs_diff(resumed["model"], uninterrupted["model"]) == 0


def test_evaluate_scores_a_dcp_folder_as_training_validated_it(dcp_run):
    for ckpt in (dcp_run, dcp_run / "checkpoints" / "step_000000030.dcp"):
        done = subprocess.run(
            [sys.executable, "-m", f"{PACKAGE}.evaluate", f"ckpt={ckpt}"],
            cwd=dcp_run.parent,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    log = (dcp_run / "train.log").read_text()
    val_loss = next(line for line in log.splitlines() if "step 30/40" in line).split("val loss ")[
        1
    ][:6]
    assert f"step_000000030.dcp: loss {val_loss}," in done.stdout


# --- in one process, no process group ----------------------------------------------------------


def checkpointer(run_dir, model, keep=2, keep_best=False):
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    states = {"model": model, "optimizer": optimizer, "data": Progress()}
    return Checkpointer(
        run_dir,
        every=10,
        keep=keep,
        keep_best=keep_best,
        world=ONE,
        group=None,
        states=states,
        config={},
        options={},
        asynchronous=False,
        checkpoint_format="dcp",
    )


def test_a_folder_with_a_share_cut_short_is_not_loaded_not_counted_and_not_deleted(
    tmp_path, caplog
):
    saver = checkpointer(tmp_path, torch.nn.Linear(4, 2))
    for step in (10, 20):
        saver.write(step)
    share = next((tmp_path / "checkpoints" / "step_000000020.dcp").glob("*.distcp"))
    share.write_bytes(share.read_bytes()[:100])
    with pytest.raises(ValueError, match="cut short"):
        checkpoint.read(share.parent, mmap=True)
    state = checkpointer(tmp_path, torch.nn.Linear(4, 2)).load()
    assert state["step"] == 10
    caplog.set_level(logging.WARNING)
    saver.write(30)
    saver.write(40)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000000020.dcp", "step_000000030.dcp", "step_000000040.dcp"]
    assert "step_000000020.dcp in" in caplog.text and "left alone" in caplog.text


def test_partial_folders_are_removed_and_a_folder_set_aside_is_put_back_at_the_next_start(tmp_path):
    saver = checkpointer(tmp_path, torch.nn.Linear(4, 2), keep_best=True)
    saver.write(10, val_loss=1.0, also_best=True)
    folder = tmp_path / "checkpoints"
    # killed inside replace_folder(): best.dcp renamed aside, the new one not yet in place
    os.replace(folder / "best.dcp", folder / ".partial-old-best.dcp")
    shutil.copytree(folder / "step_000000010.dcp", folder / ".partial-step_000000020.dcp")
    checkpointer(tmp_path, torch.nn.Linear(4, 2), keep_best=True)
    assert sorted(p.name for p in folder.iterdir()) == ["best.dcp", "step_000000010.dcp"]
    assert checkpoint.read(folder / "best.dcp", mmap=True)["val_loss"] == 1.0


def test_a_full_disk_under_a_dcp_write_is_one_line_and_the_good_folders_stay(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem

    saver = checkpointer(tmp_path, torch.nn.Linear(4, 2))
    saver.write(10)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "_write_item", full)
    with pytest.raises(checkpoint.CheckpointFailed) as failed:
        saver.write(20)
    line = str(failed.value)
    assert line.startswith("rank 0 could not write ") and "No space left on device" in line
    assert "step_000000010.dcp, the newest checkpoint before it, is kept" in line
    assert "\n" not in line
    monkeypatch.undo()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_000000010.dcp"]  # the partial folder gone with the write
    assert checkpoint.read(tmp_path / "checkpoints" / names[0])["step"] == 10


def test_a_folder_that_does_not_fit_the_model_is_one_line_naming_the_tensor(tmp_path):
    checkpointer(tmp_path, torch.nn.Linear(4, 2)).write(10)
    with pytest.raises(checkpoint.Incompatible) as refused:
        checkpointer(tmp_path, torch.nn.Linear(4, 3)).load()
    line = str(refused.value)
    assert line.startswith("step_000000010.dcp does not fit this run's model and optimizer: ")
    assert "torch.Size([2, 4])" in line and "weight" in line and "\n" not in line

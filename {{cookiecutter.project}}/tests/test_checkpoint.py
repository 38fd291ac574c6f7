"""The Checkpointer in-process with one CPU process, no process group: what is kept, what is
never deleted, what a checkpoint gives back, and when it writes. How a stop signal is agreed on is
in test_stopping.py, the loop's own guards in test_trainer.py."""

import errno
import logging
import os
import random
import threading

import pytest
import torch

from ddp_project.core.world import World
from ddp_project.run import checkpoint
from ddp_project.run.checkpoint import Checkpointer, Diverged, Progress

ONE = World()


def checkpointer(run_dir, model, keep=2, every=10, keep_best=False, asynchronous=False):
    """Synchronous unless asked: these tests read the files a write leaves at once."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    states = {"model": model, "optimizer": optimizer, "data": Progress()}
    return Checkpointer(
        run_dir,
        every=every,
        keep=keep,
        keep_best=keep_best,
        world=ONE,
        group=None,
        states=states,
        config={},
        options={},
        asynchronous=asynchronous,
    )


def names(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_files_that_do_not_read_back_are_never_ranked_nor_deleted(tmp_path, caplog):
    """Zero-byte files with higher steps, as a crashed filesystem leaves them: the old policy
    counted them as the newest and deleted every checkpoint the run wrote."""
    (tmp_path / "checkpoints").mkdir()
    strays = [f"step_{step:09d}.pt" for step in (999_999_997, 999_999_998, 999_999_999)]
    for name in strays:
        (tmp_path / "checkpoints" / name).touch()
    saver = checkpointer(tmp_path, torch.nn.Linear(4, 2))
    with caplog.at_level(logging.WARNING):
        for step in range(1, 51):
            saver.save(step)
    assert names(tmp_path) == ["step_000000040.pt", "step_000000050.pt", *strays]
    warnings = [r.getMessage() for r in caplog.records if "do not read back" in r.getMessage()]
    assert len(warnings) == 1 and all(name in warnings[0] for name in strays)


def test_the_checkpoint_just_written_is_kept_even_below_newer_readable_ones(tmp_path):
    model = torch.nn.Linear(4, 2)
    ahead = checkpointer(tmp_path, model, keep=2)
    for step in (80, 90):
        ahead.write(step)  # a later run of this dir got further
    checkpointer(tmp_path, model, keep=2).write(10)
    assert names(tmp_path) == ["step_000000010.pt", "step_000000080.pt", "step_000000090.pt"]


def test_a_corrupt_file_is_left_alone_and_the_newest_readable_is_loaded(tmp_path):
    model = torch.nn.Linear(4, 2)
    saver = checkpointer(tmp_path, model)
    saver.write(10)
    saver.write(20)
    newest = tmp_path / "checkpoints" / "step_000000020.pt"
    newest.write_bytes(newest.read_bytes()[:500])  # a node died mid-copy
    resumed = checkpointer(tmp_path, torch.nn.Linear(4, 2))
    assert resumed.load()["step"] == 10
    resumed.write(30)
    assert names(tmp_path) == ["step_000000010.pt", "step_000000020.pt", "step_000000030.pt"]


def test_left_over_partial_writes_are_removed_at_the_next_start(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    partial = tmp_path / "checkpoints" / ".partial-abc123.pt"
    partial.write_bytes(b"half a checkpoint")
    checkpointer(tmp_path, torch.nn.Linear(4, 2))
    assert not partial.exists()


def test_non_finite_weights_are_never_written(tmp_path):
    model = torch.nn.Linear(4, 2)
    saver = checkpointer(tmp_path, model)
    saver.write(10)
    good = (tmp_path / "checkpoints" / "step_000000010.pt").read_bytes()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(Diverged, match="step 20: a weight is not finite"):
        saver.save(20)
    assert names(tmp_path) == ["step_000000010.pt"]
    assert (tmp_path / "checkpoints" / "step_000000010.pt").read_bytes() == good


def test_a_forced_save_writes_off_the_schedule_but_never_while_checkpoints_are_off(tmp_path):
    """The step the ranks agreed to stop at is rarely a multiple of `every`: the Trainer forces
    the write there. With checkpoint_every=0 nothing is written, forced or not."""
    saver = checkpointer(tmp_path / "on", torch.nn.Linear(4, 2), every=10)
    saver.save(7)
    assert not (tmp_path / "on" / "checkpoints").exists()
    saver.save(7, force=True)
    assert names(tmp_path / "on") == ["step_000000007.pt"]
    off = checkpointer(tmp_path / "off", torch.nn.Linear(4, 2), every=0)
    off.save(7, last_step=True, force=True)
    assert not (tmp_path / "off" / "checkpoints").exists()


def test_progress_round_trips_through_its_state():
    progress = Progress(7, 2, 5)
    restored = Progress()
    restored.load_state_dict(progress.state_dict())
    assert restored == progress and checkpoint.step_of(checkpoint.Path("step_000000042.pt")) == 42
    assert progress.state_dict() == {"step": 7, "epoch": 2, "samples_in_epoch": 5}


class FullDisk:
    """A file on a file system with `room` bytes left: writes beyond it fail as the OS fails
    them (torch.save then raises a RuntimeError of its own during the OSError)."""

    def __init__(self, file, room: int) -> None:
        self.file, self.room = file, room

    def write(self, data) -> int:
        self.room -= len(data)
        if self.room < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def test_a_full_disk_is_named_as_the_cause_and_the_good_checkpoints_stay(tmp_path, monkeypatch):
    saver = checkpointer(tmp_path, torch.nn.Linear(4, 2))
    saver.write(10)
    good = (tmp_path / "checkpoints" / "step_000000010.pt").read_bytes()
    fdopen = os.fdopen
    monkeypatch.setattr(checkpoint.os, "fdopen", lambda *a: FullDisk(fdopen(*a), room=600))
    with pytest.raises(checkpoint.CheckpointFailed) as failed:
        saver.write(20)
    message = str(failed.value)
    assert "could not write" in message and "step_000000020.pt" in message
    assert "[Errno 28] No space left on device" in message  # not torch's "unexpected pos"
    assert "step_000000010.pt, the newest checkpoint before it, is kept" in message
    assert f"free space there and relaunch with hydra.run.dir={tmp_path}" in message
    assert names(tmp_path) == ["step_000000010.pt"]  # the partial write is gone
    assert (tmp_path / "checkpoints" / "step_000000010.pt").read_bytes() == good


def test_a_checkpoint_gives_back_the_weights_optimizer_position_and_rng_it_was_written_with(
    tmp_path,
):
    def checkpointer_of(model, progress):
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        states = {"model": model, "optimizer": optimizer, "data": progress}
        saver = Checkpointer(
            tmp_path,
            every=10,
            keep=2,
            world=ONE,
            group=None,
            states=states,
            config={"model": {"depth": 2}},
            options={"model": "resmlp"},
        )
        return saver, optimizer

    model, progress = torch.nn.Linear(4, 2), Progress(12, 1, 5)
    saver, optimizer = checkpointer_of(model, progress)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()  # moments to keep
    saver.write(12)  # asynchronous, as the Trainer's
    saver.settle()
    expected_rng = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    fresh, fresh_progress = torch.nn.Linear(4, 2), Progress()
    loader, fresh_optimizer = checkpointer_of(fresh, fresh_progress)
    state = loader.load()
    assert state["step"] == 12 and fresh_progress == progress
    # which option built it: its keys alone may fit several (validate.saved_option)
    assert (state["config"], state["options"]) == ({"model": {"depth": 2}}, {"model": "resmlp"})
    weights, loaded = model.state_dict(), fresh.state_dict()
    assert all(torch.equal(weights[key], loaded[key]) for key in weights)
    before, after = optimizer.state_dict()["state"][0], fresh_optimizer.state_dict()["state"][0]
    assert all(torch.equal(before[key], after[key]) for key in ("exp_avg", "exp_avg_sq", "step"))
    assert torch.equal(torch.rand(3), expected_rng[0]) and random.random() == expected_rng[1]


def test_best_pt_is_replaced_whole_or_not_at_all_and_one_that_does_not_read_back_is_replaced(
    tmp_path, monkeypatch, caplog
):
    model = torch.nn.Linear(4, 2)
    saver = checkpointer(tmp_path, model, keep_best=True)
    saver.save_best(10, 2.0, written=False)
    best = tmp_path / "checkpoints" / checkpoint.BEST
    good = best.read_bytes()
    fdopen = os.fdopen
    monkeypatch.setattr(checkpoint.os, "fdopen", lambda *a: FullDisk(fdopen(*a), room=600))
    with pytest.raises(
        checkpoint.CheckpointFailed, match=r"could not write .*best\.pt: \[Errno 28\]"
    ):
        saver.save_best(20, 1.0, written=False)
    monkeypatch.undo()
    assert names(tmp_path) == [checkpoint.BEST] and best.read_bytes() == good  # no partial left
    assert saver.best_loss == 2.0  # the bar is what best.pt holds
    best.write_bytes(b"not a checkpoint")
    resumed = checkpointer(tmp_path, model, keep_best=True)
    with caplog.at_level(logging.WARNING):
        assert resumed.load() is None  # no step checkpoint to resume from
    assert f"{best} does not read back" in caplog.text and resumed.best_loss == float("inf")
    resumed.save_best(30, 5.0, written=False)
    assert torch.load(best, weights_only=True)["step"] == 30


def test_best_pt_is_a_second_name_of_the_checkpoint_of_its_step_or_a_copy_without_hard_links(
    tmp_path, monkeypatch
):
    """A validation at a checkpoint's step (the default: both every 100 steps) costs no second
    write of the same state; elsewhere, or where the file system has no hard links, a write."""
    saver = checkpointer(tmp_path, torch.nn.Linear(4, 2), every=10, keep_best=True)
    best = tmp_path / "checkpoints" / checkpoint.BEST
    assert saver.save(10, val_loss=1.0) is True
    saver.save_best(10, 1.0, written=True)
    assert best.stat().st_ino == (tmp_path / "checkpoints" / "step_000000010.pt").stat().st_ino
    assert torch.load(best, weights_only=True)["val_loss"] == 1.0  # the bar a resume reads
    assert saver.save(15, val_loss=0.5) is False
    saver.save_best(15, 0.5, written=False)
    assert torch.load(best, weights_only=True)["step"] == 15 and best.stat().st_nlink == 1
    monkeypatch.setattr(
        checkpoint.os, "link", lambda *a: (_ for _ in ()).throw(PermissionError(1, "no"))
    )
    assert saver.save(20, val_loss=0.25) is True
    saver.save_best(20, 0.25, written=True)
    assert torch.load(best, weights_only=True)["step"] == 20 and best.stat().st_nlink == 1
    assert names(tmp_path) == [
        checkpoint.BEST,
        "step_000000010.pt",
        "step_000000020.pt",
    ]  # no partial


class HeldWrites:
    """Holds every checkpoint write at its start until released: a write that outlasts the
    steps after it, as a 2 GB write does on a slow disk."""

    def __init__(self, monkeypatch) -> None:
        self.release = threading.Event()
        write = checkpoint.write_atomically

        def held(state, path):
            assert self.release.wait(timeout=60), "a held write was never released"
            write(state, path)

        monkeypatch.setattr(checkpoint, "write_atomically", held)


def test_training_goes_on_during_a_write_and_the_file_holds_the_state_of_its_step(
    tmp_path, monkeypatch
):
    model = torch.nn.Linear(4, 2)
    saver = checkpointer(tmp_path, model, asynchronous=True)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    held = HeldWrites(monkeypatch)
    saver.write(10)  # returns with the write still to do
    assert saver.writer.busy() and not (tmp_path / "checkpoints" / "step_000000010.pt").exists()
    with torch.no_grad():
        model.weight.fill_(7.0)  # the next steps change the weights in place
    held.release.set()
    saver.settle()
    saved = torch.load(tmp_path / "checkpoints" / "step_000000010.pt", weights_only=True)
    assert all(torch.equal(saved["model"][key], before[key]) for key in before)
    assert saver.newest.name == "step_000000010.pt"


def test_a_save_during_the_last_write_waits_for_it_and_says_so(tmp_path, monkeypatch, caplog):
    saver = checkpointer(tmp_path, torch.nn.Linear(4, 2), asynchronous=True)
    held = HeldWrites(monkeypatch)
    saver.write(10)
    threading.Timer(0.3, held.release.set).start()
    with caplog.at_level(logging.INFO):
        saver.write(20)  # the snapshot's buffers are the last write's: it waits
    saver.settle()
    assert "for the write of checkpoints/step_000000010.pt to finish" in caplog.text
    assert names(tmp_path) == ["step_000000010.pt", "step_000000020.pt"]


def test_a_background_write_that_fails_is_raised_by_the_next_settle_and_the_good_ones_stay(
    tmp_path, monkeypatch
):
    saver = checkpointer(tmp_path, torch.nn.Linear(4, 2), asynchronous=True)
    saver.write(10)
    saver.settle()
    good = (tmp_path / "checkpoints" / "step_000000010.pt").read_bytes()
    fdopen = os.fdopen
    monkeypatch.setattr(checkpoint.os, "fdopen", lambda *a: FullDisk(fdopen(*a), room=600))
    saver.write(20)  # no error here: the write goes on in the background
    saver.writer.thread.join()
    assert saver.failed()  # what the Trainer tells every rank at the next log window
    with pytest.raises(checkpoint.CheckpointFailed) as failed:
        saver.settle()
    assert "rank 0 could not write" in str(failed.value) and "[Errno 28]" in str(failed.value)
    assert "step_000000010.pt, the newest checkpoint before it, is kept" in str(failed.value)
    assert names(tmp_path) == ["step_000000010.pt"]
    assert (tmp_path / "checkpoints" / "step_000000010.pt").read_bytes() == good
    assert not saver.failed()  # raised once


def test_a_write_that_does_not_read_back_is_not_counted_and_deletes_nothing(tmp_path, monkeypatch):
    """A file system that acknowledges a write it did not keep: the old checkpoints stay."""
    saver = checkpointer(tmp_path, torch.nn.Linear(4, 2), keep=2, asynchronous=True)
    for step in (10, 20):
        saver.write(step)
    saver.settle()
    write = checkpoint.write_atomically

    def lost(state, path):
        write(state, path)
        path.write_bytes(b"")  # what the disk gave back

    monkeypatch.setattr(checkpoint, "write_atomically", lost)
    saver.write(30)
    with pytest.raises(checkpoint.CheckpointFailed, match="step_000000030.pt"):
        saver.settle()
    assert {"step_000000010.pt", "step_000000020.pt"} <= set(names(tmp_path))
    assert saver.newest.name == "step_000000020.pt"


def test_tied_weights_stay_one_tensor_in_the_file(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight  # as a GPT ties its embedding and its output layer
    saver = checkpointer(tmp_path, model, asynchronous=True)
    saver.write(10)
    saver.settle()
    saved = torch.load(tmp_path / "checkpoints" / "step_000000010.pt", weights_only=True)["model"]
    assert saved["0.weight"].data_ptr() == saved["1.weight"].data_ptr()


def test_a_snapshot_owns_its_tensors_and_keeps_what_load_state_dict_reads():
    """A module's state_dict is an OrderedDict whose _metadata load_state_dict reads: copied as
    such, tensor by tensor (a deep copy of it would clone GPU tensors on the GPU, not to host)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    state = model.state_dict()
    staged = checkpoint.Snapshot().take({"model": state, "step": 3})
    copied = staged["model"]
    assert type(copied) is type(state) and copied._metadata == state._metadata
    assert list(copied) == list(state) and staged["step"] == 3
    for key, tensor in state.items():
        assert torch.equal(copied[key], tensor)
        assert copied[key].untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
    torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).load_state_dict(copied)


def test_a_state_counts_each_storage_once():
    """Tied weights and views are one copy in the snapshot, as in the file."""
    model = torch.nn.Linear(10, 10)  # 100 + 10 floats
    state = {"model": model.state_dict(), "tied": [model.weight, model.weight[0]], "step": 3}
    assert checkpoint.state_bytes(state) == 110 * 4


def test_a_snapshot_fits_in_most_of_the_memory_still_available():
    gib = 2**30
    assert checkpoint.snapshot_room(gib, (2 * gib, "this machine has")) is None
    assert checkpoint.snapshot_room(gib, None) is None  # nothing to tell: as configured
    assert checkpoint.snapshot_room(2 * gib, (2 * gib, "its cgroup (container) has")) == (
        "checkpoints are written synchronously: their background copy of the state needs 2.00 "
        "GiB of host memory on rank 0, and its cgroup (container) has 2.00 GiB available; give "
        "the pod more memory (deploy.memory_per_gpu) to write them in the background, or set "
        "trainer.async_checkpoint=false to choose this"
    )


@pytest.mark.parametrize(
    ("files", "held"),
    [  # a v2 group and a v1 group, each 1 GiB held of which 256 MiB inactive file pages
        (
            {
                "memory.max": "2147483648",
                "memory.current": "1073741824",
                "memory.stat": "anon 1\ninactive_file 268435456\n",
            },
            2**30 - 2**28,
        ),
        (
            {
                "memory.limit_in_bytes": "2147483648",
                "memory.usage_in_bytes": "1073741824",
                "memory.stat": "total_inactive_file 268435456\n",
            },
            2**30 - 2**28,
        ),
    ],
)
def test_a_containers_available_memory_is_its_limit_less_what_it_holds(tmp_path, files, held):
    from ddp_project.run import oom

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert oom.available_memory([tmp_path]) == (2**31 - held, "its cgroup (container) has")
    (tmp_path / "memory.max").write_text("max\n")  # v2 without a limit: the machine's figure
    (tmp_path / "memory.limit_in_bytes").write_text(str(2**63))
    assert oom.available_memory([tmp_path])[1] == "this machine has"


def test_a_snapshot_the_host_cannot_hold_makes_the_checkpoints_synchronous(
    tmp_path, monkeypatch, caplog
):
    """Said once, in a line with the figures; the next save is written before it returns."""
    saver = checkpointer(tmp_path, torch.nn.Linear(64, 64), asynchronous=True)
    monkeypatch.setattr(checkpoint.oom, "available_memory", lambda: (1000, "this machine has"))
    with caplog.at_level(logging.WARNING):
        saver.prepare()
    assert not saver.asynchronous
    (line,) = [r.getMessage() for r in caplog.records if "synchronously" in r.getMessage()]
    assert "needs 0.00 GiB of host memory on rank 0, and this machine has 0.00 GiB" in line
    assert saver.writer.thread is None
    saver.save(10)
    assert saver.writer.thread is None and names(tmp_path) == ["step_000000010.pt"]
    roomy = checkpointer(tmp_path / "roomy", torch.nn.Linear(64, 64), asynchronous=True)
    monkeypatch.setattr(checkpoint.oom, "available_memory", lambda: (2**40, "this machine has"))
    roomy.prepare()
    assert roomy.asynchronous


def test_an_odd_proc_self_cgroup_line_is_skipped(monkeypatch, tmp_path):
    """The check runs inside training: a line it cannot parse must not end the run."""
    from ddp_project.run import oom

    real = oom.Path

    def fake(path, *rest):
        return real(tmp_path / "cgroup") if str(path) == "/proc/self/cgroup" else real(path, *rest)

    (tmp_path / "cgroup").write_text("garbage\n0::/\n")
    monkeypatch.setattr(oom, "Path", fake)
    assert oom.cgroup_dirs() == [d for d in [real("/sys/fs/cgroup")] * 2 if d.is_dir()]

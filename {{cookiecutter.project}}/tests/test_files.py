"""core/files.py: a file written whole or not at all, and no temp file left behind on any failure,
Ctrl-C and a full disk included; every writer of the project goes through it."""

import errno
import os
import re
import socket

import pytest

from ddp_project import evaluate
from ddp_project.core import files
from ddp_project.core.world import World
from ddp_project.k8s import sync
from ddp_project.nccl import probe
from ddp_project.nccl.decision import NodeFacts
from ddp_project.record import metrics
from ddp_project.run import checkpoint


def test_bytes_text_or_a_writer_replace_the_file_whole(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    files.write_atomically(path, b"bytes")
    assert path.read_bytes() == b"bytes"
    files.write_atomically(path, "text é")
    assert path.read_text(encoding="utf-8") == "text é"
    files.write_atomically(path, lambda out: out.write(b"from a writer"))
    assert path.read_bytes() == b"from a writer"
    assert os.listdir(tmp_path) == ["out.json"]


def test_the_temp_file_is_beside_the_target_and_named_partial(tmp_path):
    seen = []
    path = tmp_path / "metrics.csv"
    for _ in range(2):
        files.write_atomically(
            path, lambda out: seen.extend(set(os.listdir(tmp_path)) - {path.name})
        )
    assert all(re.fullmatch(r"\.partial-[0-9a-f]{8}-metrics\.csv", name) for name in seen)
    assert len(seen) == 2 and seen[0] != seen[1]  # a fresh name each write: two writers never share


def test_a_new_file_gets_the_mode_open_gives_it(tmp_path):
    files.write_atomically(tmp_path / "a", "x")
    (tmp_path / "b").write_text("x")
    assert (tmp_path / "a").stat().st_mode == (tmp_path / "b").stat().st_mode
    files.write_atomically(tmp_path / "c", "x", mode=0o600)
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o600


def failing(error):
    def writer(out):
        out.write(b"half of it")
        raise error

    return writer


@pytest.mark.parametrize(
    "error",
    [
        ValueError("the writer failed"),
        KeyboardInterrupt(),
        OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    ],
    ids=["exception", "ctrl-c", "disk-full"],
)
def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, error):
    path = tmp_path / "step_000000010.pt"
    path.write_bytes(b"the good one")
    with pytest.raises(type(error)) as raised:
        files.write_atomically(path, failing(error), durable=True)
    assert raised.value is error  # raised as it was, errno and all
    assert os.listdir(tmp_path) == [path.name]
    assert path.read_bytes() == b"the good one"


def test_a_failed_rename_leaves_no_temp_file(tmp_path):
    (tmp_path / "out.json").mkdir()  # a folder in the way: the rename fails, the write did not
    with pytest.raises(OSError):
        files.write_atomically(tmp_path / "out.json", "{}")
    assert os.listdir(tmp_path) == ["out.json"]


def test_durable_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    path, synced = tmp_path / "step_000000010.pt", []
    fsync = os.fsync

    def recorded(fd):
        synced.append((os.path.isdir(f"/proc/self/fd/{fd}"), path.exists()))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    files.write_atomically(path, b"x")
    assert synced == []  # not durable: no fsync, as metrics.csv and the others never had
    files.write_atomically(path.with_name("new.pt"), b"x", durable=True)
    assert synced == [(False, True), (True, True)]  # the file, then its folder
    path.unlink()
    synced.clear()
    checkpoint.write_atomically({"step": 1}, path)
    assert synced == [(False, False), (True, True)]  # a checkpoint is durable, as it always was


def test_stage_removes_its_temp_file_on_a_failure(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        files.stage(tmp_path / "train.yaml", failing(KeyboardInterrupt()))
    assert os.listdir(tmp_path) == []
    staged = files.stage(tmp_path / "train.yaml", "a: 1\n")
    assert staged.read_text() == "a: 1\n" and staged.name.startswith(files.PARTIAL)


def probe_path(run_dir):
    return run_dir / "nccl" / f"probe-{socket.gethostname()}-{World.from_env().attempt}.json"


FACTS = NodeFacts(
    gpu_count=1, nvlink_pairs=frozenset(), ib_active_ports=0, world_size=1, local_world_size=1
)

# Each writer of the project: (where its file goes in a run dir, the write). metrics.csv's writer
# (".metrics.csv.part") and the node probe's (".tmp<pid>") left their temp file behind on a failure.
WRITERS = {
    "metrics": (lambda run: run / "metrics.csv", lambda run, out: metrics.replace(out, "step\n")),
    "probe": (
        probe_path,
        lambda run, out: probe.shared_node_facts(run, World(), probe=lambda: FACTS),
    ),
    "evaluate": (lambda run: run / "eval" / "step_1.json", lambda run, out: evaluate.save({}, out)),
    "checkpoint": (
        lambda run: run / "checkpoints" / "step_1.pt",
        lambda run, out: checkpoint.write_atomically({}, out),
    ),
    # data: a folder, replaced whole by a rename (test_data_refusals.py's cut-short prepares)
    "k8s": (lambda run: run / "k8s" / "train.yaml", lambda run, out: sync.replace_all({out: "a"})),
}


@pytest.mark.parametrize("writer", WRITERS)
def test_no_writer_leaves_a_temp_file_when_its_rename_fails(tmp_path, writer):
    (tmp_path / "text.txt").write_text("hello")
    target_of, write = WRITERS[writer]
    target = target_of(tmp_path)
    target.mkdir(parents=True)  # a folder where the file goes: the write succeeds, the rename fails
    before = sorted(os.listdir(target.parent))
    with pytest.raises(OSError):
        write(tmp_path, target)
    assert sorted(os.listdir(target.parent)) == before


def test_metrics_leaves_no_part_file_when_its_write_fails(tmp_path):
    """The former leftover: metrics.csv's text that cannot be written left `.metrics.csv.part`."""
    path = tmp_path / "metrics.csv"
    path.write_text("step\n1\n")
    with pytest.raises(UnicodeEncodeError):
        metrics.replace(path, "step\n\ud800\n")  # a lone surrogate: no encoding writes it
    assert os.listdir(tmp_path) == ["metrics.csv"] and path.read_text() == "step\n1\n"

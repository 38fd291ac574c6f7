"""Token files and the held-out split: a bad file is one line before any process starts."""

import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from conftest import PACKAGE

from ddp_project.config import token_files, validate
from ddp_project.config.compose import compose_and_check, config_problem
from ddp_project.config.error import ConfigError
from ddp_project.config.global_batch import (
    GlobalBatch,
    GlobalBatchChanged,
    accepted,
    on_resume,
)
from ddp_project.config.validate import check_data
from ddp_project.core.world import World
from ddp_project.data import prepare
from ddp_project.run.batches import StepBatches

GPT = ["model=gpt", "data=tokens", "data.seq_len=4", "data.batch_size=1"]


@pytest.fixture(autouse=True)
def no_earlier_scan(monkeypatch):
    monkeypatch.delenv(token_files.SCANNED_VAR, raising=False)


def tokens(path, ids):
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return path


def problem(path, *overrides):
    return config_problem([*GPT, f"data.path={path}", *overrides])


def test_a_good_token_file_passes(tmp_path):
    assert problem(tokens(tmp_path / "t.bin", np.arange(100) % 256)) is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "holds 0 sequence(s) of data.seq_len=4 tokens (0 tokens); need at least 2"),
        (b"\x01\x00" * 8, "holds 1 sequence(s) of data.seq_len=4 tokens (8 tokens); need at"),
        (b"\x01" * 41, "holds 41 bytes, an odd count: not a file of 2-byte (uint16) tokens;"),
    ],
    ids=["empty", "one sequence", "odd"],
)
def test_a_token_file_of_the_wrong_size_is_one_line(tmp_path, content, message):
    (tmp_path / "t.bin").write_bytes(content)
    assert problem(tmp_path / "t.bin").startswith(f"data.path={tmp_path / 't.bin'}: {message}")


def test_an_id_outside_the_vocabulary_is_named_with_where_it_is(tmp_path):
    path = tokens(tmp_path / "t.bin", [*range(50), 300, 7])
    assert problem(path, "data.vocab_size=256") == (
        f"data.path={path}: holds token id 300 (token 50 of the file), not below "
        "data.vocab_size=256; raise data.vocab_size to 301, or check that the file holds uint16 "
        f"tokens (make one with python -m {PACKAGE}.data TEXT OUT)"
    )
    assert problem(path, "data.vocab_size=300").startswith(f"data.path={path}: holds token id 300")
    assert problem(path, "data.vocab_size=301") is None


def test_a_text_file_given_as_tokens_is_refused(tmp_path):
    (tmp_path / "t.txt").write_text("hello world, this is text and no token file\n" * 4)
    assert "holds token id" in problem(tmp_path / "t.txt")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p.mkdir(), "a directory, not a token file;"),
        (lambda p: None, "no such file here"),
        (lambda p: os.mkfifo(p), "not a regular file;"),
    ],
    ids=["directory", "missing", "fifo"],
)
def test_a_path_that_is_no_file_is_one_line(tmp_path, make, message):
    make(tmp_path / "t.bin")
    assert problem(tmp_path / "t.bin").startswith(f"data.path={tmp_path / 't.bin'}: {message}")


def test_an_unreadable_token_file_is_one_line(tmp_path, monkeypatch):
    path = tokens(tmp_path / "t.bin", range(100))
    real_open = type(path).open

    def refuse(self, *args, **kwargs):  # chmod 000 does not stop root
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "open", refuse)
    assert problem(path) == f"data.path={path}: cannot be read (Permission denied)"


def test_an_empty_path_is_one_line():
    assert problem("''").startswith("data.path=: an empty path; give a token file, or null")


def test_a_huge_token_file_is_scanned_a_chunk_at_a_time(tmp_path, monkeypatch):
    """The largest id is found wherever it is, in memory that does not grow with the file."""
    monkeypatch.setattr(token_files, "CHUNK_TOKENS", 1000)
    path = tmp_path / "huge.bin"
    with path.open("wb") as file:
        file.truncate(2 * 10**7)  # 20 MB of zeros, sparse on disk
        file.seek(2 * (10**7 - 3))
        file.write(np.uint16(999).tobytes())
    tracemalloc.start()
    try:
        assert token_files.largest_token(path) == (999, 10**7 - 3)
        assert tracemalloc.get_traced_memory()[1] < 2**20
    finally:
        tracemalloc.stop()


def test_a_scan_is_reused_by_the_processes_started_after_it_until_the_file_changes(
    tmp_path, monkeypatch
):
    reads, memmap = [], np.memmap
    monkeypatch.setattr(
        np, "memmap", lambda *args, **kwargs: reads.append(1) or memmap(*args, **kwargs)
    )
    path = tokens(tmp_path / "t.bin", [3, 1, 4, 1, 5, 9, 2, 6])
    assert token_files.largest_token(path) == (9, 5) and len(reads) == 1
    assert (
        token_files.SCANNED_VAR in os.environ
    )  # what torchrun's workers inherit from the launcher
    assert token_files.largest_token(path) == (9, 5) and len(reads) == 1
    before = path.stat().st_mtime_ns
    tokens(path, [3, 1, 4, 1, 5, 9, 2, 60])  # the same size and inode: its time tells
    os.utime(path, ns=(before + 10**9, before + 10**9))
    assert token_files.largest_token(path) == (60, 7) and len(reads) == 2
    monkeypatch.setenv(token_files.SCANNED_VAR, "{not json")
    assert token_files.largest_token(path) == (60, 7) and len(reads) == 3


def test_check_refuses_a_bad_token_file_in_one_line_with_exit_2(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.check", *GPT, "data.path=odd.bin"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr == (
        "config error: data.path=odd.bin: holds 3 bytes, an odd count: not a file of 2-byte "
        f"(uint16) tokens; make one with python -m {PACKAGE}.data TEXT OUT\n"
    )


def test_evaluation_checks_the_held_out_samples_not_a_training_batch(monkeypatch):
    cfg = compose_and_check(["data.num_samples=1000"])
    cfg.data.batch_size = 100000  # more than training has: fine for evaluation's short last batch
    with pytest.raises(
        ConfigError, match="data.batch_size=100000: each optimizer step takes 1 process"
    ):
        check_data(cfg, World(rank=0, local_rank=0, size=1, local_size=1))
    check_data(cfg, World(rank=0, local_rank=0, size=1, local_size=1), held_out=True)
    with pytest.raises(ConfigError) as refused:
        check_data(cfg, World(rank=0, local_rank=0, size=101, local_size=101), held_out=True)
    assert str(refused.value) == (
        "data.num_samples=1000: 100 held-out sample(s) (one in 10) for 101 process(es), which "
        "need one each; evaluate on at most 100 process(es), or with more data"
    )
    cfg.data.num_samples = 9
    with pytest.raises(ConfigError, match=r"=9: 0 held-out sample\(s\) .* evaluate with more data"):
        check_data(cfg, World(rank=0, local_rank=0, size=1, local_size=1), held_out=True)


def test_from_saved_passes_held_out_to_the_data_check():
    from omegaconf import OmegaConf

    saved = OmegaConf.to_container(
        OmegaConf.structured(compose_and_check(["data.num_samples=1000"])), enum_to_str=True
    )
    with pytest.raises(ConfigError, match="training samples"):
        validate.from_saved(saved, ["data.batch_size=100000"], World())
    assert validate.from_saved(saved, ["data.batch_size=100000"], World(), held_out=True)


def test_prepare_writes_a_token_file_a_chunk_at_a_time(tmp_path, monkeypatch):
    from ddp_project import data

    monkeypatch.setattr(data, "CHUNK_BYTES", 4096)
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    tracemalloc.start()
    try:
        assert prepare(text, tmp_path / "t.bin") == 2**20
        assert tracemalloc.get_traced_memory()[1] < 2**18  # not the whole text, nor its tokens
    finally:
        tracemalloc.stop()
    assert np.fromfile(tmp_path / "t.bin", dtype=np.uint16).tolist() == list(range(256)) * 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.bin", "t.txt"]


def test_an_interrupted_prepare_leaves_no_token_file(tmp_path, monkeypatch):
    text = tmp_path / "t.txt"
    text.write_text("some text")

    def interrupted(source, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)  # the last moment before it is done
    with pytest.raises(KeyboardInterrupt):
        prepare(text, tmp_path / "t.bin")
    assert [p.name for p in tmp_path.iterdir()] == ["t.txt"]


@pytest.mark.parametrize(
    ("text", "out", "message"),
    [
        ("missing.txt", "t.bin", "error: missing.txt: no such file"),
        ("empty.txt", "t.bin", "error: empty.txt: empty, no tokens to write"),
        ("folder", "t.bin", "error: folder: not a file"),
        ("t.txt", "folder", "error: folder: a directory; name the token file to write"),
        ("t.txt", "nowhere/t.bin", "error: nowhere/t.bin: no folder nowhere to write it in"),
        ("t.txt", "t.txt", "error: t.txt: the text file itself; write the tokens to another file"),
    ],
)
def test_the_data_command_refuses_bad_arguments_in_one_line(
    tmp_path, monkeypatch, capsys, text, out, message
):
    from ddp_project import data

    (tmp_path / "t.txt").write_text("text")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["data", text, out])
    assert data.main() == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(message) and (tmp_path / "t.txt").read_text() == "text"


def step_samples(size, batch, accumulation, processes, epoch=0, start=0):
    """Each optimizer step's samples over every rank, as StepBatches hands them out."""
    ranks = []
    for rank in range(processes):
        batches = StepBatches(size, batch, accumulation, World(rank=rank, size=processes), seed=3)
        batches.set_position(epoch, start)
        ranks.append(list(batches))
        assert len(batches) == len(ranks[-1])
    steps = len(ranks[0]) // accumulation
    return [
        sorted(
            i for rank in ranks for b in rank[s * accumulation : (s + 1) * accumulation] for i in b
        )
        for s in range(steps)
    ]


def test_a_steps_samples_do_not_depend_on_the_world_size():
    """The global batch (processes × batch × accumulation) alone decides them: 4 × 8 × 1,
    2 × 8 × 2 and 1 × 8 × 4 take the same 32 samples at each step, none twice in an epoch."""
    four = step_samples(100, 8, 1, 4)
    assert len(four) == 3  # 100 samples: 3 steps of 32, the tail of 4 left out
    assert four == step_samples(100, 8, 2, 2) == step_samples(100, 8, 4, 1)
    assert len({i for step in four for i in step}) == 96
    assert four != step_samples(100, 8, 1, 4, epoch=1)  # another epoch, another order


def test_a_position_in_samples_resumes_on_any_world_size():
    """From sample 64 of epoch 2, 1 process takes the steps 4 processes would have taken next."""
    whole = step_samples(200, 8, 1, 4, epoch=2)
    assert step_samples(200, 8, 4, 1, epoch=2, start=64) == whole[2:]
    assert step_samples(200, 8, 1, 4, epoch=2, start=192) == []  # the epoch is over


def test_a_rank_takes_every_world_th_sample_of_each_micro_step():
    """As DistributedSampler over BatchSampler did, so an unchanged run sees what it saw."""
    batches = StepBatches(40, 2, 1, World(rank=1, size=3), seed=0)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(0)).tolist()
    assert list(batches)[:2] == [[order[1], order[4]], [order[7], order[10]]]


SAVED = GlobalBatch(processes=2, batch_size=128, accumulation=1)
AS_SAVED = {"data": {"batch_size": 128}, "trainer": {"grad_accumulation": 1}}


@pytest.mark.parametrize(
    ("now", "kept"),
    [
        (GlobalBatch(2, 128, 1), GlobalBatch(2, 128, 1)),  # as it was
        (GlobalBatch(1, 128, 1), GlobalBatch(1, 128, 2)),  # fewer processes: accumulate more
        (GlobalBatch(1, 64, 4), GlobalBatch(1, 64, 4)),  # the config's own figures make it
    ],
)
def test_a_resume_keeps_the_checkpoints_global_batch(now, kept):
    assert on_resume(SAVED, AS_SAVED, now) == kept


def test_a_world_size_that_cannot_keep_the_global_batch_is_one_line_naming_the_figures():
    with pytest.raises(GlobalBatchChanged) as raised:
        on_resume(SAVED, AS_SAVED, GlobalBatch(3, 128, 1))
    assert str(raised.value) == (
        "the checkpoint's global batch is 256 samples (2 process(es) × data.batch_size 128 × "
        "trainer.grad_accumulation 1); 3 process(es) cannot make 256 from data.batch_size 128: "
        "resume on 1, 2 process(es) to keep it, or add trainer.accept_changes=[data.batch_size] "
        "to train on with another global batch"
    )
    with pytest.raises(
        GlobalBatchChanged, match="data.batch_size=64 trainer.grad_accumulation=1 keeps it"
    ):
        on_resume(SAVED, AS_SAVED, GlobalBatch(4, 128, 1))


def test_a_global_batch_changed_on_purpose_is_trained_as_given():
    """Accepted, or the config's figures changed (the resume check lists those)."""
    assert on_resume(SAVED, AS_SAVED, GlobalBatch(3, 128, 1), accept=True) == GlobalBatch(3, 128, 1)
    changed = {"data": {"batch_size": 128}, "trainer": {"grad_accumulation": 2}}
    assert on_resume(SAVED, changed, GlobalBatch(2, 128, 1)) == GlobalBatch(2, 128, 1)
    assert (
        accepted(["data"]) and accepted(["trainer.grad_accumulation"]) and not accepted(["model"])
    )


def test_a_checkpoint_from_before_global_batch_was_recorded_gives_its_figures():
    state = {
        "world_size": 4,
        "config": {"data": {"batch_size": 16}, "trainer": {"grad_accumulation": 2}},
    }
    assert GlobalBatch.saved(state) == GlobalBatch(4, 16, 2)

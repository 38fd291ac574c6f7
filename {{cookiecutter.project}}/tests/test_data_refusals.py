"""What the data command and a data folder refuse: each in one line, exit 2, nothing written and
no process started; Ctrl-C or a full disk during prepare leaves nothing; a resume whose data
folder's tokenizer is not the run's."""

import errno
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import PACKAGE, launch_command
from test_data import CORPUS, GPT, problem
from test_evaluate import composed, train_here

from ddp_project import prepare as prepare_command
from ddp_project.config import token_files
from ddp_project.core.world import World
from ddp_project.prepare import prepare
from ddp_project.run import rundir

MAKE = f"make one with python -m {PACKAGE}.prepare CORPUS OUT"
AGAIN = f"prepare it again with python -m {PACKAGE}.prepare"


@pytest.fixture(autouse=True)
def no_earlier_scan(monkeypatch):
    monkeypatch.delenv(token_files.SCANNED_VAR, raising=False)


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "corpus.txt").write_text(CORPUS)
    prepare([tmp_path / "corpus.txt"], tmp_path / "data", vocab_size=300)
    return tmp_path / "data"


def refuse_open(monkeypatch, path):
    """Opening `path` fails as for a file without read permission (chmod 000 does not stop
    root)."""
    real_open = Path.open

    def refuse(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refuse)


def corpus_folder(tmp_path, *files):
    (tmp_path / "folder").mkdir()
    for name, content in files:
        (tmp_path / "folder" / name).write_bytes(content)


SETUPS = {
    "empty": (lambda t: (t / "e.txt").write_text(""), ["e.txt", "out"], "e.txt: no text"),
    "binary": (
        lambda t: (t / "b.dat").write_bytes(b"\x7fELF\x00\x01 text"),
        ["b.dat", "out"],
        "b.dat: holds NUL bytes, so binary, not text; leave it out",
    ),
    "not utf-8": (
        lambda t: (t / "l.txt").write_bytes("café\n".encode("latin-1")),
        ["l.txt", "out"],
        "l.txt: not UTF-8 text (binary, or another encoding)",
    ),
    "binary in a folder": (
        lambda t: corpus_folder(t, ("a.txt", b"text\n"), ("z.png", b"\x89PNG\r\n\x1a\n\x00")),
        ["folder", "out"],
        "folder/z.png: not UTF-8 text (binary, or another encoding); leave it out",
    ),
    "folder with no files": (
        lambda t: corpus_folder(t, (".hidden", b"text\n")),
        ["folder", "out"],
        "folder: a folder with no files in it",
    ),
    "missing": (lambda t: None, ["m.txt", "out"], "m.txt: no such file or folder"),
    "fifo": (lambda t: os.mkfifo(t / "f"), ["f", "out"], "f: not a regular file"),
    "vocab below the bytes": (
        lambda t: (t / "t.txt").write_text(CORPUS),
        ["t.txt", "out", "--vocab-size", "256"],
        "--vocab-size 256: below 257, the 256 bytes a byte-level BPE starts from and <|endoftext|>",
    ),
    "vocab past uint32": (
        lambda t: (t / "t.txt").write_text(CORPUS),
        ["t.txt", "out", "--vocab-size", str(2**32 + 1)],
        f"--vocab-size {2**32 + 1}: above {2**32}, the most ids uint32 shards hold",
    ),
    "vocab past the text": (
        lambda t: (t / "t.txt").write_text("a short text\n"),
        ["t.txt", "out", "--vocab-size", "50304"],
        "--vocab-size 50304: t.txt holds 13 bytes, which support at most 270 tokens; ask for",
    ),
    "out inside the corpus": (
        lambda t: corpus_folder(t, ("a.txt", b"text\n")),
        ["folder", "folder/data"],
        "folder/data: inside the corpus folder folder, whose every file is read as text",
    ),
    "out exists": (
        lambda t: corpus_folder(t, ("a.txt", b"text\n")),
        ["folder/a.txt", "folder"],
        "folder: exists; remove it, or name a new folder",
    ),
    "out has no parent": (
        lambda t: (t / "t.txt").write_text(CORPUS),
        ["t.txt", "nowhere/out"],
        "nowhere/out: no folder nowhere to write it in",
    ),
}


@pytest.mark.parametrize("case", SETUPS)
def test_the_data_command_refuses_in_one_line_and_writes_nothing(
    tmp_path, monkeypatch, capsys, case
):
    make, argv, message = SETUPS[case]
    make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    assert prepare_command.main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {message}"), line
    assert sorted(tmp_path.rglob("*")) == before


def test_an_unreadable_text_file_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "t.txt").write_text(CORPUS)
    refuse_open(monkeypatch, Path("t.txt"))
    monkeypatch.chdir(tmp_path)
    assert prepare_command.main(["t.txt", "out"]) == 2
    assert capsys.readouterr().err == "error: t.txt: cannot be read (Permission denied)\n"
    assert os.listdir(tmp_path) == ["t.txt"]


@pytest.mark.parametrize(
    ("stop", "code", "line"),
    [
        (KeyboardInterrupt(), 130, "interrupted; out not written"),
        (
            OSError(errno.ENOSPC, "No space left on device", "out/train-0000.bin"),
            1,
            "error: out/train-0000.bin: No space left on device; out not written",
        ),
        (  # the folder filled by another writer between the check and the rename
            OSError(errno.ENOTEMPTY, "Directory not empty", "out"),
            1,
            "error: out: Directory not empty; out not written",
        ),
    ],
    ids=["ctrl-c", "disk full", "rename"],
)
def test_a_prepare_cut_short_leaves_nothing(tmp_path, monkeypatch, capsys, stop, code, line):
    (tmp_path / "t.txt").write_text(CORPUS)
    monkeypatch.setattr(prepare_command, "CHUNK_CHARS", 1000)  # many pieces: stopped part-way
    added = []

    def add(self, ids):
        added.append(ids)
        if len(added) == 3 and getattr(stop, "errno", None) != errno.ENOTEMPTY:
            raise stop

    def replace(source, target):
        raise stop

    monkeypatch.setattr(prepare_command.ShardWriter, "add", add)
    if getattr(stop, "errno", None) == errno.ENOTEMPTY:
        monkeypatch.setattr(prepare_command.os, "replace", replace)
    monkeypatch.chdir(tmp_path)
    assert prepare_command.main(["t.txt", "out"]) == code
    assert capsys.readouterr().err.splitlines() == [line]
    assert os.listdir(tmp_path) == ["t.txt"]


def break_meta(folder, **changes):
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, **changes}))


FOLDERS = {
    "a file": (lambda f: (f.parent / "t.bin").write_bytes(b"\x01\x00"), "t.bin", "a file, not a"),
    "missing": (lambda f: None, "nothing", "no such folder here"),
    "no meta": (lambda f: (f / "meta.json").unlink(), "data", "no meta.json, so no data folder"),
    "meta not json": (lambda f: (f / "meta.json").write_text("{"), "data", "meta.json is not JSON"),
    "meta of another layout": (
        lambda f: break_meta(f, format=2),
        "data",
        f"meta.json is not one this version writes; {AGAIN}",
    ),
    "no tokenizer": (lambda f: (f / "tokenizer.json").unlink(), "data", "no tokenizer.json; "),
    "another tokenizer": (
        lambda f: (f / "tokenizer.json").write_text("{}"),
        "data",
        "tokenizer.json is not the one meta.json records (sha256)",
    ),
    "shard missing": (
        lambda f: (f / "val-0000.bin").unlink(),
        "data",
        "val-0000.bin, which meta.json lists, is missing",
    ),
    "shard truncated": (
        lambda f: os.truncate(f / "train-0000.bin", 1001),
        "data",
        "train-0000.bin holds 1001 bytes, not the ",
    ),
    "shard corrupt": (
        lambda f: np.memmap(f / "train-0000.bin", dtype=np.uint16, mode="r+").__setitem__(5, 999),
        "data",
        f"train-0000.bin holds token id 999 (token 5), not below the tokenizer's 300: the shard "
        f"is corrupt; {AGAIN}",
    ),
}


@pytest.mark.parametrize("case", FOLDERS)
def test_a_data_folder_that_will_not_do_is_one_line(folder, case):
    change, name, message = FOLDERS[case]
    change(folder)
    path = folder.parent / name
    assert problem(path).startswith(f"data.path={path}: {message}"), problem(path)


def test_an_empty_path_is_one_line():
    assert problem("''").startswith(f"data.path=: an empty path; give a data folder ({MAKE})")


def test_an_unreadable_shard_is_one_line(folder, monkeypatch):
    refuse_open(monkeypatch, folder / "train-0000.bin")
    assert (
        problem(folder) == f"data.path={folder}: train-0000.bin cannot be read (Permission denied)"
    )


def test_the_vocabulary_must_cover_the_tokenizer(folder):
    assert problem(folder, "data.vocab_size=300") is None
    assert problem(folder, "data.vocab_size=50304") is None  # padded, as GPT-2's
    assert problem(folder, "data.vocab_size=299") == (
        f"data.vocab_size=299: is below the 300 ids of data.path={folder}'s tokenizer.json; use "
        "at least 300, or null for the tokenizer's"
    )
    assert problem("null", "data.vocab_size=null").startswith(
        "data.vocab_size=null: means the tokenizer's, and synthetic tokens have none"
    )


def test_a_context_longer_than_a_split_is_one_line(folder):
    assert problem(folder, "data.seq_len=1000000") == (
        f"data.path={folder}: its train shards hold "
        f"{json.loads((folder / 'meta.json').read_text())['tokens']['train']} tokens, not one "
        "sequence of data.seq_len=1000000 + 1; lower data.seq_len, or prepare it from more text"
    )


def test_a_truncated_shard_stops_the_launch_before_any_process(folder):
    """`<project> train`: exit 2 and one line, before torchrun starts: no run dir."""
    os.truncate(folder / "train-0000.bin", 1001)
    done = subprocess.run(
        launch_command("--nproc-per-node", "2", *GPT, "data.path=data", "hydra.run.dir=run"),
        cwd=folder.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith("config error: data.path=data: train-0000.bin holds 1001 bytes")
    assert len(done.stderr.splitlines()) == 1 and not (folder.parent / "run").exists()


def test_a_huge_shard_is_scanned_a_chunk_at_a_time(folder, monkeypatch):
    """The largest id is found wherever it is, in memory that does not grow with the shard."""
    monkeypatch.setattr(token_files, "CHUNK_TOKENS", 1000)
    with (folder / "train-0000.bin").open("r+b") as file:
        file.truncate(0)
        file.truncate(2 * 10**7)  # 20 MB of zeros, sparse on disk
        file.seek(2 * (10**7 - 3))
        file.write(np.uint16(299).tobytes())
    meta = token_files.read_meta(folder)
    meta["shards"]["train"][0]["tokens"] = 10**7
    tracemalloc.start()
    try:
        assert token_files.largest_token(folder, meta) == (299, "train-0000.bin", 10**7 - 3)
        assert tracemalloc.get_traced_memory()[1] < 2**20
    finally:
        tracemalloc.stop()


def test_a_scan_is_reused_by_the_processes_started_after_it_until_a_shard_changes(
    folder, monkeypatch
):
    reads, memmap = [], np.memmap
    monkeypatch.setattr(
        np, "memmap", lambda *args, **kwargs: reads.append(1) or memmap(*args, **kwargs)
    )
    meta = token_files.read_meta(folder)
    top = token_files.largest_token(folder, meta)
    assert len(reads) == 2  # train and val
    assert token_files.SCANNED_VAR in os.environ  # what torchrun's workers inherit
    assert token_files.largest_token(folder, meta) == top and len(reads) == 2
    shard = folder / "val-0000.bin"
    before = shard.stat().st_mtime_ns
    os.utime(shard, ns=(before + 10**9, before + 10**9))  # the same size and inode: its time
    assert token_files.largest_token(folder, meta) == top and len(reads) == 4
    monkeypatch.setenv(token_files.SCANNED_VAR, "{not json")
    assert token_files.largest_token(folder, meta) == top and len(reads) == 6


def test_a_resume_on_a_data_folder_with_another_tokenizer_is_refused_naming_the_key(
    tmp_path, folder
):
    """The run keeps the tokenizer; the folder prepared again under the same data.path with
    another vocabulary changes no key, yet its ids mean other text: refused, in one line, unless
    trainer.accept_changes names data.path."""
    overrides = (
        *GPT, f"data.path={folder}", "data.vocab_size=300", "model.d_model=16", "model.n_layer=1",
        "model.n_head=2", "trainer.max_steps=2", "trainer.val_every=0",
    )  # fmt: skip
    cfg = composed(*overrides)
    run = tmp_path / "run"
    train_here(cfg, run)
    rundir.keep_tokenizer(run, cfg)
    assert (run / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert rundir.resume_problem(run, composed(*overrides), World()) is None
    shutil.rmtree(folder)
    prepare([tmp_path / "corpus.txt"], folder, vocab_size=290)
    refused = rundir.resume_problem(run, composed(*overrides), World())
    assert refused.startswith(f"hydra.run.dir={run} resumes from step_000000002.pt: data.path=")
    assert (
        "its tokenizer.json (sha256 " in refused
        and "add trainer.accept_changes=[data.path]" in refused
    )
    accepted = composed(*overrides, "trainer.accept_changes=[data.path]")
    assert rundir.resume_problem(run, accepted, World()) is None
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.train", *overrides, "hydra.run.dir=run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = done.stderr.splitlines()
    assert "is not the one the run trained with" in line and "accept_changes=[data.path]" in line

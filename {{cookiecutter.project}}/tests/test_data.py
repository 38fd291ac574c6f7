"""Data folders made from text (python -m <package>.prepare), read as shards, and the held-out
split; the batches each step takes, on any world size. Refusals: test_data_refusals.py."""

import hashlib
import json
import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ddp_project import prepare as prepare_command
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
from ddp_project.data import TokenShards
from ddp_project.prepare import END_OF_TEXT, SPLITS, prepare
from ddp_project.run.batches import StepBatches, build_loader

GPT = ["model=gpt", "data=tokens", "data.seq_len=4", "data.batch_size=1", "data.vocab_size=null"]
CORPUS = "".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog, {i % 7} times.\n" for i in range(400)
)


@pytest.fixture(autouse=True)
def no_earlier_scan(monkeypatch):
    monkeypatch.delenv(token_files.SCANNED_VAR, raising=False)


@pytest.fixture
def folder(tmp_path):
    """A data folder made from CORPUS: a tokenizer of 300 ids, train and val shards."""
    (tmp_path / "corpus.txt").write_text(CORPUS)
    prepare([tmp_path / "corpus.txt"], tmp_path / "data", vocab_size=300)
    return tmp_path / "data"


def problem(path, *overrides):
    return config_problem([*GPT, f"data.path={path}", *overrides])


def test_prepare_writes_a_tokenizer_and_shards_that_give_back_the_text(folder):
    """A byte-level BPE loses nothing: the train shards then the val shards decode to the text,
    the end-of-text token after it; the val split is its last tenth."""
    from tokenizers import Tokenizer

    meta = json.loads((folder / "meta.json").read_text())
    assert sorted(p.name for p in folder.iterdir()) == [
        "meta.json", "tokenizer.json", "train-0000.bin", "val-0000.bin"
    ]  # fmt: skip
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 300
    assert (
        meta["tokenizer_sha256"]
        == hashlib.sha256((folder / "tokenizer.json").read_bytes()).hexdigest()
    )
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {s: np.fromfile(folder / f"{s}-0000.bin", dtype=np.uint16).tolist() for s in SPLITS}
    assert {s: len(ids[s]) for s in SPLITS} == meta["tokens"]
    assert ids["val"][-1] == meta["end_of_text_id"] == tokenizer.token_to_id(END_OF_TEXT)
    assert tokenizer.decode(ids["train"]) + tokenizer.decode(ids["val"][:-1]) == CORPUS
    val_text = tokenizer.decode(ids["val"][:-1])
    assert CORPUS.endswith(val_text) and len(val_text) == len(CORPUS) // 10
    assert problem(folder) is None


def test_the_data_command_writes_the_folder_and_says_what_to_train_with(tmp_path, capsys):
    (tmp_path / "t.txt").write_text(CORPUS)
    argv = [str(tmp_path / "t.txt"), str(tmp_path / "out"), "--vocab-size", "280"]
    assert prepare_command.main(argv) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("wrote ") and line.endswith(f"data.path={tmp_path / 'out'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "t.txt"]


def test_a_folder_of_documents_ends_each_with_end_of_text(tmp_path):
    """Every file below the folder, in name order, hidden ones left out; an empty one adds none
    of its text."""
    corpus = tmp_path / "corpus"
    (corpus / "b").mkdir(parents=True)
    (corpus / "a.txt").write_text(CORPUS[:3000])
    (corpus / "b" / "c.md").write_text(CORPUS[3000:6000])
    (corpus / "empty.txt").write_text("")
    (corpus / ".git").mkdir()
    (corpus / ".git" / "index").write_bytes(b"\x00\xff binary")
    meta = prepare([corpus], tmp_path / "out", vocab_size=280)
    assert meta["corpus"] == {"files": 3, "bytes": 6000}
    ids = np.concatenate(
        [np.fromfile(tmp_path / "out" / f"{s}-0000.bin", dtype=np.uint16) for s in SPLITS]
    )
    assert (ids == meta["end_of_text_id"]).sum() == 3


def test_a_vocabulary_past_uint16_is_stored_and_read_as_uint32(tmp_path, monkeypatch):
    # instead of 65536 ids: a small corpus has past it
    monkeypatch.setattr(prepare_command, "UINT16_IDS", 290)
    (tmp_path / "t.txt").write_text(CORPUS)
    meta = prepare([tmp_path / "t.txt"], tmp_path / "out", vocab_size=300)
    assert meta["dtype"] == "uint32"
    assert (tmp_path / "out" / "train-0000.bin").stat().st_size == 4 * meta["tokens"]["train"]
    cfg = compose_and_check([*GPT, f"data.path={tmp_path / 'out'}", "data.vocab_size=null"])
    assert cfg.data.vocab_size == 300  # null: the tokenizer's
    inputs, labels = TokenShards(cfg.data, held_out=False)[[0, 1]]
    first = np.fromfile(tmp_path / "out" / "train-0000.bin", dtype=np.uint32)[:5].tolist()
    assert inputs[0].tolist() == first[:4] and labels[0].tolist() == first[1:5]


def test_sequences_are_cut_within_shards_and_held_out_ones_from_val(tmp_path, monkeypatch):
    """Shards of 1000 tokens: each sequence of seq_len + 1 lies in one shard, the shard's tail
    left out; the held-out set is the val shards'."""
    monkeypatch.setattr(prepare_command, "SHARD_TOKENS", 1000)
    (tmp_path / "t.txt").write_text(CORPUS)
    meta = prepare([tmp_path / "t.txt"], tmp_path / "out", vocab_size=300)
    listed = meta["shards"]["train"]
    assert len(listed) > 2 and all(s["tokens"] == 1000 for s in listed[:-1])
    cfg = compose_and_check([*GPT, f"data.path={tmp_path / 'out'}", "data.seq_len=64"])
    train, held = TokenShards(cfg.data, False), TokenShards(cfg.data, True)
    shards = [np.fromfile(tmp_path / "out" / s["file"], dtype=np.uint16) for s in listed]
    rows = [s[i * 64 : i * 64 + 65] for s in shards for i in range((len(s) - 1) // 64)]
    assert len(train) == len(rows) == cfg.data.training_samples()[0]
    inputs, labels = train[list(range(len(train)))]
    assert torch.equal(
        torch.cat([inputs, labels[:, -1:]], 1), torch.tensor(np.stack(rows).astype(np.int64))
    )
    val = np.fromfile(tmp_path / "out" / "val-0000.bin", dtype=np.uint16)
    assert len(held) == (len(val) - 1) // 64 == cfg.data.held_out_samples()[0]
    assert held[[0]][0][0].tolist() == val[:64].tolist()


def test_a_worker_gets_the_shards_mapped_not_copied(folder):
    cfg = compose_and_check([*GPT, f"data.path={folder}"])
    shards = TokenShards(cfg.data, False)
    shards[[0]]  # maps the files in this process
    assert len(pickle.dumps(shards)) < 2000  # what a spawned DataLoader worker receives
    assert torch.equal(pickle.loads(pickle.dumps(shards))[[3]][0], shards[[3]][0])


def world_steps(dataset, processes, accumulation, epoch=0, start=0):
    """Each optimizer step's token rows over every rank, as each rank's loader hands them out."""
    ranks = []
    for rank in range(processes):
        loader, batches = build_loader(
            dataset, DATA, accumulation, 5, torch.device("cpu"), World(rank=rank, size=processes)
        )
        batches.set_position(epoch, start)
        ranks.append([inputs for inputs, _ in loader])
    return [
        sorted(
            tuple(row.tolist())
            for rank in ranks
            for inputs in rank[s * accumulation : (s + 1) * accumulation]
            for row in inputs
        )
        for s in range(len(ranks[0]) // accumulation)
    ]


DATA = SimpleNamespace(batch_size=2, on_device=False, num_workers=0, pin_memory=False)


def test_text_shards_resumed_on_another_world_size_give_the_steps_an_unbroken_run_takes(folder):
    """4 processes × 2 × 1, stopped after 3 steps of epoch 1; resumed from that position on 2
    processes accumulating 2: each later step takes the token rows the unbroken run's would."""
    cfg = compose_and_check([*GPT, f"data.path={folder}"])
    shards = TokenShards(cfg.data, held_out=False)
    unbroken = world_steps(shards, 4, 1, epoch=1)
    assert len(unbroken) > 5
    assert world_steps(shards, 2, 2, epoch=1, start=3 * 8) == unbroken[3:]
    assert world_steps(shards, 1, 4, epoch=1, start=3 * 8) == unbroken[3:]
    assert world_steps(shards, 4, 1, epoch=2) != unbroken  # another epoch, another order


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

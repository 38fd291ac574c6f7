"""python -m <pkg>.evaluate: a checkpoint scored on held-out data, the same on any number of
processes; and the data folders that data=tokens reads."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import PACKAGE, read_metrics, shared_folder, train_command
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from tolerance import reordered

from ddp_project import check
from ddp_project import evaluate as evaluate_module
from ddp_project.config.error import ConfigError
from ddp_project.config.options import HELD_OUT
from ddp_project.config.schema import TrainConfig, register_configs
from ddp_project.core.world import World
from ddp_project.data import TokenShards, build_dataset
from ddp_project.model import build_model
from ddp_project.prepare import prepare
from ddp_project.run.trainer import Trainer

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample.txt"


def evaluate(cwd: Path, *args: str, nproc: int = 0) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", f"{PACKAGE}.evaluate", *args]
    if nproc:
        command = [*train_command(nproc=nproc)[:-2], "-m", f"{PACKAGE}.evaluate", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240)


def composed(*overrides: str) -> TrainConfig:
    """configs/train.yaml composed with `overrides`, as train composes it."""
    register_configs()
    with initialize_config_module(config_module=f"{PACKAGE}.configs", version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="train", overrides=list(overrides)))


def train_here(cfg: TrainConfig, run_dir: Path) -> None:
    """Train as one process does, in this one, on a gloo group of its own: what is tested here
    is what evaluate makes of the checkpoints (a launch costs seconds of CPU; test_launch.py and
    test_resume.py launch)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a launched worker computes (OMP_NUM_THREADS=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not Trainer(cfg, World(), torch.device("cpu"), run_dir).train()  # not stopped
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(request) -> Path:
    """60 steps, a checkpoint and a validation at 30 and 60, in outputs/<run> of its folder;
    scored on one process and on two below."""
    cwd = shared_folder(request)
    cfg = composed("trainer.max_steps=60", "trainer.checkpoint_every=30", "trainer.val_every=30")
    train_here(cfg, cwd / "outputs" / "2026-01-01_00-00-00_aaaaaa")
    return cwd


def test_a_checkpoint_scores_the_same_on_one_and_on_two_processes(trained, run_here):
    """Two processes launched (each scores a shard); one in this process."""
    (run_dir,) = (trained / "outputs").iterdir()
    code, out, err = run_here(trained, "ckpt=latest")
    assert code == 0, err[-3000:]
    result = json.loads((run_dir / "eval" / "step_000000060.json").read_text())
    assert result["step"] == 60 and result["world_size"] == 1
    assert result["held_out_predictions"] == 16384 // HELD_OUT
    assert result["accuracy"] > 0.3  # 8 classes: chance is 0.125
    assert out.strip().endswith(
        f"-> {(run_dir / 'eval' / 'step_000000060.json').relative_to(trained)}"
    )
    two = evaluate(
        trained,
        f"ckpt={run_dir / 'checkpoints' / 'step_000000030.pt'}",
        "data.batch_size=100",
        nproc=2,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    # Each run overwrites eval/step_000000030.json: read the two-process result before the next.
    sharded = json.loads((run_dir / "eval" / "step_000000030.json").read_text())
    code, _, err = run_here(trained, f"ckpt={run_dir / 'checkpoints' / 'step_000000030.pt'}")
    assert code == 0, err[-3000:]
    whole = json.loads((run_dir / "eval" / "step_000000030.json").read_text())
    assert (sharded["world_size"], whole["world_size"]) == (2, 1)
    assert sharded["held_out_predictions"] == whole["held_out_predictions"] == 16384 // HELD_OUT
    # two shards' sums of the held-out losses, then their sum, against one sum of all of them
    held_out = sharded["held_out_predictions"]
    assert sharded["loss"] == pytest.approx(whole["loss"], rel=reordered(terms=held_out))
    assert sharded["accuracy"] == pytest.approx(whole["accuracy"], abs=1e-9)
    assert whole["loss"] > result["loss"]  # step 30 knew less than step 60
    # Validation while training is this score, the same figures at the same step.
    validated = {row["step"]: row for row in read_metrics(run_dir)}
    assert (validated[60]["val_loss"], validated[60]["val_accuracy"]) == (
        result["loss"],
        result["accuracy"],
    )
    assert (validated[30]["val_loss"], validated[30]["val_accuracy"]) == (
        whole["loss"],
        whole["accuracy"],
    )


# --- in-process: evaluate.main on checkpoints written here, no launch -------------------------


def write_checkpoint(path: Path, compose_train, *overrides: str, step: int = 5) -> Path:
    """A checkpoint as the Checkpointer wrote one (an untrained model) before checkpoints recorded
    their options (model=mlp): evaluate reads it by its keys, which fit one option of each group."""
    cfg = OmegaConf.to_object(compose_train(*overrides))
    with torch.device("cpu"):
        model = build_model(cfg.model, cfg.data)
    config = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(
        {"step": step, "model": model.state_dict(), "optimizer": {}, "data": {}, "config": config},
        path,
    )
    return path


@pytest.fixture
def run_here(monkeypatch, capsys):
    """run_here(cwd, *args) -> (exit code, stdout, stderr) of evaluate's main, in this process."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def run(cwd: Path, *args: str) -> tuple[int, str, str]:
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", ["evaluate", *args])
        code = evaluate_module.main()
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def damaged(folder: Path, compose_train) -> dict[str, Path]:
    good = write_checkpoint(folder / "good.pt", compose_train)
    files = {
        "good": good,
        "empty": folder / "empty.pt",
        "text": folder / "text.pt",
        "truncated": folder / "truncated.pt",
        "foreign": folder / "foreign.pt",
        "keyless": folder / "keyless.pt",
        "pickle": folder / "pickle.pt",
        "list": folder / "list.pt",
    }
    files["empty"].write_bytes(b"")
    files["text"].write_text("step: 5\nmodel: none\n")
    files["truncated"].write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    torch.save({"weight": torch.ones(3)}, files["foreign"])
    state = torch.load(good, weights_only=True)
    del state["config"]
    torch.save(state, files["keyless"])
    files["pickle"].write_bytes(pickle.dumps(World()))
    torch.save([torch.ones(1)], files["list"])
    return files


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("empty", "the file is empty"),
        ("text", "not a checkpoint: torch.save writes a zip archive; this file starts b'step'"),
        ("truncated", "truncated or corrupt: its zip archive has no end"),
        ("foreign", "not a training checkpoint: it has no step, model, config (its keys: weight)"),
        ("keyless", "not a training checkpoint: it has no config (its keys: data, model, "),
        ("pickle", "holds Python objects beyond tensors and plain data"),
        ("list", "not a training checkpoint: it holds a list, not a dict"),
    ],
)
def test_a_file_that_is_no_checkpoint_is_one_line_naming_it(
    tmp_path, compose_train, run_here, name, why
):
    files = damaged(tmp_path, compose_train)
    code, out, err = run_here(tmp_path, f"ckpt={files[name].name}")
    assert (code, out) == (2, "")
    assert err.startswith(f"config error: ckpt={name}.pt: {why}") and err.count("\n") == 1, err


def test_a_checkpoint_outside_a_run_is_scored_with_its_result_beside_it(
    tmp_path, compose_train, run_here
):
    write_checkpoint(tmp_path / "models" / "mine.pt", compose_train)
    code, out, err = run_here(tmp_path, "ckpt=models/mine.pt")
    assert code == 0, err
    assert out.endswith(" held-out predictions -> models/eval/mine.json\n")
    assert json.loads((tmp_path / "models" / "eval" / "mine.json").read_text())["step"] == 5


def test_an_empty_held_out_set_is_one_line(tmp_path, compose_train, run_here):
    # 9 samples: one part in HELD_OUT held out rounds down to none
    write_checkpoint(
        tmp_path / "run" / "checkpoints" / "step_000000005.pt",
        compose_train,
        "data.num_samples=9",
        "data.batch_size=4",
    )
    code, out, err = run_here(tmp_path, "ckpt=run")
    assert (code, out) == (2, "")
    assert err == (
        "config error: data.num_samples=9: 0 held-out sample(s) (one in 10) for 1 process(es), "
        "which need one each; evaluate with more data\n"
    )


def test_more_processes_than_held_out_samples_is_refused_with_how_many_fit(compose_train):
    cfg = OmegaConf.to_object(compose_train("data.num_samples=20"))  # 2 held out
    with pytest.raises(
        ConfigError,
        match=r"holds 2 held-out sample\(s\), fewer than the 3 .*"
        r"evaluate on at most 2 process\(es\)$",
    ):
        evaluate_module.held_out(cfg, World(size=3, local_size=3), batch_given=False)
    assert len(evaluate_module.held_out(cfg, World(size=2, local_size=2), batch_given=False)) == 2


def test_a_batch_size_too_large_speaks_of_held_out_samples(tmp_path, compose_train, run_here):
    write_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)
    code, out, err = run_here(tmp_path, "ckpt=run", "data.batch_size=100000")
    assert (code, out) == (2, "")
    assert err == (
        "config error: data.batch_size=100000: each of 1 process(es) scores 1638 of the 1638 "
        "held-out samples of data.num_samples=16384; use a batch size of at most 1638\n"
    )
    # the checkpoint's own batch size is no request: a large one is capped by the share
    write_checkpoint(
        tmp_path / "big" / "checkpoints" / "step_000000005.pt",
        compose_train,
        "data.batch_size=4096",
        "data.num_samples=65536",
    )
    code, out, err = run_here(tmp_path, "ckpt=big/checkpoints")  # its checkpoints/ folder named
    assert code == 0 and " on 6553 held-out predictions -> " in out, err


def test_a_read_only_run_dir_still_prints_the_score(tmp_path, compose_train, run_here):
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints" / "step_000000005.pt", compose_train)
    if os.geteuid() == 0:  # root writes through a read-only mode: an eval/ that cannot be made
        (run / "eval").write_text("")
    run.chmod(0o555)
    try:
        code, out, err = run_here(tmp_path, "ckpt=run")
    finally:
        run.chmod(0o755)
    assert code == 1
    assert out.startswith("run/checkpoints/step_000000005.pt: loss ") and out.endswith(
        " on 1638 held-out predictions\n"
    )
    assert err.startswith("evaluate: could not save run/eval/step_000000005.json: ")
    assert err.count("\n") == 1 and not list(run.glob("eval/.partial-*"))


def test_latest_falls_back_to_the_newest_checkpoint_that_loads_and_says_so(
    tmp_path, compose_train, run_here
):
    older = tmp_path / "outputs" / "2026-01-01_00-00-00_aaaaaa" / "checkpoints"
    newer = tmp_path / "outputs" / "2026-01-02_00-00-00_bbbbbb" / "checkpoints"
    write_checkpoint(older / "step_000000005.pt", compose_train)
    write_checkpoint(newer / "step_000000007.pt", compose_train, step=7)
    (newer / "step_000000007.pt").write_bytes(b"cut")
    (tmp_path / "outputs" / "2026-01-03_00-00-00_cccccc").mkdir()  # started, nothing saved yet
    code, out, err = run_here(tmp_path, "ckpt=latest")
    assert code == 0, err
    assert out.startswith(f"{older.relative_to(tmp_path)}/step_000000005.pt: loss ")
    assert err == (
        "ckpt=latest: scoring outputs/2026-01-01_00-00-00_aaaaaa/checkpoints/step_000000005.pt, "
        "the newest that loads; passed over outputs/2026-01-03_00-00-00_cccccc (no checkpoint); "
        "outputs/2026-01-02_00-00-00_bbbbbb/checkpoints/step_000000007.pt: not a checkpoint: "
        "torch.save writes a zip archive; this file starts b'cut'\n"
    )
    (older / "step_000000005.pt").write_bytes(b"")
    code, out, err = run_here(tmp_path, "ckpt=latest")
    assert (code, out) == (2, "")
    assert err.startswith(
        "config error: ckpt=latest: no checkpoint under outputs/ loads; the newest: "
    )


def test_ctrl_c_is_one_line(tmp_path, compose_train, run_here, monkeypatch):
    write_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluate_module, "evaluate", interrupted)
    assert run_here(tmp_path, "ckpt=run") == (
        130,
        "",
        "evaluate: stopped by Ctrl-C before the score was complete; nothing saved\n",
    )


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("ckpt=nowhere", "config error: ckpt=nowhere: no such file or run dir\n"),
        ("model.depth=3", "config error: model.depth: the checkpoint's config decides it; "),
        ("verbose", "config error: verbose: write ckpt=<file|run dir|latest> or key=value\n"),
        ("ckpt=latest", "config error: ckpt=latest: no run under outputs/ has a checkpoint\n"),
        ("ckpt=", "config error: ckpt= is empty; write ckpt=<file|run dir|latest> or key=value"),
        ("ckpt=run", "config error: ckpt=run: no checkpoint in run/checkpoints\n"),
        ("data.batch_size=abc", "config error: "),
        ("ckpt=/dev/null", "config error: ckpt=/dev/null: not a regular file nor a run dir\n"),
        (f"ckpt={'a' * 5000}", f"config error: ckpt={'a' * 100}...: File name too long\n"),
        ("data.batch_size=0", "config error: data.batch_size=0: must be at least 1"),
    ],
)
def test_a_hostile_argument_is_one_line(tmp_path, compose_train, run_here, arg, message):
    (tmp_path / "run").mkdir()
    if arg.startswith("data."):
        write_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)
        arg = f"ckpt=run {arg}"
    code, out, err = run_here(tmp_path, *arg.split())
    assert (code, out) == (2, "") and err.startswith(message) and err.count("\n") == 1, err


def test_a_checkpoint_records_its_options_and_one_without_is_read_by_its_keys(trained):
    """The Checkpointer's checkpoints say which options built them; write_checkpoint's (the
    format of before) do not, and score all the same above."""
    (run_dir,) = (trained / "outputs").iterdir()
    state = torch.load(run_dir / "checkpoints" / "step_000000060.pt", weights_only=True)
    assert state["options"] == {"data": "synthetic", "model": "mlp"}


@pytest.mark.parametrize(
    ("options", "args", "message"),
    [
        ([1], [], "ckpt=run/checkpoints/step_000000005.pt: its 'options' is a list, not a dict"),
        (
            {"model": "resmlp"},
            [],
            "model=resmlp: the checkpoint was trained with this option, which "
            "is not registered here (registered: mlp, gpt); register it again to read it",
        ),
        (
            {"model": 5},
            [],
            "model=5: the checkpoint was trained with this option, which is not registered here",
        ),
        (
            {"model": "gpt"},
            [],
            "model=gpt: the checkpoint's keys (depth, hidden_dim) are not those "
            "of its schema GptConfig (d_model, n_head, n_layer)",
        ),
        (
            {"model": "mlp"},
            ["model=gpt"],
            "model=gpt: the checkpoint was trained with model=mlp, "
            "which builds it; leave model= out",
        ),
        (None, ["model=nope"], "model=nope: no such option; allowed: mlp, gpt"),
        (
            None,
            ["data=tokens"],
            "data=tokens: its keys (batch_size, num_samples, num_workers, on_device, path, "
            "pin_memory, seq_len, vocab_size) are not the checkpoint's (batch_size, num_classes, "
            "num_features, num_samples, num_workers, on_device, pin_memory)",
        ),
    ],
)
def test_options_that_cannot_be_the_checkpoints_are_one_line(
    tmp_path, compose_train, run_here, options, args, message
):
    path = write_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)
    if options is not None:
        torch.save({**torch.load(path, weights_only=True), "options": options}, path)
    code, out, err = run_here(tmp_path, "ckpt=run", *args)
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"config error: {message}"), err
    # the options it was trained with, named: scored where nothing else is wrong
    code, out, err = run_here(tmp_path, "ckpt=run", "model=mlp", "data=synthetic")
    assert code == (0 if options in (None, {"model": "mlp"}) else 2), err


def test_held_out_data_is_never_trained_on(compose_train):
    for overrides in ([], ["model=gpt", "data=tokens"]):
        cfg = OmegaConf.to_object(compose_train(*overrides))
        train, held = build_dataset(cfg.data, 0), build_dataset(cfg.data, 0, held_out=True)
        assert len(held) == cfg.data.num_samples // HELD_OUT
        seen = {tuple(row.tolist()) for row in train.tensors[0]}
        assert not any(tuple(row.tolist()) in seen for row in held.tensors[0])


def test_the_sample_text_trains_and_keeps_its_val_shard_for_evaluation(tmp_path, run_here):
    """data/sample.txt made into a data folder: the GPT learns it, evaluate scores the val
    shard, which training never reads."""
    meta = prepare([SAMPLE], tmp_path / "sample", vocab_size=512)
    overrides = (
        "model=gpt",
        "data=tokens",
        f"data.path={tmp_path / 'sample'}",
        "data.seq_len=64",
        "data.vocab_size=null",
        "data.batch_size=8",
        "model.d_model=64",
        "model.n_layer=2",
        "trainer.lr=0.003",
    )
    cfg = composed(*overrides)
    assert cfg.data.vocab_size == meta["vocab_size"] == 512  # null: the tokenizer's
    train, held = TokenShards(cfg.data, held_out=False), TokenShards(cfg.data, held_out=True)
    assert (len(train), len(held)) == tuple(
        (meta["tokens"][split] - 1) // 64 for split in ("train", "val")
    )
    inputs, labels = train[[0, 1]]
    assert inputs.dtype == torch.long and torch.equal(inputs[:, 1:], labels[:, :-1])
    seen = {tuple(row.tolist()) for row in train.in_memory().tensors[0]}
    assert not any(tuple(row.tolist()) in seen for row in held.in_memory().tensors[0])
    cfg = composed(*overrides, "trainer.max_steps=40", "trainer.log_every=20")
    train_here(cfg, tmp_path / "run")
    losses = [row["loss"] for row in read_metrics(tmp_path / "run")]
    assert losses[-1] < 0.9 * losses[0]  # 6.0 -> 5.2 in 40 steps
    code, _, err = run_here(tmp_path, "ckpt=run")
    assert code == 0, err[-3000:]
    (scored,) = (tmp_path / "run" / "eval").iterdir()
    assert json.loads(scored.read_text())["held_out_predictions"] == len(held) * 64


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("missing", "config error: data.path=missing: no such folder here"),
        ("tiny.bin", "config error: data.path=tiny.bin: a file, not a data folder"),
    ],
)
def test_an_unusable_data_folder_is_one_line(tmp_path, monkeypatch, capsys, path, message):
    """python -m <pkg>.check's main, in this process."""
    (tmp_path / "tiny.bin").write_bytes(b"\x01\x00" * 20)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["check", "model=gpt", "data=tokens", f"data.path={path}"])
    try:
        code = check.main()
    except SystemExit as stop:  # core.exits.exit_with_error
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(message), err

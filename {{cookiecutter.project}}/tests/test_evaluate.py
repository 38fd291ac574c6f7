"""python -m <pkg>.evaluate: a checkpoint scored on held-out data, the same on any number of
processes; and the token files that data=tokens reads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PACKAGE, launch, read_metrics, shared_folder, train_command
from omegaconf import OmegaConf

from {{ cookiecutter.package }}.config import HELD_OUT
from {{ cookiecutter.package }}.data import TokenFile, build_dataset, prepare

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "sample.txt"


def evaluate(cwd: Path, *args: str, nproc: int = 0) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", f"{PACKAGE}.evaluate", *args]
    if nproc:
        command = [*train_command(nproc=nproc)[:-2], "-m", f"{PACKAGE}.evaluate", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def trained(request) -> Path:
    cwd = shared_folder(request)
    # trained on one process (seconds of CPU fewer); scored on one and on two below
    done = launch(
        cwd, "--nproc-per-node", "1", "trainer.max_steps=60", "trainer.checkpoint_every=30"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return cwd


def test_a_checkpoint_scores_the_same_on_one_and_on_two_processes(trained):
    (run_dir,) = (trained / "outputs").iterdir()
    one = evaluate(trained, "ckpt=latest")
    assert one.returncode == 0, one.stderr[-3000:]
    result = json.loads((run_dir / "eval" / "step_000000060.json").read_text())
    assert result["step"] == 60 and result["world_size"] == 1
    assert result["held_out_predictions"] == 16384 // HELD_OUT
    assert result["accuracy"] > 0.3  # 8 classes: chance is 0.125
    assert one.stdout.strip().endswith(
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
    again = evaluate(trained, f"ckpt={run_dir / 'checkpoints' / 'step_000000030.pt'}")
    assert again.returncode == 0, again.stderr[-3000:]
    whole = json.loads((run_dir / "eval" / "step_000000030.json").read_text())
    assert (sharded["world_size"], whole["world_size"]) == (2, 1)
    assert sharded["held_out_predictions"] == whole["held_out_predictions"] == 16384 // HELD_OUT
    assert sharded["loss"] == pytest.approx(whole["loss"], rel=1e-5)  # two shards, one whole
    assert sharded["accuracy"] == pytest.approx(whole["accuracy"], abs=1e-9)
    assert whole["loss"] > result["loss"]  # step 30 knew less than step 60


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ckpt=nowhere"], "config error: ckpt=nowhere: no such file or run dir"),
        (["model.depth=3"], "config error: model.depth: the checkpoint's config decides it"),
        (["verbose"], "config error: verbose: write ckpt=<file|run dir|latest> or key=value"),
    ],
)
def test_a_bad_argument_is_one_line(trained, args, message):
    done = evaluate(trained, *args)
    assert (
        done.returncode == 2
        and done.stderr.startswith(message)
        and len(done.stderr.splitlines()) == 1
    )


def test_latest_without_any_run_is_one_line(tmp_path):
    done = evaluate(tmp_path, "ckpt=latest")
    assert (done.returncode, done.stderr) == (
        2,
        "config error: ckpt=latest: no run under outputs/ has a checkpoint\n",
    )


def test_held_out_data_is_never_trained_on(compose_train):
    for overrides in ([], ["model=gpt", "data=tokens"]):
        cfg = OmegaConf.to_object(compose_train(*overrides))
        train, held = build_dataset(cfg.data, 0), build_dataset(cfg.data, 0, held_out=True)
        assert len(held) == cfg.data.num_samples // HELD_OUT
        seen = {tuple(row.tolist()) for row in train.tensors[0]}
        assert not any(tuple(row.tolist()) in seen for row in held.tensors[0])


def test_a_token_file_from_text_trains_and_keeps_its_tail_for_evaluation(tmp_path):
    tokens = tmp_path / "sample.bin"
    count = prepare(SAMPLE, tokens)
    assert count == SAMPLE.stat().st_size and tokens.stat().st_size == 2 * count
    overrides = ("model=gpt", "data=tokens", f"data.path={tokens}", "data.seq_len=64", "data.vocab_size=256",
                 "data.batch_size=8", "model.d_model=64", "model.n_layer=2", "trainer.lr=0.003")  # fmt: skip
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module=f"{PACKAGE}.configs", version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=list(overrides)))
    train, held = TokenFile(cfg.data, held_out=False), TokenFile(cfg.data, held_out=True)
    sequences = (count - 1) // 64
    assert len(held) == sequences // HELD_OUT and len(train) + len(held) == sequences
    inputs, labels = train[[0, 1]]
    assert inputs.dtype == torch.long and torch.equal(inputs[:, 1:], labels[:, :-1])
    assert bytes(inputs[0].tolist()) == SAMPLE.read_bytes()[:64]
    done = launch(tmp_path, "--nproc-per-node", "1", *overrides, "trainer.max_steps=40", "trainer.log_every=20",
                  "hydra.run.dir=run")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [row["loss"] for row in read_metrics(tmp_path / "run")]
    assert losses[-1] < 0.7 * losses[0]
    scored = evaluate(tmp_path, "ckpt=run")
    assert scored.returncode == 0, scored.stderr[-3000:]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("missing.bin", "config error: data.path=missing.bin: no such file here"),
        (
            "tiny.bin",
            "config error: data.path=tiny.bin: holds 0 sequence(s) of data.seq_len=128 tokens",
        ),
    ],
)
def test_an_unusable_token_file_is_one_line(tmp_path, path, message):
    (tmp_path / "tiny.bin").write_bytes(b"\x01\x00" * 20)
    done = subprocess.run([sys.executable, "-m", f"{PACKAGE}.check", "model=gpt", "data=tokens", f"data.path={path}"],
                          cwd=tmp_path, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr

"""python -m <pkg>.generate and python -m <pkg>.export: text from a GPT checkpoint, and its
weights as bf16 safetensors; each checkpoint format, each tokenizer place, each bad input as one
line. The README's commands run as written at the end."""

import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from conftest import PACKAGE, ROOT, launch_command, make_line, users_env
from omegaconf import OmegaConf
from torch import nn

from ddp_project import export as export_module
from ddp_project import generate as generate_module
from ddp_project.config.options import GptConfig, TokensConfig
from ddp_project.core.world import World
from ddp_project.model import Gpt, build_model
from ddp_project.prepare import prepare
from ddp_project.run.sampling import sample
from ddp_project.run.trainer import Trainer

SAMPLE = ROOT / "data" / "sample.txt"
TINY = (
    "model=gpt",
    "data=tokens",
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=32",
    "data.seq_len=16",
    "data.num_samples=64",
)


# --- the sampling, on models whose logits are known -------------------------------------------


class Counting(nn.Module):
    """Logits that rank token (last + 1) % vocab first, then (last + 2), ...; it records the
    length of each input it is shown."""

    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        self.vocab, self.seen = vocab, []
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.seen.append(tokens.shape[1])
        ranks = (torch.arange(self.vocab) - tokens[:, -1:, None] - 1) % self.vocab
        return -ranks.float().expand(tokens.shape[0], tokens.shape[1], self.vocab)


def test_greedy_takes_the_likeliest_token_each_time():
    tokens = sample(Counting(), [3], 5, context=4, temperature=0)
    assert list(tokens) == [4, 5, 6, 7, 8]


def test_the_model_sees_at_most_its_context():
    model = Counting()
    list(sample(model, [1, 2, 3, 4, 5, 6], 4, context=4, temperature=0))
    assert model.seen == [4, 4, 4, 4]


def test_top_k_samples_among_the_k_likeliest_only_and_a_seed_repeats_them():
    def draw(top_k, seed):
        generator = torch.Generator().manual_seed(seed)
        return list(sample(Counting(), [0], 200, context=4, temperature=5.0, top_k=top_k,
                           generator=generator))  # fmt: skip

    steps = draw(2, 0)

    # each token is one or two past the one before: the two likeliest
    def strides(tokens):
        return {(b - a) % 10 for a, b in zip([0, *tokens], tokens, strict=False)}

    assert strides(steps) == {1, 2}
    assert len(strides(draw(None, 0))) > 2
    assert draw(2, 0) == steps and draw(2, 1) != steps


# --- checkpoints written here ---------------------------------------------------------------


def gpt_checkpoint(path: Path, compose_train, *overrides: str, data_path="data/sample.bin",
                   ema: bool = False) -> Path:  # fmt: skip
    """An untrained tiny GPT's checkpoint as the Checkpointer writes one; its data.path is
    recorded as `data_path`, which need not be there (a model is built from the data's shape)."""
    cfg = OmegaConf.to_object(compose_train(*TINY, *overrides))
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data)
    config = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    config["data"]["path"] = data_path
    state = {"step": 5, "model": model.state_dict(), "optimizer": {}, "data": {},
             "config": config, "options": {"model": "gpt", "data": "tokens"}}  # fmt: skip
    if ema:
        state["ema"] = {k: v + 0.5 if v.is_floating_point() else v for k, v in
                        model.state_dict().items()}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


def tokenizer_file(path: Path, vocab: int = 300) -> Path:
    """A byte-level BPE of at most `vocab` tokens, trained on the sample text, as the data
    command saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([SAMPLE.read_text()], trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


@pytest.fixture
def run_here(monkeypatch, capsys):
    """run_here(cwd, module, *args) -> (exit code, stdout, stderr) of its main, in this process."""
    commands = {"generate": generate_module, "export": export_module}

    def run(cwd: Path, command: str, *args: str) -> tuple[int, str, str]:
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", [command, *args])
        code = commands[command].main()
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


CKPT = "ckpt=run/checkpoints/step_000000005.pt"


def test_a_model_of_bytes_continues_text_and_the_same_seed_gives_the_same_text(
    tmp_path, compose_train, run_here
):
    gpt_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)
    code, out, err = run_here(tmp_path, "generate", CKPT, "prompt=The cat", "max_new_tokens=12")
    assert (code, err) == (0, "") and out.startswith("The cat") and out.endswith("\n")
    again = run_here(tmp_path, "generate", CKPT, "prompt=The cat", "max_new_tokens=12")
    other = run_here(tmp_path, "generate", CKPT, "prompt=The cat", "max_new_tokens=12", "seed=1")
    assert again[1] == out and other[1] != out
    code, out, err = run_here(tmp_path, "generate", CKPT, "prompt_ids=1,2,3", "max_new_tokens=7")
    ids = [int(i) for i in out.split(",")]
    assert code == 0 and ids[:3] == [1, 2, 3] and len(ids) == 10 and max(ids) < 256


def test_a_prompt_longer_than_the_context_is_cut_to_it(tmp_path, compose_train, run_here):
    gpt_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)
    code, out, err = run_here(tmp_path, "generate", CKPT, "prompt=" + "x" * 100, "max_new_tokens=3")
    assert code == 0, err
    assert out.startswith("x" * 100)


def test_the_run_dirs_tokenizer_encodes_before_the_data_folders(tmp_path, compose_train, run_here):
    gpt_checkpoint(
        tmp_path / "run" / "checkpoints" / "step_000000005.pt",
        compose_train,
        "data.vocab_size=320",
        data_path="corpus/train.bin",
    )
    # the data folder's alone: it is read (320 tokens at most: it fits the model)
    tokenizer_file(tmp_path / "corpus" / "tokenizer.json")
    code, out, err = run_here(tmp_path, "generate", CKPT, "prompt=The house", "max_new_tokens=5")
    assert code == 0 and out.startswith("The house"), err
    # the run dir's is read first: one too large for the model is refused, naming it
    tokenizer_file(tmp_path / "run" / "tokenizer.json", vocab=400)
    code, out, err = run_here(tmp_path, "generate", CKPT, "prompt=The house")
    assert (code, out) == (2, "")
    assert re.fullmatch(
        r"config error: run/tokenizer.json=\d+ tokens: more than the model's "
        r"data.vocab_size=320: not the tokenizer it was trained with\n",
        err,
    )
    (tmp_path / "run" / "tokenizer.json").write_text("{not json")
    code, out, err = run_here(tmp_path, "generate", CKPT, "prompt=The house")
    assert code == 2 and err.startswith("config error: run/tokenizer.json: not a tokenizer: ")
    assert err.count("\n") == 1


@pytest.mark.parametrize("data_path", ["corpus/train.bin", None])
def test_tokens_no_text_maps_to_take_prompt_ids(tmp_path, compose_train, run_here, data_path):
    """No tokenizer, and a model of more than bytes or of synthetic tokens: text is refused,
    and ids are taken."""
    vocab = "data.vocab_size=320" if data_path else "data.vocab_size=256"
    gpt_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train, vocab,
                   data_path=data_path)  # fmt: skip
    code, out, err = run_here(tmp_path, "generate", CKPT, "prompt=hello")
    assert (code, out) == (2, "")
    why = (
        "no tokenizer.json in run or in its data folder (corpus/train.bin) maps text to its tokens"
        if data_path
        else "it was trained on synthetic tokens (data.path=null), which no text maps to"
    )
    ids = 320 if data_path else 256
    assert err == (
        f"config error: prompt: the model of run/checkpoints/step_000000005.pt: {why}; "
        f"give prompt_ids=1,2,3, ids below {ids}\n"
    )
    code, out, err = run_here(tmp_path, "generate", CKPT, "prompt_ids=300", "max_new_tokens=2")
    assert code == (0 if data_path else 2), err


def test_an_mlp_checkpoint_is_refused_in_one_line(tmp_path, compose_train, run_here):
    cfg = OmegaConf.to_object(compose_train())
    config = OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    path = tmp_path / "mlp.pt"
    torch.save({"step": 1, "model": build_model(cfg.model, cfg.data).state_dict(),
                "optimizer": {}, "data": {}, "config": config}, path)  # fmt: skip
    code, out, err = run_here(tmp_path, "generate", "ckpt=mlp.pt", "prompt=hi")
    assert (code, out) == (2, "")
    assert err == (
        "config error: ckpt=mlp.pt: generate continues token sequences; this checkpoint's model "
        "is an MLP over labelled points\n"
    )
    # export takes any model: an MLP's weights export as well
    code, out, err = run_here(tmp_path, "export", "ckpt=mlp.pt", "out=mlp")
    assert code == 0, err
    assert json.loads((tmp_path / "mlp" / "config.json").read_text())["data"] == {
        "num_features": cfg.data.num_features,
        "num_classes": cfg.data.num_classes,
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("ckpt=nowhere prompt=a", "ckpt=nowhere: no such file or run dir"),
        ("ckpt=text.pt prompt=a", "ckpt=text.pt: not a checkpoint: torch.save writes a zip"),
        ("ckpt=cut.pt prompt=a", "ckpt=cut.pt: truncated or corrupt: "),
        ("ckpt= prompt=a", "ckpt= is empty; "),
        (f"{CKPT} prompt=", 'prompt="": empty; give the text to continue'),
        (CKPT, 'no prompt: give prompt="text to continue" (or prompt_ids=1,2,3)'),
        (f"{CKPT} prompt=a prompt_ids=1", "prompt and prompt_ids: give one of them"),
        (f"{CKPT} prompt=a max_new_tokens=0", "max_new_tokens=0: must be at least 1"),
        (f"{CKPT} prompt=a max_new_tokens=-5", "max_new_tokens=-5: must be at least 1"),
        (f"{CKPT} prompt=a max_new_tokens=10**9", "max_new_tokens=10**9: not an integer"),
        (
            f"{CKPT} prompt=a max_new_tokens=1000000000",
            "max_new_tokens=1000000000: must be at most",
        ),
        (f"{CKPT} prompt=a temperature=-1", "temperature=-1: must be a number >= 0 (0: greedy)"),
        (f"{CKPT} prompt=a temperature=nan", "temperature=nan: must be a number >= 0"),
        (f"{CKPT} prompt=a temperature=inf", "temperature=inf: must be a number >= 0"),
        (f"{CKPT} prompt=a temperature=hot", "temperature=hot: not a number"),
        (f"{CKPT} prompt=a top_k=0", "top_k=0: must be at least 1"),
        (f"{CKPT} prompt=a top_k=257", "top_k=257: more than the model's 256 tokens; "),
        (f"{CKPT} prompt_ids=1,,2", "prompt_ids=1,,2: write ids as 1,2,3"),
        (f"{CKPT} prompt_ids=a", "prompt_ids=a: not an integer"),
        (f"{CKPT} prompt_ids=-1", "prompt_ids=-1: must be at least 0"),
        (f"{CKPT} prompt_ids=256", "prompt_ids=256: must be below the model's vocab_size=256"),
        (f"{CKPT} prompt=a weights=ema", "weights=ema: the checkpoint run/checkpoints/step_"),
        (f"{CKPT} prompt=a weights=best", "weights=best: must be ema or model"),
        (f"{CKPT} prompt=a temprature=1", "temprature: no such key; write key=value, with"),
        (f"{CKPT} hello", "hello: write key=value, with a key of: ckpt, prompt, "),
    ],
)
def test_a_hostile_generate_argument_is_one_line(tmp_path, compose_train, run_here, args, message):
    good = gpt_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)
    (tmp_path / "text.pt").write_text("step: 5\n")
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:500])
    code, out, err = run_here(tmp_path, "generate", *shlex.split(args))
    assert (code, out) == (2, "") and err.count("\n") == 1, err
    assert err.startswith(f"config error: {message}"), err


def test_ctrl_c_prints_what_was_made_so_far(tmp_path, compose_train, run_here, monkeypatch):
    gpt_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)

    def three_then_ctrl_c(*args, **kwargs):
        yield from (7, 8, 9)
        raise KeyboardInterrupt

    monkeypatch.setattr(generate_module, "sample", three_then_ctrl_c)
    code, out, err = run_here(tmp_path, "generate", CKPT, "prompt_ids=1")
    assert (code, out, err) == (
        130,
        "1,7,8,9\n",
        "generate: stopped by Ctrl-C after 3 new token(s)\n",
    )


def test_ema_weights_are_used_when_kept_and_weights_model_takes_the_trained_ones(
    tmp_path, compose_train, run_here
):
    gpt_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train, ema=True)
    args = (CKPT, "prompt_ids=1,2", "temperature=0", "max_new_tokens=20")
    chosen = [
        run_here(tmp_path, "generate", *args, *weights)[1]
        for weights in ([], ["weights=ema"], ["weights=model"])
    ]
    assert chosen[0] == chosen[1] != chosen[2]
    code, out, err = run_here(tmp_path, "export", CKPT, "out=ema")
    assert code == 0 and out.endswith("(ema weights) -> ema\n"), err
    assert json.loads((tmp_path / "ema" / "config.json").read_text())["weights"] == "ema"
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_000000005.pt")
    weights = safetensors.torch.load_file(tmp_path / "ema" / "model.safetensors")
    assert torch.equal(weights["head.weight"], state["ema"]["head.weight"].bfloat16())


# --- export ---------------------------------------------------------------------------------


def logits(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens)


def rebuilt(folder: Path) -> Gpt:
    """The exported model as a program without this project's checkpoints builds it."""
    config = json.loads((folder / "config.json").read_text())
    assert config["model_class"] == "ddp_project.model.Gpt"
    data = TokensConfig(**config["data"], num_samples=1, batch_size=1, num_workers=0,
                        pin_memory=False, on_device=False, path=None)  # fmt: skip
    return Gpt(GptConfig(**config["model"]), data)


def test_the_export_loads_back_and_gives_the_checkpoints_logits(tmp_path, compose_train, run_here):
    path = gpt_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)
    tokenizer_file(tmp_path / "run" / "tokenizer.json")
    code, out, err = run_here(tmp_path, "export", "ckpt=run", "out=exported")
    assert (code, err) == (0, "")
    assert out == f"{path.relative_to(tmp_path)} (model weights) -> exported\n"
    folder = tmp_path / "exported"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json"
    ]  # fmt: skip
    assert not list(tmp_path.glob(".partial-*"))
    config = json.loads((folder / "config.json").read_text())
    assert config == {
        "model_class": "ddp_project.model.Gpt",
        "model_option": "gpt",
        "model": {"n_layer": 1, "n_head": 2, "d_model": 32},
        "data_option": "tokens",
        "data": {"seq_len": 16, "vocab_size": 256},
        "weights": "model",
        "dtype": "bfloat16",
        "step": 5,
        "checkpoint": "run/checkpoints/step_000000005.pt",
        "tokenizer": "tokenizer.json",
        "shared": {},
    }
    state = torch.load(path)
    weights = safetensors.torch.load_file(folder / "model.safetensors")
    assert weights.keys() == state["model"].keys()  # the weights only: no optimizer, no RNG
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    model = rebuilt(folder)
    model.load_state_dict(weights)
    original = rebuilt(folder)
    original.load_state_dict(state["model"])
    tokens = torch.randint(0, 256, (2, 16))
    exported, expected = logits(model, tokens), logits(original, tokens)
    assert not torch.equal(exported, expected)  # the weights were rounded to bf16
    torch.testing.assert_close(exported, expected, atol=0.05, rtol=0.05)


def test_weights_two_names_share_are_written_once_and_load_back_shared(tmp_path):
    """safetensors refuses a file of shared tensors; the export keeps one and names the other."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.tokens.weight

    model = Tied()
    config: dict = {}
    export_module.write(model, tmp_path / "out", config, None)
    ((dropped, kept),) = config["shared"].items()  # which name safetensors keeps is its choice
    assert {dropped, kept} == {"head.weight", "tokens.weight"}
    assert safetensors.torch.load_file(tmp_path / "out" / "model.safetensors").keys() == {kept}
    loaded = Tied()
    safetensors.torch.load_model(loaded, tmp_path / "out" / "model.safetensors")
    assert loaded.head.weight is loaded.tokens.weight
    assert torch.equal(loaded.tokens.weight, model.tokens.weight.float())


def test_an_out_that_holds_files_is_replaced_only_with_overwrite(tmp_path, compose_train, run_here):
    gpt_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)
    (tmp_path / "empty").mkdir()
    assert run_here(tmp_path, "export", CKPT, "out=empty")[0] == 0  # an empty folder is no loss
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("mine")
    code, out, err = run_here(tmp_path, "export", CKPT, "out=old")
    assert (code, out) == (2, "")
    assert err == "config error: out=old: holds files already; add overwrite=true to replace it\n"
    assert (tmp_path / "old" / "keep.txt").read_text() == "mine"
    code, out, err = run_here(tmp_path, "export", CKPT, "out=old", "overwrite=true")
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == [
        "config.json", "model.safetensors"
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "old", "run"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("", "config error: no out=: give the folder to write, e.g. out=exported/"),
        ("out=", 'config error: out="": empty; give the folder to write'),
        ("out=x overwrite=yes", "config error: overwrite=yes: must be true or false"),
        ("out=x weights=ema", "config error: weights=ema: the checkpoint run/checkpoints/step_"),
        ("out=x ckpt=nowhere", "config error: ckpt=nowhere: no such file or run dir"),
        ("out=x ckpt=text.pt", "config error: ckpt=text.pt: not a checkpoint: "),
        ("out=x output=y", "config error: output: no such key; write key=value, with a key of: "),
        ("out=a-file", "config error: out=a-file: not a folder"),
        (
            "out=a-file/sub",
            "export: could not write a-file/sub: a-file: File exists; nothing",
        ),  # unwritable
    ],
)
def test_a_hostile_export_argument_is_one_line_and_writes_nothing(
    tmp_path, compose_train, run_here, args, message
):
    gpt_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)
    (tmp_path / "text.pt").write_text("step: 5\n")
    (tmp_path / "a-file").write_text("")
    before = sorted(tmp_path.rglob("*"))
    code, out, err = run_here(tmp_path, "export", CKPT, *args.split())
    assert (code, out) == (1 if "could not" in message else 2, "") and err.count("\n") == 1, err
    assert err.startswith(message), err
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError(28, "No space left on device")])
def test_an_export_stopped_midway_leaves_nothing_and_the_old_one_whole(
    tmp_path, compose_train, run_here, monkeypatch, stop
):
    gpt_checkpoint(tmp_path / "run" / "checkpoints" / "step_000000005.pt", compose_train)
    assert run_here(tmp_path, "export", CKPT, "out=exported")[0] == 0
    before = {p: p.read_bytes() for p in (tmp_path / "exported").iterdir()}
    save_model = safetensors.torch.save_model

    def half_then_stop(model, filename, **kwargs):
        save_model(model, filename, **kwargs)  # the weights are written; then the stop
        raise stop

    monkeypatch.setattr(safetensors.torch, "save_model", half_then_stop)
    code, out, err = run_here(tmp_path, "export", CKPT, "out=exported", "overwrite=true")
    if stop is KeyboardInterrupt:
        assert (code, out, err) == (130, "", "export: stopped by Ctrl-C; nothing written\n")
    else:
        assert (code, out) == (1, "")
        assert err == "export: could not write exported: No space left on device; nothing written\n"
    assert {p: p.read_bytes() for p in (tmp_path / "exported").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"]


def test_help_reads_and_writes_nothing(tmp_path, run_here):
    for command in ("generate", "export"):
        code, out, err = run_here(tmp_path, command, "ckpt=nowhere", "--help")
        assert (code, err) == (0, "") and out.startswith(f"usage: python -m {PACKAGE}.{command} ")
    assert list(tmp_path.iterdir()) == []


# --- trained checkpoints: both formats, and the README ----------------------------------------


def train_here(cfg, run_dir: Path) -> None:
    """Train as one process does, in this one, on a gloo group of its own (as test_evaluate)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert not Trainer(cfg, World(), torch.device("cpu"), run_dir).train()
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def test_a_dcp_checkpoint_generates_and_exports_as_its_file_twin(
    tmp_path, compose_train, run_here, monkeypatch
):
    """Two short runs from one seed, one per checkpoint format: the same weights either way."""
    prepare([SAMPLE], tmp_path / "sample", vocab_size=300)  # a small tokenizer: a fast model
    monkeypatch.chdir(tmp_path)  # data.path is relative, as a user gives it
    for form in ("file", "dcp"):
        cfg = OmegaConf.to_object(compose_train(
            *TINY, "data.path=sample", "data.vocab_size=null", "trainer.max_steps=4",
            "trainer.val_every=0", f"trainer.checkpoint_format={form}", "data.batch_size=4",
        ))  # fmt: skip
        train_here(cfg, tmp_path / form)
    shown = {}
    for form in ("file", "dcp"):
        (found,) = (tmp_path / form / "checkpoints").glob("step_*")
        assert found.suffix == (".pt" if form == "file" else ".dcp")
        code, out, err = run_here(tmp_path, "generate", f"ckpt={form}", "prompt=The ",
                                  "max_new_tokens=30")  # fmt: skip
        assert code == 0 and out.startswith("The "), err
        shown[form] = out
        assert run_here(tmp_path, "export", f"ckpt={found}", f"out={form}-out")[0] == 0
    assert shown["file"] == shown["dcp"]
    assert (tmp_path / "file-out" / "model.safetensors").read_bytes() == (
        tmp_path / "dcp-out" / "model.safetensors"
    ).read_bytes()


def readme_commands(*sections: str) -> list[str]:
    """The bash lines of the README's `sections`, their comments cut off, in order."""
    readme = (ROOT / "README.md").read_text()
    lines = []
    for section in sections:
        body = readme.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
        block = re.search(r"```bash\n(.*?)```", body, re.DOTALL).group(1)
        lines += [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
    return lines


@pytest.mark.slow  # 50 CPU-s: the tests above cover generate and export one by one
def test_the_readmes_train_generate_and_export_run_as_written(tmp_path):
    """The README's text, prepared, the GPT trained on it (shorter: 30 steps), then its generate
    and export lines as written, then the loading code docs/runs.md shows."""
    shutil.copytree(ROOT / "data", tmp_path / "data")
    lines = readme_commands("Train on text", "Generate and export")
    assert [line.split()[:3] for line in lines] == [
        ["python", "-m", f"{PACKAGE}.prepare"],
        ["make", "train-cpu", 'ARGS="experiment=gpt_sample"'],
        ["python", "-m", f"{PACKAGE}.generate"],
        ["python", "-m", f"{PACKAGE}.generate"],
        ["python", "-m", f"{PACKAGE}.export"],
    ]  # fmt: skip
    env = {**users_env(), "OMP_NUM_THREADS": "1"}

    def shell(words: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(words, cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=240)  # fmt: skip

    done = shell([sys.executable, *shlex.split(lines[0])[1:]])  # python -m ...prepare
    assert done.returncode == 0, done.stderr
    words = make_line(lines[1], "trainer.max_steps=30")  # <project> train ...
    assert words[1] == "train" and words[-2:] == ["experiment=gpt_sample", "trainer.max_steps=30"]
    done = shell(launch_command(*words[2:]))
    assert done.returncode == 0, done.stderr[-3000:]
    for line in lines[2:]:
        done = shell([sys.executable, *shlex.split(line)[1:]])
        assert done.returncode == 0, f"{line}: {done.stderr}"
        if ".generate" in line:
            assert done.stdout.startswith("The ") and len(done.stdout) > len("The ") + 10
    assert (tmp_path / "exported" / "model.safetensors").is_file()
    page = (ROOT / "docs" / "runs.md").read_text()
    code = re.search(r"```python\n(.*?)```", page.split("## Generating and exporting")[1], re.S)
    namespace: dict = {}
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        exec(code.group(1), namespace)  # noqa: S102  (the page's own code)
    finally:
        os.chdir(cwd)
    assert isinstance(namespace["model"], Gpt)
    assert math.isfinite(float(logits(namespace["model"], torch.zeros(1, 4).long()).sum()))

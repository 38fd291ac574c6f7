"""torch.compile's watch on recompiles, on a CPU: dynamo with its "eager" backend compiles graphs
(and recompiles them) as on a GPU, without inductor's C++ compiler, which CI may lack."""

import logging
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf

# The options' builders, as train imports them.
import ddp_project.data  # noqa: F401
import ddp_project.model  # noqa: F401
from ddp_project.core.world import World
from ddp_project.run import compilation
from ddp_project.run.trainer import Trainer


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    monkeypatch.setattr(compilation, "compiles", lambda cfg, device: cfg.trainer.compile)
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", False)
    monkeypatch.setenv(compilation.CACHE_VAR, "")  # the Trainer sets it: undone after the test
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def batches_of(sizes: list[int], features: int, classes: int):
    for size in sizes:
        yield torch.randn(size, features), torch.randint(classes, (size,))


def test_a_recompile_after_the_first_step_is_named_with_its_cause(
    compose_train, tmp_path, compiled_on_cpu, caplog
):
    """Steps 1-4 keep one batch shape (their compile is the run's own: no line), steps 5-8 change
    it three times (one line at step 8, naming dynamo's cause), steps 9-12 go back to a shape
    compiled already (no line)."""
    cfg = OmegaConf.to_object(
        compose_train(
            "dist.backend=gloo",
            "trainer.compile=true",
            "trainer.max_steps=12",
            "trainer.log_every=4",
            "trainer.checkpoint_every=0",
        )
    )
    trainer = Trainer(cfg, World(), torch.device("cpu"), tmp_path / "run")
    sizes = [16] * 4 + [8, 12, 16, 10] + [16] * 4
    data = cfg.data
    trainer.batches = lambda: batches_of(sizes, data.num_features, data.num_classes)
    with caplog.at_level(logging.WARNING):
        assert trainer.train() is False
    warnings = [r.getMessage() for r in caplog.records if "torch.compile" in r.getMessage()]
    assert len(warnings) == 1, warnings
    first_words = "step 8: torch.compile compiled 6 new graph(s) since the first step"
    assert warnings[0].startswith(first_words)
    assert "size mismatch at index 0. expected" in warnings[0] and "actual 10)" in warnings[0]
    assert "keep the input shapes fixed" in warnings[0] and "trainer.compile=false" in warnings[0]


def test_steady_shapes_compile_once_and_say_nothing(
    compose_train, tmp_path, compiled_on_cpu, caplog
):
    cfg = OmegaConf.to_object(
        compose_train(
            "dist.backend=gloo",
            "trainer.compile=true",
            "trainer.max_steps=8",
            "trainer.log_every=2",
            "trainer.checkpoint_every=0",
        )
    )
    trainer = Trainer(cfg, World(), torch.device("cpu"), tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        assert trainer.train() is False
    assert trainer.recompiles.total == 0
    assert "torch.compile" not in caplog.text


def test_the_cause_named_is_the_new_one_when_only_one_of_two_compiled_codes_recompiles(
    compiled_on_cpu,
):
    """The model and the loss are two compiled codes: when only the first recompiles, the line
    names its new cause, not an older one of the other."""

    def model(x):
        return x * 2

    def loss(x):
        return x.sum()

    model, loss = torch.compile(model), torch.compile(loss)
    watch = compilation.Recompiles()
    model(torch.ones(2)), loss(torch.ones(2))
    watch.start()
    model(torch.ones(3)), loss(torch.ones(3))
    assert "expected 2, actual 3)" in watch.news()
    model(torch.ones(4)), loss(torch.ones(3))
    line = watch.news()
    assert "actual 4)" in line and watch.total == 3  # dynamo's cause of this recompile
    assert watch.news() is None


def test_a_torch_without_dynamos_counts_turns_the_watch_off_with_one_line(monkeypatch):
    def gone():
        raise ImportError("cannot import name 'counters'")

    monkeypatch.setattr(compilation, "_graphs", gone)
    watch = compilation.Recompiles()
    watch.start()
    line = watch.news()
    assert line.startswith("the watch on recompiles is off") and "cannot import name" in line
    assert watch.news() is None


def test_the_compile_caches_live_beside_the_run_dir_unless_the_user_chose_theirs(tmp_path):
    """A pod rescheduled to a fresh node, and the next run, find them on the runs' storage, not
    in the node's /tmp; inductor reads the variable itself, so it must be set, not returned."""
    env = {}
    cache = tmp_path / ".compile-cache"
    assert compilation.keep_caches_in(tmp_path / "2026-12-03_07-00-00_abc123", env) == cache
    assert env == {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
    theirs = {"TORCHINDUCTOR_CACHE_DIR": "/cache"}
    assert compilation.keep_caches_in(tmp_path, theirs) is None
    assert theirs == {"TORCHINDUCTOR_CACHE_DIR": "/cache"}


def test_inductor_reads_its_cache_dir_from_the_variable_as_keep_caches_in_sets_it(
    tmp_path, monkeypatch
):
    """The torch this runs on still takes the directory from TORCHINDUCTOR_CACHE_DIR at use."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    assert cache_dir() == str(tmp_path / "compile-cache")

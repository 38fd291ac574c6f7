"""torch.compile's watch on recompiles, on a CPU: dynamo with its "eager" backend compiles graphs
(and recompiles them) as on a GPU, without inductor's C++ compiler, which CI may lack."""

import json
import logging
import os
import subprocess
import textwrap
from collections import Counter
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import launch_command
from omegaconf import OmegaConf

# The options' builders, as train imports them.
import ddp_project.data  # noqa: F401
import ddp_project.model  # noqa: F401
from ddp_project.core import caches
from ddp_project.core.world import World
from ddp_project.model import Gpt, Mlp
from ddp_project.run import compilation, fsdp
from ddp_project.run.trainer import Trainer


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    monkeypatch.setattr(compilation, "compiles", lambda cfg, device: cfg.trainer.compile)
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="eager"))
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_shapes", False)
    monkeypatch.setenv(caches.CACHE_VAR, "")  # the Trainer sets it: undone after the test
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
    assert caches.keep_caches_in(tmp_path / "2026-12-03_07-00-00_abc123", env) == cache
    assert env == {caches.CACHE_VAR: str(cache)}
    theirs = {caches.CACHE_VAR: "/cache"}
    assert caches.keep_caches_in(tmp_path, theirs) == Path("/cache")
    assert theirs == {caches.CACHE_VAR: "/cache"}


def test_the_default_inductor_writes_itself_is_not_taken_for_the_user_s(tmp_path):
    """Inductor writes /tmp/torchinductor_<user> into the variable the first time anything asks
    it for its directory (importing dynamo does), and every process started after that inherits
    it: the launcher's workers, a bench's. That value is inductor's, whoever passed it on."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert caches.inductors_default() == default_cache_dir()  # the torch this runs on agrees
    inherited = {caches.CACHE_VAR: default_cache_dir()}
    run_dir = tmp_path / "outputs" / "run"
    assert caches.keep_caches_in(run_dir, inherited) == tmp_path / "outputs" / ".compile-cache"
    assert caches.users_choice({caches.CACHE_VAR: ""}) is None


def test_inductor_reads_its_cache_dir_from_the_variable_as_keep_caches_in_sets_it(
    tmp_path, monkeypatch
):
    """The torch this runs on still takes the directory from TORCHINDUCTOR_CACHE_DIR at use."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile-cache"))
    assert cache_dir() == str(tmp_path / "compile-cache")


# Installed as sitecustomize in the launch: each worker, at each optimizer step, records the
# directory inductor's own function names, as it would compile into at that moment.
RECORD_CACHE_DIR = textwrap.dedent(
    """
    import json, os
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def _record(optimizer, args, kwargs):
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        if "LOCAL_RANK" in os.environ:  # a worker, not the launcher
            path = os.path.join(os.environ["CACHE_DIR_RECORDS"], f"rank{os.environ['RANK']}.json")
            with open(path, "w") as out:
                json.dump(cache_dir(), out)

    register_optimizer_step_post_hook(_record)
    """
)


@pytest.mark.parametrize("users", [None, "mine"], ids=["beside the runs", "the user's"])
def test_every_worker_of_a_launch_compiles_into_the_cache_beside_its_runs(tmp_path, users):
    """Through the real launcher, 2 processes: what inductor would use in each worker is
    <runs>/.compile-cache, whatever the launcher's own checks made torch write first; or the
    directory the user set."""
    hook, records = tmp_path / "hook", tmp_path / "records"
    hook.mkdir()
    records.mkdir()
    (hook / "sitecustomize.py").write_text(RECORD_CACHE_DIR)
    env = {key: value for key, value in os.environ.items() if key != caches.CACHE_VAR}
    env |= {"PYTHONPATH": f"{hook}:{env.get('PYTHONPATH', '')}", "CACHE_DIR_RECORDS": str(records)}
    if users:
        env[caches.CACHE_VAR] = str(tmp_path / users)
    done = subprocess.run(
        launch_command(
            "--nproc-per-node",
            "2",
            "trainer.max_steps=2",
            "trainer.compile=true",
            "hydra.run.dir=runs/run",
        ),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads((records / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    expected = tmp_path / users if users else tmp_path / "runs" / ".compile-cache"
    assert seen == [str(expected)] * 2


def tiny_gpt(layers: int) -> Gpt:
    return Gpt(
        SimpleNamespace(n_layer=layers, n_head=2, d_model=16),
        SimpleNamespace(seq_len=8, vocab_size=32),
    )


def test_a_gpt_compiles_its_repeated_blocks_in_place_and_an_mlp_compiles_whole():
    """Regional compilation: each transformer block compiled in place (the same names, the
    same module objects), the embeddings and head around them eager; an MLP, whose layers
    are single Linears, in one graph."""
    gpt = tiny_gpt(3)
    names = list(gpt.state_dict())
    assert compilation.repeated_blocks(gpt) == list(gpt.blocks)
    forward = compilation.compiled_forward(gpt, gpt)
    assert forward is gpt and list(gpt.state_dict()) == names
    assert all(block._compiled_call_impl is not None for block in gpt.blocks)
    assert gpt._compiled_call_impl is None and gpt.head._compiled_call_impl is None
    mlp = Mlp(
        SimpleNamespace(hidden_dim=8, depth=2), SimpleNamespace(num_features=4, num_classes=3)
    )
    assert compilation.repeated_blocks(mlp) == []
    assert isinstance(
        compilation.compiled_forward(mlp, mlp), torch._dynamo.eval_frame.OptimizedModule
    )


@pytest.mark.parametrize("recompute", [False, True], ids=["", "activation checkpointing"])
def test_a_gpt_s_blocks_compile_into_one_graph_for_all_of_them(monkeypatch, recompute):
    """Dynamo compiles the block's code once and reuses it for every block of the same shapes,
    with each block's forward recomputed too (dist.activation_checkpointing): the cold compile
    of one block, not of the whole model (whose graph would hold the embeddings and the head),
    nor of each block (past 10, dynamo's recompile limit would leave the rest eager)."""
    graphs = []

    def recording(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend=recording))
    torch._dynamo.reset()
    torch.manual_seed(0)
    gpt = tiny_gpt(10)
    eager = tiny_gpt(10)
    eager.load_state_dict(gpt.state_dict())
    if recompute:
        fsdp.checkpoint_activations(gpt)
    gpt = compilation.compiled_forward(gpt, gpt)
    tokens = torch.randint(0, 32, (2, 8))
    assert torch.equal(gpt(tokens), eager(tokens))
    (graph,) = graphs
    ops = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert "<function embedding at" not in " ".join(ops)  # a block's graph, not the model's
    # the block's attention, or its forward wrapped whole in the recompute (a subgraph)
    expected = "checkpoint" if recompute else "scaled_dot_product_attention"
    assert any(expected in op for op in ops), ops
    torch._dynamo.reset()


def test_the_first_step_s_line_says_whether_the_cache_had_its_graphs(monkeypatch, tmp_path):
    """From inductor's counts since the run began: a sweep's jobs share a process."""
    from torch._dynamo.utils import counters

    def after(**counts):
        monkeypatch.setitem(counters, "inductor", Counter(counts))
        return compilation.cache_report(tmp_path, before)

    monkeypatch.setitem(counters, "inductor", Counter(fxgraph_cache_hit=2, fxgraph_cache_miss=5))
    before = compilation.cache_counts()  # an earlier job's
    assert after(fxgraph_cache_hit=5, fxgraph_cache_miss=5) == f"cache hit, {tmp_path}"
    assert after(fxgraph_cache_hit=2, fxgraph_cache_miss=8).startswith(
        f"cold: nothing cached for torch {torch.__version__} / CPU / this model; cached now in"
    )
    three = after(fxgraph_cache_hit=3, fxgraph_cache_miss=7)
    assert three == f"1 of 3 graphs from the cache, {tmp_path}"
    assert (
        after(fxgraph_cache_hit=2, fxgraph_cache_miss=5)
        == f"no graph compiled by inductor, {tmp_path}"
    )


def test_a_cache_folder_inductor_could_not_make_beside_the_runs_falls_back_to_the_run_dir(
    tmp_path,
):
    """A file where .compile-cache would go (or a runs folder of another user): inductor would
    fail at the first step. The run's own dir is writable: its relaunches still find it."""
    (tmp_path / "run").mkdir()
    (tmp_path / ".compile-cache").write_text("not a folder")
    env = {}
    assert caches.keep_caches_in(tmp_path / "run", env) == tmp_path / "run" / ".compile-cache"
    assert env[caches.CACHE_VAR] == str(tmp_path / "run" / ".compile-cache")
    assert not caches.writable(tmp_path / ".compile-cache")
    assert caches.writable(tmp_path / "new-folder")  # made by inductor when it first compiles

"""dist.strategy=fsdp2: the same loss curve (and EMA) as DDP for a seed, DCP checkpoints that
resume under either strategy and on another world size, activation checkpointing that keeps the
parameter names, and the combinations it refuses in one line. On CPU: gloo, 2 processes."""

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import launch, shared_folder, torchrun
from tolerance import max_abs_diff, reordered

from ddp_project.config.compose import config_problem
from ddp_project.config.schema import Precision
from ddp_project.model import Gpt, Mlp
from ddp_project.run import checkpoint, checkpoint_dcp, ddp, fsdp
from ddp_project.run.ema import EMA

# A tiny GPT: 2 blocks, 8 steps of 2 micro-batches, clipped; a DCP checkpoint every 4 steps.
TINY = (
    "model=gpt",
    "data=tokens",
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=32",
    "data.seq_len=16",
    "data.num_samples=512",
    "data.batch_size=4",
    "trainer.grad_accumulation=2",
    "trainer.max_grad_norm=0.1",  # below every step's norm (~0.4): each step clips
    "trainer.warmup_steps=2",
    "trainer.max_steps=8",
    "trainer.log_every=2",
    "trainer.val_every=4",
    "trainer.checkpoint_every=4",
    "trainer.checkpoint_format=dcp",
    "trainer.ema_decay=0.9",  # sharded as the weights under fsdp2, in the DCP folder either way
    "logger=csv",
)
LAST = "step_000000008.dcp"
# DDP averages each gradient with an all-reduce of whole buckets, FSDP2 with a reduce-scatter of
# shards, and its clipping norm sums the shards' squares in another order: the same sums, rounded
# differently. Each gradient adds a global batch's 256 tokens (4 x 16, 2 micro-batches, 2 ranks),
# 8 steps over.
APART = reordered(terms=4 * 16 * 2 * 2, steps=8)


def rows(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def curve(run_dir):
    keys = ("step", "loss", "grad_norm", "val_loss", "val_loss_ema")
    return [tuple(row[key] for key in keys) for row in rows(run_dir)]


def assert_same_curve(first, second, rel=APART):
    assert [row[0] for row in first] == [row[0] for row in second]
    for a, b in zip(first, second, strict=True):
        assert a[1:] == pytest.approx(b[1:], rel=rel, nan_ok=True), (a, b)


def final_model(run_dir, weights="model"):
    return checkpoint.read(run_dir / "checkpoints" / LAST)[weights]


def without_key_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights but the keys' bias. Attention's softmax does not change when every key moves by
    the same vector, so that bias's gradient is zero but for rounding, and AdamW, which divides
    a gradient by its own size, turns that rounding into steps of up to lr: DDP and FSDP2 round
    it differently, and its values are any within lr x steps of their start, by design."""
    width = tiny_options()[0].d_model
    kept = dict(state)
    for name, tensor in state.items():
        if name.endswith("qkv.bias"):
            kept[name] = torch.cat([tensor[:width], tensor[2 * width :]])
    return kept


@pytest.fixture(scope="module")
def runs(request):
    """The tiny GPT trained under ddp, and under fsdp2 with activation checkpointing."""
    folder = shared_folder(request)
    for strategy, recompute in (("ddp", "false"), ("fsdp2", "true")):
        done = torchrun(
            folder,
            *TINY,
            f"dist.strategy={strategy}",
            f"dist.activation_checkpointing={recompute}",
            f"hydra.run.dir={strategy}",
        )
        assert done.returncode == 0, done.stderr[-3000:]
    return folder


def test_fsdp2_follows_ddp_s_loss_curve_and_saves_the_same_plain_names(runs):
    ddp, fsdp2 = runs / "ddp", runs / "fsdp2"
    log = (fsdp2 / "train.log").read_text()
    assert "dist.strategy=fsdp2: 2 block(s) and the root sharded over 2 process(es)" in log
    assert "dist.activation_checkpointing: 2 block(s) recompute their forward" in log
    assert "sharded" not in (ddp / "train.log").read_text()
    assert len(rows(ddp)) == 4
    assert_same_curve(curve(fsdp2), curve(ddp))
    sharded, replicated = final_model(fsdp2), final_model(ddp)
    # the bare model's names (no FSDP or checkpoint-wrapper prefix), whole tensors
    assert sorted(sharded) == sorted(Gpt(*tiny_options()).state_dict())
    assert max_abs_diff(without_key_bias(sharded), without_key_bias(replicated)) <= APART
    # the EMA's shards, whole again, keyed as the model; the average of DDP's weights
    averaged = final_model(fsdp2, "ema")
    assert sorted(averaged) == sorted(sharded)
    ddp_average = final_model(ddp, "ema")
    assert max_abs_diff(without_key_bias(averaged), without_key_bias(ddp_average)) <= APART
    assert max_abs_diff(averaged, sharded) > 1e-3  # an average, not the weights again


@pytest.mark.parametrize(
    ("written_by", "resumed_as", "nproc"),
    [
        ("ddp", "fsdp2", 2),
        pytest.param("fsdp2", "ddp", 2, marks=pytest.mark.slow),  # the same load, the other way
        pytest.param("fsdp2", "fsdp2", 1, marks=pytest.mark.slow),
    ],
)
def test_a_dcp_checkpoint_resumes_under_the_other_strategy_on_the_same_curve(
    runs, tmp_path, written_by, resumed_as, nproc
):
    """From step 4 to 8; on 1 process (2 micro-batches more each, the same samples) but for
    the order of the sums, and its validation scores the held-out samples 2 ranks' shards
    left out."""
    run = tmp_path / "run"
    shutil.copytree(runs / written_by, run)
    for later in (LAST, "best.dcp"):
        shutil.rmtree(run / "checkpoints" / later)
    done = torchrun(
        tmp_path,
        *TINY,
        f"dist.strategy={resumed_as}",
        "hydra.run.dir=run",
        nproc=nproc,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from the checkpoint of step 4" in done.stdout
    resumed, uninterrupted = curve(run), curve(runs / "ddp")
    if nproc == 1:
        resumed, uninterrupted = [r[:3] for r in resumed], [r[:3] for r in uninterrupted]
    assert_same_curve(resumed, uninterrupted)
    for weights in ("model", "ema"):
        theirs, ours = final_model(run, weights), final_model(runs / "ddp", weights)
        assert max_abs_diff(without_key_bias(theirs), without_key_bias(ours)) <= APART


def test_a_file_checkpoint_is_refused_under_fsdp2_in_one_line(tmp_path):
    file_run = ("trainer.max_steps=2", "trainer.checkpoint_every=2")
    done = torchrun(tmp_path, *file_run, "hydra.run.dir=run", nproc=1)
    assert done.returncode == 0, done.stderr[-3000:]
    done = launch(
        tmp_path,
        "--nproc-per-node",
        "1",
        "trainer.max_steps=4",
        "trainer.checkpoint_format=dcp",
        "dist.strategy=fsdp2",
        "hydra.run.dir=run",
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.endswith(
        "config error: step_000000002.pt is a file checkpoint, which a model sharded by "
        "dist.strategy=fsdp2 does not load; resume it with dist.strategy=ddp "
        "trainer.checkpoint_format=dcp until it writes a .dcp folder, then switch\n"
    )


# --- in this process -----------------------------------------------------------------------


def tiny_options():
    model = SimpleNamespace(n_layer=2, n_head=2, d_model=32)
    return model, SimpleNamespace(seq_len=16, vocab_size=256)


def test_the_blocks_are_the_gpt_s_transformer_blocks_and_the_mlp_s_layers():
    gpt = Gpt(*tiny_options())
    assert fsdp.blocks(gpt) == list(gpt.blocks)
    mlp = Mlp(
        SimpleNamespace(hidden_dim=8, depth=2),
        SimpleNamespace(num_features=4, num_classes=3),
    )
    linear = [layer for layer in mlp if isinstance(layer, torch.nn.Linear)]
    assert fsdp.blocks(mlp) == linear


def test_activation_checkpointing_recomputes_each_block_and_keeps_names_and_gradients():
    torch.manual_seed(0)
    bare = Gpt(*tiny_options())
    recomputed = Gpt(*tiny_options())
    recomputed.load_state_dict(bare.state_dict())
    fsdp.checkpoint_activations(recomputed)
    assert list(recomputed.state_dict()) == list(bare.state_dict())
    calls = []
    recomputed.blocks[0].attention_norm.register_forward_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, 256, (2, 16))
    for model in (bare, recomputed):
        model(tokens).sum().backward()
    assert len(calls) == 2  # its forward, and again in the backward pass
    for (name, a), b in zip(bare.named_parameters(), recomputed.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name


REFUSED = [
    (
        "dist.strategy=fsdp2",
        "trainer.checkpoint_format=file: rank 0 alone cannot write a model that "
        "dist.strategy=fsdp2 shards over every rank; set trainer.checkpoint_format=dcp",
    ),
    (
        "dist.strategy=fsdp2 trainer.checkpoint_format=dcp trainer.precision=fp16",
        "trainer.precision=fp16: dist.strategy=fsdp2 trains in bf16 or fp32",
    ),
    (
        "dist.strategy=fsdp2 trainer.checkpoint_format=dcp dist.comm_hook=bf16",
        "dist.comm_hook=bf16: a DDP comm hook: dist.strategy=fsdp2 reduce-scatters",
    ),
    (
        "dist.strategy=fsdp2 trainer.checkpoint_format=dcp dist.time_comm=true",
        "dist.time_comm=true: times DDP's all-reduces, which dist.strategy=fsdp2",
    ),
    (
        "dist.strategy=zero3",
        "dist.strategy: Invalid value 'zero3', expected one of [ddp, fsdp2]",
    ),
    (
        "dist.activation_checkpointing=sometimes",
        "dist.activation_checkpointing: Value 'sometimes' is not a valid bool",
    ),
    ("dist.strategy=", "dist.strategy: Invalid value '', expected one of [ddp, fsdp2]"),
]


@pytest.mark.parametrize(("override", "message"), REFUSED, ids=[o for o, _ in REFUSED])
def test_each_refused_combination_is_one_line_naming_the_key(override, message):
    problem = config_problem(override.split())
    assert problem is not None and "\n" not in problem
    assert problem.startswith(message), problem


def test_fsdp2_with_dcp_and_the_ddp_only_tuning_keys_is_a_good_config():
    """bucket_cap_mb, gradient_as_bucket_view and static_graph are DDP's: fsdp2 ignores them.
    An EMA is kept sharded as the weights."""
    overrides = [
        "dist.strategy=fsdp2",
        "trainer.checkpoint_format=dcp",
        "trainer.ema_decay=0.99",
        "dist.activation_checkpointing=true",
        "dist.bucket_cap_mb=25",
        "dist.gradient_as_bucket_view=false",
        "hydra.run.dir=/tmp/x",
    ]
    assert config_problem(overrides) is None


@pytest.fixture
def group_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_each_block_is_sharded_and_only_the_last_micro_batch_reduces(group_of_one):
    torch.manual_seed(0)
    model = Gpt(*tiny_options())
    names = list(model.state_dict())
    fsdp.shard(model, torch.device("cpu"), Precision.bf16)
    assert fsdp.sharded(model) and all(fsdp.sharded(b) for b in model.blocks)
    tokens = torch.randint(0, 256, (2, 16))
    with ddp.no_sync(model):  # a micro-batch before the last: gradients kept unsharded
        model(tokens).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    model(tokens).sum().backward()  # the last: reduce-scattered into each shard
    assert all(p.grad is not None for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    saved = checkpoint_dcp.tensors(model, optimizer)["model"]
    assert list(saved) == names  # the bare model's names
    assert checkpoint.all_finite(model)


def test_the_ema_swapped_in_reaches_every_block_and_the_root_and_goes_back(group_of_one):
    """FSDP2 keeps the root's gathered weights after a forward: the EMA's validation must not
    score them (embeddings and head of the weights, blocks of the average), nor the next step
    train on the average's."""
    torch.manual_seed(0)
    model = Gpt(*tiny_options())
    fsdp.shard(model, torch.device("cpu"), Precision.fp32)
    ema = EMA(model, 0.5)
    with torch.no_grad():
        for average in ema.averages:
            average.mul_(0.5)  # an average unlike the weights everywhere
    reference = Gpt(*tiny_options())
    reference.load_state_dict({k: fsdp.whole(v) for k, v in ema.state_dict().items()})
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        before = model(tokens)  # the root's weights stay gathered after it
        with ema.swapped_in():
            averaged = model(tokens)
        after = model(tokens)
    assert torch.allclose(averaged, reference(tokens).detach(), atol=1e-6)
    assert torch.equal(after, before)


def test_the_precision_policy_is_bf16_weights_and_fp32_reductions_on_a_gpu_only():
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    policy = fsdp.precision_policy(gpu, Precision.bf16)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    for device, precision in ((cpu, Precision.bf16), (gpu, Precision.fp32)):
        policy = fsdp.precision_policy(device, precision)
        assert (policy.param_dtype, policy.reduce_dtype) == (None, None)

"""MFU's arithmetic: the models' FLOPs per token, the GPUs' peaks, and what is left empty."""

from types import SimpleNamespace

import pytest

from ddp_project.model import Gpt, Mlp
from ddp_project.record.perf import mfu, peak_flops


def test_a_gpts_flops_per_token_are_nanogpts_count():
    """6 per parameter outside the embeddings (each block's 12 d^2 + 13 d: attention's in and out
    projections, the MLP and two layer norms; the final norm's 2 d; the untied head, d x
    vocabulary) and attention's 12 x layers x width x context."""
    layers, width, vocabulary, context = 2, 32, 100, 16
    model = Gpt(
        SimpleNamespace(n_layer=layers, n_head=4, d_model=width),
        SimpleNamespace(seq_len=context, vocab_size=vocabulary),
    )
    parameters = layers * (12 * width**2 + 13 * width) + 2 * width + width * vocabulary
    assert model.flops_per_token() == 6 * parameters + 12 * layers * width * context
    assert model.tokens_per_sample == context


def test_an_mlps_flops_per_sample_count_every_parameter():
    model = Mlp(
        SimpleNamespace(hidden_dim=8, depth=2), SimpleNamespace(num_features=4, num_classes=3)
    )
    assert model.flops_per_token() == 6 * ((4 * 8 + 8) + (8 * 8 + 8) + (8 * 3 + 3))
    assert model.tokens_per_sample == 1
    assert list(model.state_dict())[0] == "0.weight"  # the checkpoints of nn.Sequential's days load


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H200", 989.4),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA L40S", 362.0),
    ],
)
def test_the_peak_of_a_listed_gpu_is_its_dense_bf16_figure(name, tflops):
    assert peak_flops(name) == tflops * 1e12


@pytest.mark.parametrize(
    "name",
    [
        None,
        "",
        "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
        "NVIDIA GeForce RTX 4090",
        "NVIDIA H200 XYZ",
        "AMD Instinct MI300X",
    ],
)
def test_a_gpu_the_table_cannot_tell_leaves_mfu_empty_not_wrong(name):
    assert peak_flops(name) is None
    assert mfu(1000.0, 1e9, 1, peak_flops(name)) is None


def test_mfu_is_the_share_of_every_gpus_peak():
    assert mfu(1000.0, 1e9, 2, 1e12) == pytest.approx(0.5)  # 1e12 FLOPS over two GPUs of 1e12
    assert mfu(1000.0, None, 2, 1e12) is None  # a model of your own without flops_per_token()
    # gpt2_small's count (about 0.86 GFLOPs per token) at 120k tokens/s: about 0.10 of an H200
    gpt2 = 6 * 123.7e6 + 12 * 12 * 768 * 1024
    assert mfu(120_000.0, gpt2, 1, peak_flops("NVIDIA H200")) == pytest.approx(
        120_000 * gpt2 / 989.4e12
    )

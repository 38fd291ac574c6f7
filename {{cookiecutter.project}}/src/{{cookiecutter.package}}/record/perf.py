"""How much of the GPU a run uses: model FLOPs utilisation (MFU), as nanoGPT and PaLM count it.

MFU = tokens/s x FLOPs per token / (peak FLOPS x GPUs). A model gives its FLOPs per token
(flops_per_token(), model.py): 6 per parameter that takes part in a matmul (forward 2, backward 4),
plus attention's own 12 x layers x width x context. The peak is the GPU's dense bf16 figure from
its maker's datasheet; a GPU this table cannot tell apart from its variants (a MIG slice, an
unlisted board) gets none, so its MFU stays empty rather than wrong.
"""

import re

# (the CUDA device name, as torch.cuda.get_device_name() gives it; dense bf16 TFLOPS)
PEAK_BF16_TFLOPS = [
    (r"NVIDIA A100[- ](SXM4|PCIE|PCIe)?[- ]?(40|80)GB( PCIe)?", 312.0),
    (r"NVIDIA H100 80GB HBM3", 989.4),  # SXM5
    (r"NVIDIA H100 PCIe", 756.0),
    (r"NVIDIA H100 NVL", 835.5),
    (r"NVIDIA H200", 989.4),  # SXM
    (r"NVIDIA H200 NVL", 835.5),
    (r"NVIDIA GH200 (480|144)GB HBM3e?", 989.4),
    (r"NVIDIA B200", 2250.0),
    (r"NVIDIA L40S", 362.0),
    (r"NVIDIA L4", 121.0),
]


def peak_flops(device_name: str | None) -> float | None:
    """Dense bf16 FLOPS of one GPU of this name; None for a CPU, a MIG slice (a share of the GPU
    that its name alone does not tell), or a GPU not in the table."""
    if not device_name or "MIG" in device_name:
        return None
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.fullmatch(pattern, device_name.strip()):
            return tflops * 1e12
    return None


def mfu(
    tokens_per_s: float, flops_per_token: float | None, gpus: int, peak: float | None
) -> float | None:
    """The share of `gpus` GPUs' peak that `tokens_per_s` (over all of them) reaches; None where
    the peak or the model's FLOPs per token are unknown."""
    if peak is None or flops_per_token is None or gpus < 1:
        return None
    return tokens_per_s * flops_per_token / (peak * gpus)

"""The GPT block before and after issue 22, one GPU, interleaved in one process: the generated
project's Gpt (F.scaled_dot_product_attention with is_causal=True) against the
nn.TransformerEncoder model it replaced (which passed a float mask and is_causal=True), each
eager and compiled, at gpt2_small's shape. A training step as the trainer takes it: bf16
autocast, cross-entropy, fused AdamW. ROUNDS rounds of STEPS timed steps per variant, in turn.

    PYTHONPATH=<the installed project> python benchmarks/attention/compare.py   # prints a table, RESULT lines
"""

import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from ddp_project.model import Gpt
from ddp_project.perf import mfu, peak_flops
from torch import nn

LAYERS, HEADS, WIDTH, CONTEXT, VOCABULARY = 12, 12, 768, 1024, 50304
BATCH = int(os.environ.get("BATCH", 8))
ROUNDS, STEPS = int(os.environ.get("ROUNDS", 5)), int(os.environ.get("STEPS", 20))


class EncoderGpt(nn.Module):
    """The model before issue 22, as it was in model.py."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCABULARY, WIDTH)
        self.positions = nn.Embedding(CONTEXT, WIDTH)
        block = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)  # fmt: skip
        self.blocks = nn.TransformerEncoder(block, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCABULARY, bias=False)
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(CONTEXT), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.tokens(tokens) + self.positions.weight[:length]
        return self.head(self.blocks(hidden, mask=self.causal_mask[:length, :length], is_causal=True))


def stepper(model: nn.Module, compiled: bool):
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    tokens = torch.randint(VOCABULARY, (BATCH, CONTEXT + 1), device="cuda")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    torch.manual_seed(0)
    new = Gpt(SimpleNamespace(n_layer=LAYERS, n_head=HEADS, d_model=WIDTH),
              SimpleNamespace(seq_len=CONTEXT, vocab_size=VOCABULARY)).cuda()  # fmt: skip
    flops = new.flops_per_token()
    variants = {
        "encoder eager": stepper(EncoderGpt().cuda(), False),
        "sdpa eager": stepper(new, False),
        "encoder compiled": stepper(EncoderGpt().cuda(), True),
        "sdpa compiled": stepper(Gpt(SimpleNamespace(n_layer=LAYERS, n_head=HEADS, d_model=WIDTH),
                                     SimpleNamespace(seq_len=CONTEXT, vocab_size=VOCABULARY)).cuda(), True),
    }  # fmt: skip
    for name, step in variants.items():  # warm-up and compilation, untimed
        started = time.perf_counter()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        print(f"warm-up {name}: {time.perf_counter() - started:.1f} s", flush=True)
    times = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, step in variants.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - started) / STEPS * 1e3)
    peak = peak_flops(torch.cuda.get_device_name())
    print(f"{torch.cuda.get_device_name()}, batch {BATCH} x {CONTEXT}, {ROUNDS} rounds of {STEPS} steps")
    print("variant            ms/step median (min-max)   MFU    / sdpa of the same mode")
    for name, ms in times.items():
        median = statistics.median(ms)
        same = statistics.median(times["sdpa " + name.split()[1]])
        share = mfu(BATCH * CONTEXT / (median / 1e3), flops, 1, peak)
        print(
            f"{name:18} {median:7.2f} ({min(ms):.2f}-{max(ms):.2f})   {share or float('nan'):.3f}   {median / same:.3f}"
        )
        print(f"RESULT {name} median_ms={median:.3f} min_ms={min(ms):.3f} max_ms={max(ms):.3f} mfu={share}")


if __name__ == "__main__":
    main()

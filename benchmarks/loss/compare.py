"""Where gpt2_small's loss is computed, one GPU, interleaved in one process: the generated
project's Gpt compiled, with the cross-entropy over its 50304-way logits
  - "eager loss": outside the compiled model, under autocast (fp32 logits in memory), as the
    trainer did until issue 22;
  - "loss apart": a compiled cross-entropy of its own (the softmax read from the bf16 logits);
  - "one graph": model and loss compiled together, the logits returned for the accuracy;
  - "one graph, count": the same, the correct predictions counted in the graph, no logits out;
and "one graph" at a batch of 64. A training step as the trainer takes it: bf16 autocast, fused
AdamW. ROUNDS rounds of STEPS timed steps per variant, in turn; MFU by the project's perf.py.

    PYTHONPATH=<the installed project> python benchmarks/loss/compare.py   # a table, RESULT lines
"""

import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from ddp_project.model import Gpt
from ddp_project.perf import mfu, peak_flops

LAYERS, HEADS, WIDTH, CONTEXT, VOCABULARY = 12, 12, 768, 1024, 50304
ROUNDS, STEPS = int(os.environ.get("ROUNDS", 5)), int(os.environ.get("STEPS", 10))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten())


def stepper(where: str, batch: int):
    torch.manual_seed(0)
    model = Gpt(SimpleNamespace(n_layer=LAYERS, n_head=HEADS, d_model=WIDTH),
                SimpleNamespace(seq_len=CONTEXT, vocab_size=VOCABULARY)).cuda()  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    tokens = torch.randint(VOCABULARY, (batch, CONTEXT + 1), device="cuda")
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    forward = torch.compile(model)
    loss_apart = torch.compile(cross_entropy)

    def with_logits(inputs, labels):
        logits = model(inputs)
        return cross_entropy(logits, labels), logits

    def with_count(inputs, labels):
        logits = model(inputs)
        return cross_entropy(logits, labels), (logits.argmax(-1) == labels).sum()

    one_graph, counted = torch.compile(with_logits), torch.compile(with_count)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if where == "eager loss":
                loss = cross_entropy(forward(inputs), labels)
            elif where == "loss apart":
                loss = loss_apart(forward(inputs), labels)
            elif where == "one graph, count":
                loss, _ = counted(inputs, labels)
            else:
                loss, _ = one_graph(inputs, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, model.flops_per_token()


def main() -> None:
    plan = {"eager loss": 32, "loss apart": 32, "one graph": 32, "one graph, count": 32,
            "one graph, batch 64": 64}  # fmt: skip
    variants, memory = {}, {}
    for name, batch in plan.items():  # warm-up and compilation, untimed
        started = time.perf_counter()
        torch.cuda.reset_peak_memory_stats()
        step, flops = stepper(name.split(", batch")[0], batch)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        memory[name] = torch.cuda.max_memory_allocated() / 2**30
        variants[name] = step
        print(f"warm-up {name}: {time.perf_counter() - started:.1f} s, peak {memory[name]:.1f} GiB", flush=True)
    times = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, step in variants.items():
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(STEPS):
                step()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - started) / STEPS * 1e3)
    name = torch.cuda.get_device_name()
    peak = peak_flops(name)
    print(f"{name}, context {CONTEXT}, {ROUNDS} rounds of {STEPS} steps, torch {torch.__version__}")
    print("variant               batch  ms/step median (min-max)   MFU median (min-max)   peak GiB")
    for name, ms in times.items():
        batch = plan[name]
        shares = sorted(mfu(batch * CONTEXT / (m / 1e3), flops, 1, peak) or float("nan") for m in ms)
        median = statistics.median(ms)
        print(f"{name:21} {batch:5}  {median:7.2f} ({min(ms):.2f}-{max(ms):.2f})      "
              f"{statistics.median(shares):.3f} ({shares[0]:.3f}-{shares[-1]:.3f})   {memory[name]:6.1f}")  # fmt: skip
        print(f"RESULT {name} batch={batch} median_ms={median:.3f} min_ms={min(ms):.3f} max_ms={max(ms):.3f} "
              f"mfu={statistics.median(shares):.4f} peak_gib={memory[name]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

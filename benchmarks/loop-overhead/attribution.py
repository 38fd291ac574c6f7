"""Where the old training loop's extra 2-GPU time went (issue 13).

A hand-written DDP loop on the 134M-parameter MLP (8 x Linear 4096 + GELU, bf16 autocast, batch
256 per GPU, fused AdamW, 100 MB buckets, gradient views, data on the GPU), and the same loop with
the old template loop's per-step extras added one at a time. Every variant runs once per pair, in
a rotating order, all in one launch; each figure is a variant's step time over the plain loop's in
the same pair (median and range over the pairs).

    PAIRS=5 torchrun --standalone --nproc-per-node 2 benchmarks/loop-overhead/attribution.py

The extras, as the loop before issue 13 had them:
  python_hook  dist.time_comm=true: every bucket's all-reduce through a Python comm hook, and the
               last step of each log window timed with CUDA events and a synchronize
  gloo_flag    the SIGTERM flag all-reduced on a gloo group after every step (wait, read, restart)
  window       per step: loss x batch, argmax == labels summed, sample count (kernels on the GPU)
  log_io       per log window (25 steps): all-reduce of the sums, .tolist(), a CSV, a JSONL and six
               TensorBoard scalars written and flushed
  old_loop     all four
"""

import csv
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

VARIANTS = {
    "plain": set(),
    "python_hook": {"python_hook"},
    "gloo_flag": {"gloo_flag"},
    "window": {"window"},
    "log_io": {"log_io"},
    "old_loop": {"python_hook", "gloo_flag", "window", "log_io"},
}
LOG_EVERY = 25


def mlp() -> nn.Sequential:
    layers = []
    for _ in range(8):
        layers += [nn.Linear(4096, 4096), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(4096, 8))


class TimedHook:
    """The old metrics.CommTimer: a Python hook around DDP's all-reduce; armed steps note CUDA
    events per bucket and synchronize at the end."""

    def __init__(self) -> None:
        self.armed, self.marks = False, []

    def hook(self, state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if not self.armed:
            return default_hooks.allreduce_hook(state, bucket)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        future = default_hooks.allreduce_hook(state, bucket)

        def finished(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.marks.append((start, end))
            return done.value()

        return future.then(finished)

    def share(self) -> None:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        self.armed, self.marks = False, []


def run(features: set[str], control: dist.ProcessGroup, scratch: Path, steps: int) -> float:
    """Median step time (ms) over log windows after the first."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DDP(mlp(), device_ids=[torch.cuda.current_device()], bucket_cap_mb=100,
                    gradient_as_bucket_view=True)  # fmt: skip
        inputs, labels = torch.randn(256, 4096), torch.randint(8, (256,))
        window = torch.zeros(3)
    timer = TimedHook() if "python_hook" in features else None
    if timer:
        model.register_comm_hook(None, timer.hook)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    flag, pending = torch.zeros(1, dtype=torch.int32), None
    writer = rows = None
    if "log_io" in features and dist.get_rank() == 0:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(scratch / "tb"))
        rows = csv.writer((scratch / "metrics.csv").open("w", newline=""))
    times = []
    torch.cuda.synchronize()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        if timer and step % LOG_EVERY == 0:
            timer.armed = True
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inputs)
            loss = F.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if "window" in features:
            window[0] += loss.detach().float() * len(labels)
            window[1] += (logits.argmax(dim=1) == labels).sum()
            window[2] += len(labels)
        if "gloo_flag" in features:
            if pending is not None:
                pending.wait()
                bool(flag.item())
            flag = torch.tensor([0], dtype=torch.int32)
            pending = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control, async_op=True)
        if step % LOG_EVERY == 0:
            if timer:
                timer.share()
            if "log_io" in features:
                dist.all_reduce(window)
                values = window.tolist()
                if writer:
                    row = {"step": step, "loss": values[0], "accuracy": values[1], "lr": 3e-4,
                           "samples_per_s": 1.0, "step_time_ms": 1.0, "comm_share": 0.1}  # fmt: skip
                    with (scratch / "metrics.jsonl").open("a") as out:
                        out.write(json.dumps(row) + "\n")
                    rows.writerow(row.values())
                    for key in ("loss", "accuracy", "lr", "samples_per_s", "step_time_ms", "comm_share"):
                        writer.add_scalar(key, row[key], global_step=step)
                    writer.flush()
                window.zero_()
            torch.cuda.synchronize()
            now = time.perf_counter()
            times.append((now - started) / LOG_EVERY * 1e3)
            started = now
    if pending is not None:
        pending.wait()
    if writer:
        writer.close()
    return statistics.median(times[1:])


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    control = dist.new_group(backend="gloo")
    pairs, steps = int(os.environ.get("PAIRS", 5)), int(os.environ.get("STEPS", 125))
    names = list(VARIANTS)
    results = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as scratch:
        for pair in range(pairs):
            order = names[pair % len(names) :] + names[: pair % len(names)]  # rotate
            for name in order:
                directory = Path(scratch) / f"{name}-{pair}"
                directory.mkdir()
                results[name].append(run(VARIANTS[name], control, directory, steps))
                dist.barrier()
    if dist.get_rank() == 0:
        for name in names:
            ratios = [t / p for t, p in zip(results[name], results["plain"], strict=True)]
            print("RESULT", json.dumps({
                "variant": name, "step_ms": round(statistics.median(results[name]), 3),
                "over_plain": round(statistics.median(ratios), 3),
                "min": round(min(ratios), 3), "max": round(max(ratios), 3),
            }), flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Where the template's step differs from the bench's hand-written one on one GPU (issue 22): both
loops of `bench` under torch.profiler, in one process, over the same timed steps. Per loop: wall
ms per step, GPU kernel ms per step (the rest of the wall time is the GPU waiting for the host),
kernels per step, and the kernels one loop launches that the other does not.

    torchrun --standalone --nproc-per-node 1 benchmarks/loop-overhead/trace_steps.py experiment=mlp_134m
"""

import collections
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from ddp_project import bench, check, process_group, train
from ddp_project.config import uses_cuda
from ddp_project.trainer import Trainer
from ddp_project.world import World
from torch.profiler import ProfilerActivity, profile

WARMUP, STEPS = 25, 50  # whole windows of the default trainer.log_every (25)


def kernels(prof) -> collections.Counter:
    totals = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:70]] += event.device_time_total  # us
    return totals


def profiled(run, steps: int) -> tuple[float, collections.Counter, int]:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - started) / steps * 1e3
    launched = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return wall, kernels(prof), launched


def main() -> None:
    overrides = sys.argv[1:]
    world = World.from_env()
    cfg = check.compose_and_check(overrides)
    scratch = Path(tempfile.mkdtemp())
    train.apply_nccl_env(cfg, world, scratch)
    device = process_group.select_device(uses_cuda(cfg.dist.backend), world)
    with process_group.initialized(world, device, timeout_s=cfg.dist.timeout_s):
        control = process_group.control_group(world, cfg.dist.checkpoint_timeout_s)
        results = {}
        batches = bench.first_batches(cfg, cfg.trainer.grad_accumulation, device)
        for round_ in range(2):
            bench.reference_ms(cfg, world, device, batches, 10, 10)  # warm
            results["reference"] = profiled(lambda: bench.reference_ms(cfg, world, device, batches, 0, STEPS), STEPS)
            timed = replace(cfg.trainer, max_steps=WARMUP + STEPS, checkpoint_every=0, val_every=0)
            (scratch / f"t{round_}").mkdir()
            trainer = Trainer(replace(cfg, trainer=timed), world, device, scratch / f"t{round_}", control)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                started = time.perf_counter()
                trainer.train()
                torch.cuda.synchronize()
                wall = (time.perf_counter() - started) / (WARMUP + STEPS) * 1e3
            launched = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
            results["template"] = (wall, kernels(prof), launched)
            for name, (wall, totals, launched) in results.items():
                n = STEPS if name == "reference" else WARMUP + STEPS
                gpu = sum(totals.values()) / n / 1e3
                print(f"round {round_} {name:10} wall {wall:.3f} ms/step  GPU kernels {gpu:.3f} ms/step  "
                      f"{launched / n:.1f} kernels/step")  # fmt: skip
            ref, tem = results["reference"][1], results["template"][1]
            only = {k: v / (WARMUP + STEPS) for k, v in tem.items() if k not in ref}
            print("  template-only kernels (us/step):", sorted(only.items(), key=lambda kv: -kv[1])[:8])
            per = {k: tem[k] / (WARMUP + STEPS) - ref[k] / STEPS for k in ref if k in tem}
            print("  largest per-step differences (us):", sorted(per.items(), key=lambda kv: -abs(kv[1]))[:6])


if __name__ == "__main__":
    main()

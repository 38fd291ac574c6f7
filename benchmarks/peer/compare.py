"""The template against what its users would otherwise write: a hand-written DDP loop and
PyTorch Lightning's Trainer, with the same model, data, optimizer and bf16 autocast, interleaved
in one launch over every GPU it is given. Lightning runs twice: as a user typically sets it up
(progress bar, self.log of the loss every step, its default logger) and lean (no bar, no
logging, no checkpointing). Where the template compiles the model (experiment=gpt2_small), the
other loops compile it too: Lightning's module around the compiled model, its loss eager, as its
docs show; the hand-written loop is the project's bench reference (bench.reference_ms).

Lightning is a dependency of this script only (scripts/fetch-gpu-wheels.sh carries it):
    torchrun --standalone --nproc-per-node 1 benchmarks/peer/compare.py experiment=mlp_134m
    torchrun --standalone --nproc-per-node 2 benchmarks/peer/compare.py experiment=gpt2_small
PAIRS rounds (default 3), each loop once per round in a rotating order; each loop trains WARMUP
(default 25) + STEPS (default 50) steps, rounded up to whole log windows (trainer.log_every), and
is timed over those windows after the warm-up.
Every figure is a ratio to the template in the same round: median (min-max) over the rounds.
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_project import bench, check, compilation, perf, process_group, train
from ddp_project.config import uses_cuda
from ddp_project.model import build_model
from ddp_project.trainer import AUTOCAST
from ddp_project.world import World

PAIRS, WARMUP, STEPS = (int(os.environ.get(k, d)) for k, d in (("PAIRS", 3), ("WARMUP", 25), ("STEPS", 50)))


class Module(pl.LightningModule):
    """A LightningModule as its docs write one: the loss in training_step, AdamW in
    configure_optimizers; `typical` logs the loss every step to the progress bar and logger."""

    def __init__(self, model: torch.nn.Module, cfg, typical: bool) -> None:
        super().__init__()
        self.model, self.cfg, self.typical = model, cfg, typical
        compiled = compilation.compiles(cfg, next(model.parameters()).device)
        self.forward_model = torch.compile(model) if compiled else model

    def training_step(self, batch, index):
        inputs, labels = batch
        loss = F.cross_entropy(self.forward_model(inputs).flatten(0, -2), labels.flatten())
        if self.typical:
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        optimizer = self.cfg.optimizer
        return torch.optim.AdamW(self.parameters(), lr=self.cfg.trainer.lr, weight_decay=optimizer.weight_decay,
                                 fused=optimizer.fused and torch.cuda.is_available())  # fmt: skip


class Windows(pl.Callback):
    """Step time over windows of `window` steps after the warm-up, synchronised at their ends."""

    def __init__(self, warmup: int, window: int) -> None:
        self.warmup, self.window = warmup, window
        self.marks: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, index) -> None:
        step = trainer.global_step
        if step >= self.warmup and (step - self.warmup) % self.window == 0:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.marks.append(time.perf_counter())

    def median_ms(self) -> float:
        spans = zip(self.marks, self.marks[1:], strict=False)
        return statistics.median((b - a) / self.window * 1e3 for a, b in spans)


class FixedBatches(torch.utils.data.IterableDataset):
    """The same batches as the hand-written loop's: on the device, cut once."""

    def __init__(self, batch) -> None:
        self.batch = batch

    def __iter__(self):
        while True:
            yield self.batch


def lightning_ms(cfg, world: World, device: torch.device, typical: bool, scratch: Path, warmup: int,
                 steps: int) -> float:  # fmt: skip
    torch.manual_seed(cfg.trainer.seed)
    with device:
        model = build_model(cfg.model, cfg.data)
    windows = Windows(warmup, cfg.trainer.log_every)
    trainer = pl.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=world.local_size,
        num_nodes=world.size // world.local_size,
        strategy="ddp" if world.size > 1 else "auto", precision="bf16-mixed",
        max_steps=warmup + steps, limit_val_batches=0, num_sanity_val_steps=0,
        enable_checkpointing=False, enable_model_summary=False, callbacks=[windows],
        enable_progress_bar=typical and world.main, logger=typical, default_root_dir=scratch,
    )  # fmt: skip
    data = torch.utils.data.DataLoader(FixedBatches(bench.first_batches(cfg, 1, device)[0]), batch_size=None)
    trainer.fit(Module(model, cfg, typical), data)
    return windows.median_ms()


def main() -> None:
    overrides = sys.argv[1:]
    world = World.from_env()
    cfg = bench.timed(check.compose_and_check(overrides))  # every loop timed over the same windows
    assert cfg.trainer.precision in AUTOCAST, "Lightning runs bf16-mixed here"
    window = cfg.trainer.log_every
    warmup, steps = bench.whole_windows(WARMUP, window), bench.whole_windows(STEPS, window)
    with tempfile.TemporaryDirectory(prefix="peer-") as tmp:
        scratch = Path(tmp)
        train.apply_nccl_env(cfg, world, scratch)
        device = process_group.select_device(uses_cuda(cfg.dist.backend), world)
        with process_group.initialized(world, device, timeout_s=cfg.dist.timeout_s):
            control = process_group.control_group(world, cfg.dist.checkpoint_timeout_s)
            batches = bench.first_batches(cfg, cfg.trainer.grad_accumulation, device)
            loops = ["template", "hand-written", "Lightning typical", "Lightning lean"]
            times: dict[str, list[float]] = {loop: [] for loop in loops}
            for pair in range(PAIRS):
                for loop in loops[pair % 4 :] + loops[: pair % 4]:
                    run_dir = scratch / f"{loop.replace(' ', '-')}-{pair}"
                    if loop == "template":
                        ms = bench.template_ms(cfg, world, device, control, run_dir, warmup, steps)
                    elif loop == "hand-written":
                        ms = bench.reference_ms(cfg, world, device, batches, warmup, steps)
                    else:
                        ms = lightning_ms(cfg, world, device, loop == "Lightning typical", run_dir, warmup, steps)
                    times[loop].append(ms)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    dist.barrier(group=control)
                    if world.main:
                        print(f"pair {pair} {loop}: {ms:.2f} ms/step", flush=True)
            if world.main:
                with torch.device("meta"):
                    model = build_model(cfg.model, cfg.data)
                tokens = cfg.data.batch_size * getattr(model, "tokens_per_sample", 1)
                name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
                peak = perf.peak_flops(name) if device.type == "cuda" else None
                print(f"{name} x {world.size}, torch {torch.__version__}, Lightning {pl.__version__}; "
                      f"{' '.join(overrides)}; {PAIRS} rounds of {steps} steps after {warmup}")  # fmt: skip
                print(f"{'loop':20} {'ms/step median (min-max)':>28} {'/ template':>22} {'MFU':>7}")
                for loop, ms in times.items():
                    ratio = [m / t for m, t in zip(ms, times["template"], strict=True)]
                    median = statistics.median(ms)
                    share = perf.mfu(tokens / (median / 1e3), model.flops_per_token(), 1, peak) or 0.0
                    print(f"{loop:20} {median:9.2f} ({min(ms):.2f}-{max(ms):.2f})      "
                          f"{statistics.median(ratio):.3f} ({min(ratio):.3f}-{max(ratio):.3f})   "
                          f"{share:.3f}")  # fmt: skip
                    print(f"RESULT {loop} gpus={world.size} {' '.join(overrides)} "
                          f"median_ms={statistics.median(ms):.3f} ratio={statistics.median(ratio):.4f} "
                          f"ratio_min={min(ratio):.4f} ratio_max={max(ratio):.4f} mfu={share}")  # fmt: skip
            process_group.finish_together()


if __name__ == "__main__":
    main()

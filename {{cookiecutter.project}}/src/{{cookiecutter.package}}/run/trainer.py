"""The training loop: build, resume, step, log, stop. train.py runs it in every process.

An optimizer step runs trainer.grad_accumulation micro-batches (the nested loop in step()): DDP
all-reduces (FSDP2 reduce-scatters) the gradients during the last one's backward, the others run
under no_sync. Nothing
in a step waits for the GPU; the loss stays on the device until a log window ends.
"""

from __future__ import annotations

import gc
import logging
import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from ..config.global_batch import GlobalBatch, GlobalBatchChanged, accepted, on_resume
from ..config.optimizer import upgraded
from ..config.registry import builder_of, chosen
from ..config.schema import CheckpointFormat, OnNonFinite, Precision, Schedule, TrainConfig
from ..core import caches
from ..core.world import World, launched_at
from ..nccl import process_group
from ..nccl.failfast import NO_WATCHDOG, Heartbeat
from ..record import metrics, perf
from ..record.startup import Timeline
from . import compilation, ddp, fsdp, optimizer, profiling, schedule, scoring
from .batches import build_loader, epoch_batches
from .checkpoint import Checkpointer, CheckpointFailed, Diverged, Incompatible, Progress
from .ema import EMA
from .patience import EarlyStopping
from .stopping import Preemption

log = logging.getLogger(__name__)
AUTOCAST = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}
Batch = tuple[torch.Tensor, torch.Tensor]
UNVALIDATED = dict.fromkeys(("val_loss", "val_accuracy", "val_time_s", "val_loss_ema"))
LOST = ("start-up", "first step", "checkpoints", "validation")  # goodput's account, by cause


def autocast_for(device: torch.device, precision: Precision) -> partial[torch.autocast]:
    """trainer.precision's autocast, on a GPU only; training and scoring both run under it."""
    dtype = AUTOCAST.get(precision) if device.type == "cuda" else None
    return partial(torch.autocast, device.type, dtype=dtype, enabled=dtype is not None)


def freeze_start_up_objects(device: torch.device) -> bool:
    """On a GPU, collect Python's garbage once and freeze what survives: True if it did.

    Python runs a full collection only once the objects promoted since the last one outnumber a
    quarter of those it found then. Start-up leaves hundreds of thousands (imports, the model,
    torch.compile), which put the first full collection inside a later step, a stall with the GPU
    idle (docs/performance.md has the figures). Called in the first step's time, it falls there,
    out of the figures, and later full collections skip the frozen objects. A frozen object that
    becomes cyclic garbage stays until the loop thaws them at its end. Not on a CPU: runs there
    are tests and demos, short, and each launch would pay 0.1-0.2 s for a stall that a short run
    seldom reaches."""
    if device.type != "cuda":
        return False
    gc.collect()
    gc.freeze()
    return True


class Window:
    """Sums over one log window's steps, kept on the device until it ends: one GPU sync and one
    all-reduce per window, none per step."""

    def __init__(self, device: torch.device, step: int) -> None:
        self.sums = torch.zeros(4, device=device)  # one tensor: one all-reduce
        # views into it; failed_write: rank 0's background checkpoint write failed (1) or not
        self.loss_sum, self.correct, self.nonfinite_norms, self.failed_write = self.sums.unbind()
        self.samples = self.predictions = 0  # per rank; every rank sees as many
        self.grad_norm: torch.Tensor | None = None  # the last step's
        self.lr = math.nan  # the last step's
        self.start_step, self.started = step, time.perf_counter()
        self.aside_s, self.aside_steps = 0.0, 0  # time and steps not the steps' own
        self.checkpoint_s = 0.0  # of aside_s: waiting for checkpoints

    def set_aside(self, seconds: float, steps: int = 0) -> None:
        """Time spent other than stepping (scoring, checkpoints; with `steps`, the first step's
        compiling): left out of the window's step time."""
        self.aside_s += seconds
        self.aside_steps += steps

    def add(self, step_loss: torch.Tensor, samples: int, grad_norm: torch.Tensor | None) -> None:
        """A step's mean loss over its samples, and its gradient norm if one was computed."""
        self.loss_sum.add_(step_loss, alpha=samples)
        self.samples += samples
        if grad_norm is not None:
            self.nonfinite_norms.add_((~torch.isfinite(grad_norm)).float())
            self.grad_norm = grad_norm

    def add_accuracy(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """For the last step of the window only: an argmax over a large vocabulary is not free."""
        self.correct.add_((logits.argmax(dim=-1) == labels).sum())
        self.predictions += labels.numel()

    def close(self, step: int, world: World) -> dict[str, Any]:
        """The window's figures over every rank, Diverged if one is not finite; starts the next
        window."""
        if world.size > 1:
            dist.all_reduce(self.sums)
        loss_sum, correct, nonfinite, failed_write = self.sums.tolist()  # the window's one sync
        elapsed, steps = time.perf_counter() - self.started, step - self.start_step
        stepped = steps > self.aside_steps  # else the first step is all there is: figures of it
        if stepped:
            elapsed, steps = elapsed - self.aside_s, steps - self.aside_steps
        if self.samples == 0:
            raise Diverged(step, "the gradient norm of every step since the last log line")
        if nonfinite:
            raise Diverged(step, "the gradient norm")
        if not math.isfinite(loss_sum):
            raise Diverged(step, "the loss")
        totals = {
            "loss": loss_sum / (self.samples * world.size),
            "accuracy": correct / max(1, self.predictions * world.size),
            "grad_norm": None if self.grad_norm is None else self.grad_norm.item(),
            "lr": self.lr,
            # every step has as many samples: those of the steps set aside go with them
            "samples_per_s": self.samples * steps / (step - self.start_step) * world.size / elapsed,
            "step_time_ms": elapsed / steps * 1e3,
            "checkpoint_s": self.checkpoint_s,
            "failed_write": bool(failed_write),  # not a column: the Trainer acts on it
            "stepping_s": elapsed if stepped else 0.0,  # not a column: goodput's
        }
        self.sums.zero_()
        self.samples = self.predictions = 0
        self.grad_norm = None
        self.start_step, self.started = step, time.perf_counter()
        self.aside_s, self.aside_steps, self.checkpoint_s = 0.0, 0, 0.0
        return totals


class FirstStep(NamedTuple):
    """A launch's first step: how long it took, when it was done, what its compile found."""

    seconds: float
    after_launch_s: float
    compiled: str | None  # compilation.cache_report's; None without torch.compile


class Trainer:
    """One process's share of a run: its model replica, optimizer, data shard and checkpoints."""

    def __init__(
        self,
        cfg: TrainConfig,
        world: World,
        device: torch.device,
        run_dir: Path,
        control: dist.ProcessGroup | None = None,
        watchdog: Heartbeat = NO_WATCHDOG,
        timeline: Timeline | None = None,
    ) -> None:
        self.cfg, self.world, self.device, self.run_dir = cfg, world, device, run_dir
        self.timeline = timeline or Timeline(time.time())  # the start-up line's
        self.watchdog = watchdog  # told that steps go on
        # profile=: None unless it asks something of this rank; before the model is built, so
        # that a memory history of the run (profile.oom_snapshot) holds its weights.
        self.profiler = profiling.for_rank(cfg.profile, world.rank, device, run_dir)
        seed = cfg.trainer.seed
        torch.manual_seed(seed)
        # a resume on another world size may adjust the accumulation (global_batch.on_resume)
        self.global_batch = GlobalBatch(
            world.size, cfg.data.batch_size, cfg.trainer.grad_accumulation
        )
        dataset = builder_of(cfg.data)(cfg.data, seed, False)
        self.loader, self.sampler = build_loader(
            dataset, cfg.data, cfg.trainer.grad_accumulation, seed, device, world
        )
        self.timeline.mark("data")
        with device:  # initialised where it trains: no host copy of the weights
            self.module = builder_of(cfg.model)(cfg.model, cfg.data)
        self.model, self.comm_timer = ddp.wrap(
            self.module, cfg.dist, device, world, cfg.trainer.precision
        )
        self.compiled = compilation.compiles(cfg, device)
        if cfg.trainer.compile and not self.compiled and world.main:
            log.info(
                "trainer.compile=true: eager on %s (torch.compile is used on CUDA only)",
                device.type,
            )
        # Where compiling was asked for, on a GPU or not (an eager CPU run of a GPU config uses
        # the same place): inductor reads it when it first compiles.
        self.compile_cache = caches.keep_caches_in(run_dir) if cfg.trainer.compile else None
        self.compile_counts = compilation.cache_counts()  # this job's, in a sweep's process
        self.forward = (
            compilation.compiled_forward(self.model, self.module) if self.compiled else self.model
        )
        self.loss = compilation.loss_function(self.compiled)
        self.recompiles = compilation.Recompiles()
        self.timeline.mark(
            "model"
        )  # built, wrapped (dist.strategy), torch.compile set up (it compiles later)
        self.optimizer = optimizer.build(cfg.optimizer, self.module, cfg.trainer.lr, device)
        self.fresh_optimizer = self.optimizer.state_dict()  # no state yet: small, for resume()
        # fp32 on the training device, beside the model: None without trainer.ema_decay
        self.ema = EMA(self.module, cfg.trainer.ema_decay) if cfg.trainer.ema_decay else None
        self.early_stopping = EarlyStopping(cfg.trainer.patience)
        self.autocast = autocast_for(device, cfg.trainer.precision)
        self.scaler = torch.amp.GradScaler(
            device.type, enabled=self.autocast.keywords["dtype"] is torch.float16
        )
        self.held_out = (
            scoring.held_out_batches(builder_of(cfg.data)(cfg.data, seed, True), cfg.data, world)
            if cfg.trainer.val_every
            else None
        )
        self.timeline.mark("optimizer and held-out data")
        self.progress = Progress()
        self.checkpointer = Checkpointer(
            run_dir,
            every=cfg.trainer.checkpoint_every,
            keep=cfg.trainer.keep_checkpoints,
            keep_best=cfg.trainer.keep_best,
            world=world,
            group=control,
            states={
                "model": self.module,
                "optimizer": self.optimizer,
                "scaler": self.scaler,
                "data": self.progress,
                "patience": self.early_stopping,
            }
            | ({"ema": self.ema} if self.ema else {}),
            config=OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True),
            options=chosen(cfg),
            watchdog=watchdog,
            asynchronous=cfg.trainer.async_checkpoint,
            checkpoint_format=cfg.trainer.checkpoint_format.value,
            # a DCP write's collectives run in a thread: a CPU group of their own
            writers=process_group.control_group(world, cfg.dist.checkpoint_timeout_s)
            if cfg.trainer.checkpoint_format is CheckpointFormat.dcp
            else None,
        )
        self.checkpointer.global_batch = asdict(self.global_batch)
        self.preemption = Preemption(control, world)  # the step a stop signal ends the run at
        self.window = Window(device, step=0)
        self.resumed = False
        self.cut_short: int | None = None  # the step whose validation a stop signal cut short
        # MFU's terms, fixed for the run: a model of your own without flops_per_token() logs none.
        self.tokens_per_sample = getattr(self.module, "tokens_per_sample", 1)
        flops = getattr(self.module, "flops_per_token", None)
        self.flops_per_token = flops() if flops else None
        self.peak_flops = (
            perf.peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
        )
        self.launched_at = launched_at()
        self.lost = dict.fromkeys(LOST, 0.0)  # seconds of this launch the steps did not use
        self.stepping_s = 0.0  # seconds of this launch spent in steps (the first one's aside)
        self.steps_done = 0  # by this launch
        self.first_step: FirstStep | None = None

    def train(self) -> bool:
        """Train to trainer.max_steps from the newest checkpoint (resume() first, unless called
        already). True if a stop signal (SIGTERM, SIGINT) stopped it: after a checkpoint at the
        step every rank agreed on, or before the first step, with nothing new to save."""
        if not self.resumed:
            self.resume()
        try:
            stopped = self.run_steps()
            stalled = self.checkpointer.stalled_s
            self.checkpointer.settle()  # the last checkpoint reads back, or every rank hears why
            self.lost["checkpoints"] += self.checkpointer.stalled_s - stalled
        except (Diverged, CheckpointFailed):
            self.checkpointer.drain()  # a write in progress holds a good state: it ends
            self.preemption.close()  # every rank stops at the same step: the exchange ends
            raise
        except BaseException:
            self.checkpointer.drain()
            self.preemption.close(wait=False)  # a peer may never answer it
            raise
        self.preemption.close()
        self.report_goodput()
        return stopped

    def run_steps(self) -> bool:
        max_steps, accumulation = self.cfg.trainer.max_steps, self.global_batch.accumulation
        preemption = self.preemption
        if preemption.start(self.progress.step):  # asked to stop already
            preemption.signals.say(preemption.signals.stopped_line())
            return True
        if self.early_stopping.due:  # a relaunch of a run that stopped early: nothing to do
            if self.world.main:
                log.info("%s, before this launch", self.early_stopping.line(self.progress.step))
            return False
        batches = self.batches()
        record = metrics.RunRecord(
            self.run_dir,
            max_steps,
            self.progress.step,
            self.world.main,
            self.cfg.logger,
            self.checkpointer.config,
        )
        self.window = Window(self.device, self.progress.step)
        row = None  # a closed window's, written once the next step is queued on the GPU

        def write_row() -> None:
            nonlocal row
            if row is not None:
                pending, row = row, None  # a write that fails is not tried again
                record.write(pending)

        first, frozen = True, False
        profiler = self.profiler
        self.timeline.mark("the loop's set-up")  # config.yaml, the loggers
        if self.world.main:
            log.info("%s", self.timeline.line())
        self.lost["start-up"] = time.time() - self.launched_at
        with record:  # on an error or a stop too: the bar stops and the files close
            try:
                while self.progress.step < max_steps:
                    step = self.progress.step + 1
                    log_now = self.ends_window(step)
                    if profiler is not None:  # profile=none: this check is all it costs
                        self.window.set_aside(profiler.tick(step))
                    started = time.perf_counter()
                    with preemption.signals.undeferred() if first else nullcontext():
                        self.step([next(batches) for _ in range(accumulation)], log_now)
                    write_row()  # the file and logger work overlaps this step on the GPU
                    if first:
                        frozen = freeze_start_up_objects(self.device)
                        self.set_aside_first_step(started)
                        self.checkpointer.prepare()
                    first = False
                    self.progress.step = step
                    self.steps_done += 1
                    self.watchdog.beat()
                    record.step(step)
                    stop, score = False, None
                    if log_now:
                        row = self.log_row(step)
                        if self.validates(step):
                            score = self.validate(step, row)  # None: a stop signal cut it short
                            write_row()  # every rank waited for the scores: nothing to overlap
                            # A signal during it stops every rank here, not steps later.
                            stop = preemption.agreed_now()
                        # A resume keeps the rows up to its checkpoint: this one goes first.
                        if self.checkpointer.due(step, last_step=step == max_steps):
                            write_row()
                    stop = stop or preemption.agreed(step)  # every rank: the same step, or none
                    # every rank: the same all-reduced val_loss, the same count
                    patience_out = score is not None and self.early_stopping.due
                    stalled = self.checkpointer.stalled_s
                    written = self.checkpointer.save(
                        step,
                        last_step=step == max_steps,
                        force=stop or patience_out,
                        val_loss=score and score.loss,
                    )
                    if score:
                        self.checkpointer.save_best(step, score.loss, written)
                    if stop or patience_out:
                        self.checkpointer.settle()  # the stop's checkpoint reads back first
                    self.set_aside_checkpoint(self.checkpointer.stalled_s - stalled)
                    if stop:
                        write_row()
                        self.report_stop(step)
                        return True
                    if patience_out:  # a finished run: exit 0
                        write_row()
                        if self.world.main:
                            log.info("%s", self.early_stopping.line(step))
                        return False
            finally:
                if frozen:  # first: finish_together's collection, a sweep's next job, need it
                    gc.unfreeze()
                if profiler is not None:
                    profiler.finish()  # a window the loop ended inside: as far as it got
                write_row()  # the step after it failed: the window's figures stand
        return False

    def set_aside_first_step(self, started: float) -> None:
        """The first step of a launch (compiling the model, warming up the GPU) is no measure
        of the steps: left out of the window's figures, into goodput's account, with the
        collection of what start-up left (freeze_start_up_objects). With
        torch.compile: how long it took, and from here on the graphs it makes are news."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - started
        self.window.set_aside(took, steps=1)
        self.lost["first step"] += took
        # The start-up a relaunch costs: from the launch to the first step done (bench reports it).
        compiled = (
            compilation.cache_report(self.compile_cache, self.compile_counts)
            if self.compiled
            else None
        )
        self.first_step = FirstStep(took, time.time() - self.launched_at, compiled)
        if self.compiled:
            if self.world.main:
                log.info("torch.compile: the first step took %.1f s (%s)", took, compiled)
            self.recompiles.start()

    def set_aside_checkpoint(self, seconds: float) -> None:
        if seconds:
            self.window.set_aside(seconds)
            self.window.checkpoint_s += seconds
            self.lost["checkpoints"] += seconds

    def report_goodput(self) -> None:
        """The launch's goodput: the share of the wall time since launch spent in steps, and its
        effective MFU (the steps' MFU times that share), with where the rest went."""
        wall = time.time() - self.launched_at
        if not (self.world.main and self.steps_done and wall > 0):
            return
        goodput = self.stepping_s / wall
        accounted = sum(self.lost.values())
        spent = ", ".join(f"{cause} {s:.1f} s" for cause, s in self.lost.items() if s >= 0.05)
        other = wall - self.stepping_s - accounted
        line = (
            f"goodput {goodput:.2f}: {self.stepping_s:.1f} s of steps in {wall:.1f} s since "
            f"launch ({spent}{', other' if spent else 'other'} {max(0.0, other):.1f} s); the "
            f"first step done {self.first_step.after_launch_s:.1f} s after launch"
        )
        if self.flops_per_token and self.peak_flops:
            tokens = self.steps_done * self.global_batch.samples * self.tokens_per_sample
            mfu = perf.mfu(tokens / wall, self.flops_per_token, self.world.size, self.peak_flops)
            line += f"; effective MFU {mfu:.3f}"
        log.info("%s", line)

    def resume(self) -> None:
        """Load the newest checkpoint, if there is one; Incompatible if it does not fit."""
        self.resumed = True
        state = self.checkpointer.load()
        if state is None:
            return
        self.keep_optimizer_settings(state)
        if self.ema and "ema" not in state:  # a DCP folder's is None here: loaded already
            if self.world.main:
                log.info("trainer.ema_decay: the checkpoint has no EMA; it starts from its weights")
            self.ema.start_from_weights()
        self.keep_global_batch(state)
        if self.world.main:
            log.info(
                "resumed from the checkpoint of step %d (epoch %d, sample %d of it)",
                self.progress.step,
                self.progress.epoch,
                self.progress.samples_in_epoch,
            )
            self.report_stretched_decay(state["config"]["trainer"]["max_steps"])

    def keep_optimizer_settings(self, state: dict[str, Any]) -> None:
        """The config's optimizer settings, not the checkpoint's; another class than the
        checkpoint's (trainer.accept_changes named optimizer._target_) starts with no state."""
        saved = upgraded(state["config"]).get("optimizer", {}).get("_target_")
        if saved != self.cfg.optimizer._target_:
            self.optimizer.load_state_dict(self.fresh_optimizer)
            if self.world.main:
                log.warning(
                    "optimizer._target_ changed from %s to %s: its state starts afresh",
                    saved,
                    self.cfg.optimizer._target_,
                )
        optimizer.apply_settings(self.optimizer, self.cfg.optimizer)

    def keep_global_batch(self, state: dict[str, Any]) -> None:
        """On another world size, the accumulation that keeps the checkpoint's global batch
        (said in the log), or Incompatible; the data position in samples, whatever the world."""
        saved = GlobalBatch.saved(state)
        try:
            now = on_resume(
                saved, state["config"], self.global_batch, accepted(self.cfg.trainer.accept_changes)
            )
        except GlobalBatchChanged as err:
            raise Incompatible(str(err)) from None
        if now != self.global_batch and self.world.main:
            log.warning(
                "the checkpoint was written by %d process(es), this run has %d: "
                "trainer.grad_accumulation %d -> %d keeps its global batch of %d samples",
                saved.processes,
                now.processes,
                self.global_batch.accumulation,
                now.accumulation,
                now.samples,
            )
        elif now.samples != saved.samples and self.world.main:
            log.warning("the global batch changes from %s to %s", saved, now)
        self.global_batch = now
        self.sampler.accumulation = now.accumulation
        self.checkpointer.global_batch = asdict(now)

    def report_stretched_decay(self, old_max_steps: int) -> None:
        """trainer.max_steps may change on a resume; where the decay ends changes with it, and so
        does the rate from the next step on."""
        trainer, step = self.cfg.trainer, self.progress.step + 1
        was = schedule.learning_rate(replace(trainer, max_steps=old_max_steps), step)
        now = schedule.learning_rate(trainer, step)
        # Compared as settings: during the warm-up the rate is the same, the decay still moves.
        if old_max_steps != trainer.max_steps and trainer.schedule is not Schedule.constant:
            log.warning(
                "trainer.max_steps changed from %d to %d: the learning rate at step %d is %.3g, "
                "was %.3g: the decay now ends at step %d",
                old_max_steps,
                trainer.max_steps,
                step,
                now,
                was,
                trainer.max_steps,
            )

    def batches(self) -> Iterator[Batch]:
        """This rank's batches from where progress stands, epoch after epoch."""
        while True:
            self.sampler.set_position(self.progress.epoch, self.progress.samples_in_epoch)
            for inputs, labels in epoch_batches(self.loader):
                self.progress.samples_in_epoch += self.sampler.per_micro_step
                yield (
                    inputs.to(self.device, non_blocking=True),
                    labels.to(self.device, non_blocking=True),
                )
            self.progress.epoch, self.progress.samples_in_epoch = self.progress.epoch + 1, 0

    def step(self, micro_batches: list[Batch], ends_window: bool) -> None:
        """One optimizer step over the micro-batches."""
        if self.comm_timer and ends_window:
            self.comm_timer.arm()
        lr = schedule.learning_rate(self.cfg.trainer, self.progress.step + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        count, losses = len(micro_batches), []
        for i, (inputs, labels) in enumerate(micro_batches, start=1):
            # Reduced during the last micro-batch's backward; the others add up locally.
            with nullcontext() if i == count else ddp.no_sync(self.model):
                with self.autocast():
                    logits = self.forward(inputs)
                    loss = self.loss(logits, labels)
                self.scaler.scale(loss / count if count > 1 else loss).backward()
            losses.append(loss.detach())
        step_loss = losses[0] if count == 1 else torch.stack(losses).mean()
        grad_norm = self.gradient_norm()
        if self.skips(grad_norm):
            log.warning("step %d: non-finite gradient norm, step skipped", self.progress.step + 1)
        else:
            self.scaler.step(self.optimizer)
            if self.ema:
                self.ema.update(self.scaler_skipped())
            # Under fp16 an inf norm is routine: the grad scaler skips that update itself.
            norm = None if self.scaler.is_enabled() else grad_norm
            self.window.add(step_loss, count * len(labels), norm)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if ends_window:
            self.window.add_accuracy(logits.detach(), labels)
            self.window.lr = lr

    def scaler_skipped(self) -> torch.Tensor | None:
        """Under fp16: nonzero, on the device, if the grad scaler skipped this step's update (an
        inf gradient); the EMA skips it too. None when no scaler runs."""
        if not self.scaler.is_enabled():
            return None
        found = self.scaler._found_inf_per_device(self.optimizer)  # what step() acted on
        return sum(found.values()) if found else None

    def gradient_norm(self) -> torch.Tensor | None:
        """The gradients' global norm, clipped to trainer.max_grad_norm. None when neither
        clipping nor skipping needs it: it costs a pass over every gradient."""
        max_norm = self.cfg.trainer.max_grad_norm
        if max_norm is None and self.cfg.trainer.on_nonfinite is not OnNonFinite.skip:
            return None
        self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        norm = fsdp.whole(torch.nn.utils.get_total_norm(grads))  # fsdp2's: over every shard
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(self.module.parameters(), max_norm, norm)
        return norm

    def skips(self, grad_norm: torch.Tensor | None) -> bool:
        """on_nonfinite=skip: whether to drop this step's update (one GPU sync per step). The
        norm is of the all-reduced gradients, so every rank decides the same."""
        if self.cfg.trainer.on_nonfinite is not OnNonFinite.skip or self.scaler.is_enabled():
            return False  # fp16's grad scaler skips such steps itself
        return not bool(torch.isfinite(grad_norm))

    def ends_window(self, step: int) -> bool:
        """A validation ends the window too: its figures go in that window's row."""
        return (
            step % self.cfg.trainer.log_every == 0
            or step == self.cfg.trainer.max_steps
            or self.validates(step)
        )

    def validates(self, step: int) -> bool:
        every = self.cfg.trainer.val_every
        return every > 0 and (step % every == 0 or step == self.cfg.trainer.max_steps)

    def validate(self, step: int, row: dict[str, Any]) -> scoring.Score | None:
        """Score the held-out data into `row` (every rank's shard, all-reduced). None when a stop
        signal cut the scoring short on some rank (a long validation is not waited out): the
        partial figures are dropped on every rank."""
        started = time.perf_counter()
        signals = self.preemption.signals

        def score() -> scoring.Score:
            return scoring.score(
                self.module,
                self.held_out,
                self.device,
                self.autocast,
                self.world,
                limit=self.cfg.trainer.val_batches,
                stop=lambda: signals.requested,
                progress=self.watchdog.beat,  # scoring a large set is no stalled collective
            )

        result = score()
        if not result.complete:
            self.cut_short = step
            return None
        averaged = None
        if self.ema:
            with self.ema.swapped_in():
                averaged = score()
            if not averaged.complete:
                self.cut_short = step
                return None
        seconds = time.perf_counter() - started
        self.window.set_aside(seconds)  # the next window's figures are the steps'
        self.lost["validation"] += seconds
        row |= {"val_loss": result.loss, "val_accuracy": result.accuracy, "val_time_s": seconds}
        if averaged:
            row["val_loss_ema"] = averaged.loss
        self.early_stopping.observe(result.loss)  # before this step's checkpoint holds its count
        return result

    def log_row(self, step: int) -> dict[str, Any]:
        """Close the log window: one row of metrics.csv."""
        comm_share = (
            self.comm_timer.share() if self.comm_timer else None if self.world.size > 1 else 0.0
        )
        if self.world.main:
            self.window.failed_write.fill_(float(self.checkpointer.failed()))
        totals = self.window.close(step, self.world)
        if totals.pop("failed_write"):
            self.checkpointer.settle()  # every rank: rank 0's cause, as CheckpointFailed
        self.stepping_s += totals.pop("stepping_s")
        recompiled = self.recompiles.news() if self.compiled else None
        if recompiled and self.world.main:
            log.warning("step %d: %s", step, recompiled)
        tokens_per_s = totals["samples_per_s"] * self.tokens_per_sample
        peak_memory = None
        if self.device.type == "cuda":  # rank 0's, over the window
            peak_memory = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        return {
            "step": step,
            "max_steps": self.cfg.trainer.max_steps,
            "epoch": self.progress.epoch,
            **totals,
            "comm_share": comm_share,  # rank 0's last step of the window
            "world_size": self.world.size,
            "tokens_per_s": tokens_per_s,
            "mfu": perf.mfu(tokens_per_s, self.flops_per_token, self.world.size, self.peak_flops),
            "peak_memory_gib": peak_memory,
            **UNVALIDATED,
        }

    def report_stop(self, step: int) -> None:
        signals = self.preemption.signals
        saved = " with a checkpoint" if self.checkpointer.enabled else " (checkpoints are off)"
        if self.cut_short == step:
            saved += ", its validation cut short"
        signals.say(
            f"{signals.name}: stopped at step {step}{saved}; to resume, relaunch with "
            f"hydra.run.dir={self.run_dir}"
        )

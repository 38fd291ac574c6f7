"""Train with DistributedDataParallel: the launch. The loop itself is run/trainer.py.

    {{ cookiecutter.project }} train  # launch.py: checks, then torchrun on every GPU
    python -m {{ cookiecutter.package }}.train  # one process
    # 2 GPUs, else 2 CPU processes
    torchrun --standalone --nproc-per-node 2 -m {{ cookiecutter.package }}.train
    torchrun --standalone --nproc-per-node 2 -m {{ cookiecutter.package }}.train nccl=pcie_safe trainer.max_steps=1000
    torchrun --standalone --nproc-per-node 2 -m {{ cookiecutter.package }}.train nccl.debug=INFO nccl.p2p_disable=false
    torchrun --standalone --nproc-per-node 2 -m {{ cookiecutter.package }}.train experiment=gpt2_small
    python -m {{ cookiecutter.package }}.train --cfg job  # print the composed config

Hydra composes configs/train.yaml once per process and config.compose.ConfigCheck validates it,
once, before the run dir exists; main runs with that checked config. Rank and world size come from
torchrun's environment, read once (World).
"""  # noqa: E501

# ruff: noqa: E402 (the imports after the stop handler below)
import os
import signal
import sys
from typing import NoReturn

from .core.exits import for_signal
from .core.world import World

# stopping.STOP_SIGNALS, which imports torch: these are taken before it is.
STARTING_STOPS = (signal.SIGTERM, signal.SIGINT)


def stopped_while_importing(signum: int, frame: object) -> NoReturn:
    """A stop while torch and Hydra import (seconds), before stopping.SIGNALS takes over: nothing
    has started. Under torchrun its launcher says so (`<project> train`, or torchrun itself);
    alone, this process does, in one line."""
    if not World.from_env().launched:
        line = f"{signal.Signals(signum).name}: stopped before the first step, nothing new to save"
        print(line, file=sys.stderr, flush=True)
    os._exit(for_signal(signum))


if __name__ == "__main__":  # the command (tests import this module)
    for signum in STARTING_STOPS:
        signal.signal(signum, stopped_while_importing)
    # The launcher starts its workers with these held (launch.HELD_FOR_WORKERS): one that came
    # while this interpreter started comes now.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STARTING_STOPS)

import logging
import threading
import time
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

# data and model: the user's options, whose @builds register the builders.
from . import PACKAGE, PROJECT, data, model  # noqa: F401
from .config.error import ConfigError
from .config.logger_probes import LoggerError
from .config.overrides import hydra_argv
from .config.schema import TrainConfig, register_configs, uses_cuda
from .config.validate import check_composed
from .core.exits import Exit, exit_with_error
from .nccl import decision as nccl
from .nccl import failfast, process_group
from .record import metrics
from .record.startup import Timeline
from .run import checkpoint, profiling, rundir, stopping
from .run.nccl_env import apply_nccl_env
from .run.trainer import Trainer

IMPORTED_AT = time.time()  # the start-up line's "imports" ends here

log = logging.getLogger(__name__)
ORPHAN_EXIT_S = 20  # once torchrun is gone, the longest a worker goes on


def report_collective_failure(
    failure: failfast.CollectiveFailure,
    cfg: TrainConfig,
    world: World,
    decision: nccl.Decision,
    run_dir: Path,
) -> None:
    if failfast.claim_report(run_dir, world):
        block = failfast.remedy_block(
            failure,
            rank=world.rank,
            backend=dist.get_backend(),
            timeout_s=cfg.dist.timeout_s,
            decision=decision,
            profile=cfg.nccl.profile,
            launch=f"{PROJECT} train --nproc-per-node {world.local_size}",
            package=PACKAGE,
            trace_prefix=decision.env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", ""),
        )
        print(block, file=sys.stderr, flush=True)
    else:
        print(
            f"rank {world.rank}: {failure.collective} #{failure.sequence} failed too; "
            "see the first report above",
            file=sys.stderr,
            flush=True,
        )


def report_divergence(err: checkpoint.Diverged, cfg: TrainConfig, newest: Path | None) -> None:
    resume = (
        f"resume from {newest.name}: relaunch with the same hydra.run.dir, the new value and "
        "trainer.accept_changes=[trainer.lr]"
        if newest
        else "start again"
    )
    print(
        f"training diverged: {err}; nothing was saved from it. Lower trainer.lr "
        f"(now {cfg.trainer.lr:g}) or set trainer.max_grad_norm, and {resume}",
        file=sys.stderr,
        flush=True,
    )


def stop_when_orphaned(launcher_pid: int) -> None:
    """torchrun is gone (SIGKILL, OOM): stop as on SIGTERM, with a checkpoint if the ranks can
    still agree on a step, and end within ORPHAN_EXIT_S whatever happens."""
    log.warning("torchrun (pid %d) is gone: stopping", launcher_pid)
    threading.Timer(ORPHAN_EXIT_S, os._exit, args=(Exit.PREEMPTED,)).start()
    signal.raise_signal(signal.SIGTERM)


def report_cpu_settings(cfg: TrainConfig) -> None:
    """On CPU, what the GPU-only settings amount to, so the printed config does not mislead."""
    unused = (
        [f"trainer.precision={cfg.trainer.precision.value}"]
        if cfg.trainer.precision.value != "fp32"
        else []
    )
    unused += ["data.pin_memory=true"] if cfg.data.pin_memory else []
    if unused:
        log.info(
            "on CPU %s apply to GPUs only: this run computes in fp32 from ordinary memory",
            " and ".join(unused),
        )


def main_worker(
    cfg: TrainConfig, world: World, run_dir: Path, overrides: list[str]
) -> float | None:
    """Train; rank 0 returns the run's best val_loss (None without validation), the others
    None."""
    timeline = Timeline(IMPORTED_AT)
    timeline.mark("config")  # Hydra's composing and the checks
    cuda = uses_cuda(cfg.dist.backend)  # decided once: the device, the start-up line
    signals = stopping.SIGNALS  # installed in __main__: until the steps run, a stop is at once
    signals.run_dir = run_dir
    try:
        decision = apply_nccl_env(cfg, world, run_dir, cuda)  # before the group is made
    except ConfigError as err:  # /dev/shm too small for the transport chosen
        exit_with_error(str(err), world)
    timeline.mark(  # over gloo the line names nothing of NCCL's
        ("node probe" if cfg.nccl.auto else "NCCL environment") if cuda else "environment"
    )
    device = process_group.select_device(cuda, world)
    exit_code, score = 0, None
    with process_group.initialized(world, device, timeout_s=cfg.dist.timeout_s):

        def fail(failure: failfast.CollectiveFailure) -> NoReturn:
            # A peer that ended for a stop signal this process gets too (torchrun signals them all).
            if failure.cause is failfast.Cause.peer_died and signals.explains(wait_s=2.0):
                stop_quietly(signals)
            report_collective_failure(failure, cfg, world, decision, run_dir)
            logging.shutdown()
            # os._exit skips destroying the group: on a wedged communicator that can hang for good.
            os._exit(Exit.COLLECTIVE_FAILED)

        # Backstop for a collective that neither finishes nor raises
        # (NCCL's watchdog gets the first go).
        watchdog = failfast.StallWatchdog(
            cfg.dist.timeout_s + failfast.STALL_MARGIN_S, on_stall=fail
        )
        orphan_watch = failfast.LauncherWatch(stop_when_orphaned) if world.launched else None
        phase = failfast.GATE_PHASE
        try:
            failfast.gate(device, timeout_s=min(cfg.dist.gate_timeout_s, cfg.dist.timeout_s))
            phase = "training"
            if world.main:
                log.info(
                    "%s run %s: world size %d, backend %s, gate all-reduce passed, run dir %s",
                    PROJECT,
                    run_dir.name,
                    world.size,
                    dist.get_backend(),
                    run_dir,
                )
                if device.type == "cpu":
                    report_cpu_settings(cfg)
                rundir.keep_tokenizer(run_dir, cfg)  # generate reads it; a resume compares it
            control = process_group.control_group(world, cfg.dist.checkpoint_timeout_s)
            timeline.mark("process group")  # its rendezvous, the gate all-reduce, the CPU group
            trainer = Trainer(cfg, world, device, run_dir, control, watchdog, timeline)
            try:
                trainer.resume()  # before config.yaml: a refused resume leaves the run's as it was
                timeline.mark("resume")
                with signals.deferred():  # a signal now waits for train() to agree on a step
                    if world.main:
                        metrics.save_config(cfg, run_dir, overrides)
                    if trainer.train():  # stopped by a signal: after a checkpoint, or before a step
                        end_now(signals.exit_code)
            except checkpoint.Diverged as err:
                if world.main:
                    report_divergence(err, cfg, trainer.checkpointer.newest)
                exit_code = err.exit
            except checkpoint.Incompatible as err:  # every rank loads the same checkpoint
                if world.main:
                    print(f"config error: {err}", file=sys.stderr, flush=True)
                exit_code = err.exit
            except checkpoint.CheckpointFailed as err:  # every rank hears it from rank 0
                if world.main:
                    print(f"checkpoint error: {err}", file=sys.stderr, flush=True)
                exit_code = err.exit
            except LoggerError as err:
                end_before_the_others(err, world, run_dir)
            del trainer
            process_group.finish_together()
            if world.main:
                metrics.plot_and_log(run_dir)
                score = metrics.best_val_loss(run_dir)
        except torch.OutOfMemoryError as err:  # the others fail in their next collective
            print(profiling.out_of_memory_line(err, world.rank, cfg), file=sys.stderr, flush=True)
            end_now(Exit.FAILED)
        except Exception as err:
            failure = failfast.as_collective_failure(err, phase, dist.get_backend())
            if failure is None:
                raise
            fail(failure)
        finally:
            watchdog.stop()
            if orphan_watch:
                orphan_watch.stop()
    if exit_code:
        sys.exit(exit_code)
    return score


def end_before_the_others(err: LoggerError, world: World, run_dir: Path) -> NoReturn:
    """Only rank 0 starts the loggers; the other ranks wait for it in the first step's all-reduce
    and fail once it ends. So it ends at once, exit 2 after one line naming the logger, and
    claims the failure report: theirs then say "failed too", and the launcher names this one.
    No unwinding: a later exit would read as a consequence."""
    failfast.claim_report(run_dir, world)
    print(f"config error: {err}", file=sys.stderr, flush=True)
    end_now(Exit.CONFIG_ERROR)


def end_now(code: int) -> NoReturn:
    """After a stop the ranks agreed on: the checkpoint is written and every rank knows it, and
    nothing else is worth the grace period (the plot, the seconds of interpreter teardown)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stop_quietly(signals: stopping.StopSignals) -> NoReturn:
    """A collective failed because a peer stopped for a stop signal, which reached this process
    too: that is the stop, not a failure to explain. Rank 0 says so in one line."""
    signals.say(signals.stopped_line())
    end_now(signals.exit_code)


@hydra.main(
    version_base="1.3",
    config_path=f"pkg://{PACKAGE}.configs",
    config_name="train",
)
def main(cfg: DictConfig) -> float | None:
    """Hydra has composed the config; config.compose.ConfigCheck has checked it. Call
    register_configs() first, as __main__ does. Returns the run's best (lowest) val_loss, which
    a sweeper (-m, hparams_search=optuna) minimises; None without validation."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    world = World.from_env()  # torchrun's, for this worker: read once, passed down
    # Hydra hands the task its config without the hydra node: the NCCL profile chosen is said here.
    config = check_composed(cfg, world, nccl_choice=hydra_cfg.runtime.choices.get("nccl"))
    return main_worker(config, world, run_dir, list(hydra_cfg.overrides.task))


if __name__ == "__main__":
    world = World.from_env()
    stopping.SIGNALS.install(world.main, world.launched)  # SIGTERM, Ctrl-C: no traceback
    try:
        register_configs()  # the schemas and resolvers, before Hydra composes
        sys.argv[1:] = hydra_argv(sys.argv[1:])  # NCCL's comma lists, nccl.env.<NAME>=; YAML
    except ConfigError as err:  # a configs/ file that is not YAML, an option registered twice
        exit_with_error(f"config error: {err}", world)
    main()

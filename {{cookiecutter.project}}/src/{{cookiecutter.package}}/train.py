"""Train with DistributedDataParallel. Hydra composes the config from configs/train.yaml.

    python -m {{ cookiecutter.package }}.train                                     # one process
    torchrun --standalone --nproc-per-node 2 -m {{ cookiecutter.package }}.train   # 2 GPUs, else 2 CPU processes
    torchrun --standalone --nproc-per-node 2 -m {{ cookiecutter.package }}.train nccl=pcie_safe trainer.max_steps=1000
    torchrun --standalone --nproc-per-node 2 -m {{ cookiecutter.package }}.train nccl.debug=INFO nccl.p2p_disable=false
    python -m {{ cookiecutter.package }}.train --cfg job                          # print the composed config

Rank and world size come only from torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE).
"""

import gc
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from {{ cookiecutter.package }} import check, checkpoint, failfast, metrics, nccl, probe
from {{ cookiecutter.package }}.config import (
    CommHook,
    DistConfig,
    Precision,
    TrainConfig,
    exit_with_error,
    register_configs,
    uses_cuda,
)
from {{ cookiecutter.package }}.data import build_loader, synthetic_dataset
from {{ cookiecutter.package }}.model import build_model

log = logging.getLogger(__name__)


def flight_recorder_buffer_var() -> str:
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    return "TORCH_FR_BUFFER_SIZE" if version >= (2, 11) else "TORCH_NCCL_TRACE_BUFFER_SIZE"


def apply_nccl_env(cfg: TrainConfig, profile: str, run_dir: Path) -> nccl.Decision:
    """NCCL reads its variables once, when the first communicator is made: write them first."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    facts = probe.shared_node_facts(run_dir, local_rank) if cfg.nccl.auto else probe.basic_facts()
    (run_dir / "nccl").mkdir(parents=True, exist_ok=True)
    recorder = nccl.flight_recorder_env(
        str(run_dir / "nccl" / "trace_rank_"), flight_recorder_buffer_var()
    )
    explicit = {}
    if cfg.dist.async_error_handling is not None:
        value = str(cfg.dist.async_error_handling)
        explicit["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = (value, "config dist.async_error_handling")
    decision = nccl.decide(cfg.nccl, facts, os.environ, defaults=recorder, explicit=explicit)
    shm_problem = nccl.shm_error(facts, decision.env) if uses_cuda(cfg.dist.backend) else None
    if shm_problem:
        exit_with_error(shm_problem)
    os.environ.update(decision.env)
    if int(os.environ.get("RANK", "0")) == 0:
        if cfg.nccl.auto:
            log.info("node probe: %s", facts.summary())
        log.info("NCCL environment (nccl=%s):\n%s", profile, decision.report())
        for warning in decision.warnings:
            log.warning(warning)
    return decision


def report_collective_failure(
    failure: failfast.CollectiveFailure,
    cfg: TrainConfig,
    decision: nccl.Decision,
    profile: str,
    run_dir: Path,
) -> None:
    rank = int(os.environ.get("RANK", "0"))
    if failfast.claim_report(run_dir):
        block = failfast.remedy_block(
            failure,
            rank=rank,
            timeout_s=cfg.dist.timeout_s,
            decision=decision,
            profile=profile,
            package=__package__,
            nproc=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            trace_prefix=decision.env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", ""),
        )
        print(block, file=sys.stderr, flush=True)
    else:
        print(
            f"rank {rank}: {failure.collective} #{failure.sequence} failed too; see the first report above",
            file=sys.stderr,
            flush=True,
        )


def save_resolved_config(cfg: TrainConfig, run_dir: Path) -> None:
    """The config this run uses, every value resolved: printed, and kept as <run dir>/config.yaml."""
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    (run_dir / "config.yaml").write_text(text)
    log.info("config (also in %s):\n%s", run_dir / "config.yaml", text.rstrip())


def select_device(cfg: TrainConfig, local_rank: int) -> torch.device:
    if not uses_cuda(cfg.dist.backend):
        return torch.device("cpu")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


AUTOCAST = {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}


COMM_HOOKS = {
    CommHook.default: None,
    CommHook.bf16: default_hooks.bf16_compress_hook,
    CommHook.fp16: default_hooks.fp16_compress_hook,
    CommHook.noop: debugging_hooks.noop_hook,
}


def wrap_ddp(
    module: nn.Module, cfg: DistConfig, device: torch.device
) -> tuple[nn.Module, metrics.CommTimer | None]:
    """DDP over several processes, its all-reduces timed on the steps that end a log window.
    One process trains the bare module: DDP's bucket copies and hooks would only slow its step."""
    if dist.get_world_size() == 1:
        return module, None
    model = DDP(
        module,
        device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,  # fewer, larger all-reduces; see BENCHMARKS.md
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,  # grads live in the buckets: no copy
        static_graph=cfg.static_graph,  # the same parameters get gradients every step
    )
    hook = COMM_HOOKS[cfg.comm_hook]
    timer = metrics.CommTimer(hook, device) if cfg.time_comm else None
    if timer or hook:  # else DDP's built-in all-reduce
        model.register_comm_hook(None, timer.hook if timer else hook)
    return model, timer


def skip_gradient_sync(model: nn.Module) -> AbstractContextManager:
    """For all but the last micro-batch of an accumulated step: gradients add up locally."""
    return model.no_sync() if isinstance(model, DDP) else nullcontext()


def train(
    cfg: TrainConfig,
    device: torch.device,
    run_dir: Path,
    control: dist.ProcessGroup | None,
    progress: Callable[[], None] = lambda: None,
) -> bool:
    """Train to cfg.trainer.max_steps, resuming from the run dir's newest checkpoint.

    Returns True if SIGTERM stopped it early (after a checkpoint at that step).
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(cfg.trainer.seed)
    dataset = synthetic_dataset(cfg.data, seed=cfg.trainer.seed)
    loader, sampler = build_loader(dataset, cfg.data, seed=cfg.trainer.seed, device=device)
    module = build_model(cfg.model, cfg.data).to(device)
    model, comm_timer = wrap_ddp(module, cfg.dist, device)
    forward = torch.compile(model) if cfg.trainer.compile else model
    optimizer = torch.optim.AdamW(
        module.parameters(),
        lr=cfg.trainer.lr,
        weight_decay=cfg.trainer.weight_decay,
        fused=(cfg.trainer.fused_optimizer and device.type == "cuda") or None,  # one kernel
    )
    warmup = max(1, cfg.trainer.warmup_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup)
    )
    on_gpu = device.type == "cuda"
    autocast_dtype = AUTOCAST.get(cfg.trainer.precision) if on_gpu else None
    scaler = torch.amp.GradScaler(
        device.type, enabled=on_gpu and cfg.trainer.precision is Precision.fp16
    )
    preemption = checkpoint.Preemption(control)
    checkpoints = cfg.trainer.checkpoint_every > 0
    accumulation = cfg.trainer.grad_accumulation

    position = checkpoint.Position()
    resumed = checkpoint.choose_and_load(run_dir, control)
    if resumed:
        module.load_state_dict(resumed["model"])
        optimizer.load_state_dict(resumed["optimizer"])
        scheduler.load_state_dict(resumed["scheduler"])
        if resumed["scaler"]:  # empty when it was disabled (bf16, fp32, CPU)
            scaler.load_state_dict(resumed["scaler"])
        position = checkpoint.Position(**resumed["data"])
        if resumed["world_size"] == world_size:
            checkpoint.set_rng_state(resumed["rng"][rank])
        else:  # other shards: the batches of this epoch cannot be matched, so start it again
            position = checkpoint.Position(position.step, position.epoch, 0)
            if rank == 0:
                log.warning(
                    "the checkpoint was written by %d processes, this run has %d: "
                    "epoch %d starts again from its first batch",
                    resumed["world_size"], world_size, position.epoch,
                )  # fmt: skip
        progress()  # loading a large checkpoint is not a stalled collective
        if rank == 0:
            log.info(
                "resumed from the checkpoint of step %d (epoch %d, batch %d)",
                *vars(position).values(),
            )

    def save(position: checkpoint.Position) -> None:
        if not checkpoints:
            return
        rng = checkpoint.gather_rng_states(control)  # a collective: every rank takes part
        if rank == 0:
            state = {
                "step": position.step,
                "model": module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict(),
                "rng": rng,
                "data": vars(position),
                "config": OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True),
                "world_size": world_size,
            }
            path = checkpoint.save(run_dir, state, keep=cfg.trainer.keep_checkpoints)
            log.info("checkpoint %s", path.relative_to(run_dir))
        progress()  # writing it is not a stalled collective

    step, epoch, batch_in_epoch = position.step, position.epoch, position.batch_in_epoch
    record = metrics.RunRecord(run_dir, cfg.trainer.max_steps, step, enabled=rank == 0)
    with record:  # on an error or SIGTERM too: the bar stops and the files close
        window = torch.zeros(3, device=device)  # summed loss, correct predictions, samples
        micro_batch, window_start, started = 0, step, time.perf_counter()
        while step < cfg.trainer.max_steps:
            sampler.set_position(epoch, batch_in_epoch)
            for inputs, labels in loader:
                inputs = inputs.to(device, non_blocking=True)
                labels = labels.to(device, non_blocking=True)
                if comm_timer and micro_batch == 0 and ends_log_window(step + 1, cfg):
                    comm_timer.arm()
                micro_batch += 1
                last_micro_batch = micro_batch == accumulation
                with nullcontext() if last_micro_batch else skip_gradient_sync(model):
                    with torch.autocast(
                        device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None
                    ):
                        logits = forward(inputs)
                        loss = F.cross_entropy(logits, labels)
                    # DDP all-reduces the gradients during the last micro-batch's backward
                    scaler.scale(loss / accumulation if accumulation > 1 else loss).backward()
                batch_in_epoch += 1
                window[0] += loss.detach().float() * len(labels)
                window[1] += (logits.argmax(dim=1) == labels).sum()
                window[2] += len(labels)
                if not last_micro_batch:
                    continue
                micro_batch = 0
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                step += 1
                progress()
                record.step(step)

                if ends_log_window(step, cfg):
                    comm_share = (
                        comm_timer.share() if comm_timer else None if world_size > 1 else 0.0
                    )
                    dist.all_reduce(window)  # average over all ranks, not just rank 0's shard
                    now = time.perf_counter()
                    loss_sum, correct, samples = window.tolist()
                    record.write(
                        {
                            "step": step,
                            "max_steps": cfg.trainer.max_steps,
                            "epoch": epoch,
                            "loss": loss_sum / samples,
                            "accuracy": correct / samples,
                            "lr": lr,
                            "samples_per_s": samples / (now - started),
                            "step_time_ms": (now - started) / (step - window_start) * 1e3,
                            "comm_share": comm_share,  # rank 0's last step of the window
                            "world_size": world_size,
                        }
                    )
                    window.zero_()
                    window_start, started = step, now
                here = checkpoint.Position(step, epoch, batch_in_epoch)
                if preemption.agreed():
                    save(here)
                    if rank == 0:
                        log.warning(
                            "SIGTERM: stopped at step %d%s; to resume, relaunch with hydra.run.dir=%s",
                            step,
                            " with a checkpoint" if checkpoints else " (checkpoints are off)",
                            run_dir,
                        )
                    return True
                if checkpoints and (
                    step % cfg.trainer.checkpoint_every == 0 or step == cfg.trainer.max_steps
                ):
                    save(here)
                if step == cfg.trainer.max_steps:
                    break
            else:  # the epoch ran out
                epoch, batch_in_epoch = epoch + 1, 0
        preemption.close()
    return False


def ends_log_window(step: int, cfg: TrainConfig) -> bool:
    return step % cfg.trainer.log_every == 0 or step == cfg.trainer.max_steps


def main_worker(cfg: TrainConfig, run_dir: Path, nccl_profile: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))

    decision = apply_nccl_env(cfg, nccl_profile, run_dir)
    device = select_device(cfg, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # Without torchrun (plain `python -m`) there is no rendezvous: a group of one.
    standalone = (
        {} if "RANK" in os.environ else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    )
    dist.init_process_group(
        backend=backend,
        timeout=timedelta(seconds=cfg.dist.timeout_s),
        device_id=device if device.type == "cuda" else None,  # make the NCCL communicator now
        **standalone,
    )

    def fail(failure: failfast.CollectiveFailure) -> NoReturn:
        report_collective_failure(failure, cfg, decision, nccl_profile, run_dir)
        logging.shutdown()
        # No destroy_process_group here: on a wedged communicator it can hang for good.
        os._exit(failfast.EXIT_COLLECTIVE_FAILED)

    # Backstop for a collective that neither finishes nor raises (NCCL's watchdog gets the first go).
    watchdog = failfast.StallWatchdog(cfg.dist.timeout_s + failfast.STALL_MARGIN_S, on_stall=fail)
    try:
        failfast.gate(device, timeout_s=min(cfg.dist.gate_timeout_s, cfg.dist.timeout_s))
        if rank == 0:
            log.info(
                "world size %d, backend %s, gate all-reduce passed, run dir %s",
                world_size,
                backend,
                run_dir,
            )
            save_resolved_config(cfg, run_dir)
        # A CPU group for control messages (stop? which checkpoint?): no GPU synchronisation.
        control = dist.new_group(backend="gloo") if backend == "nccl" else None
        preempted = train(cfg, device, run_dir, control, progress=watchdog.beat)
        gc.collect()  # drop DDP's reducer before the barrier: gloo may abort at exit otherwise
        dist.barrier()
        if rank == 0:  # once train() has let go of its DataLoader workers
            metrics.plot_and_log(run_dir)
    except Exception as err:
        failure = failfast.as_collective_failure(err, phase="training")
        if failure is None:
            raise
        fail(failure)
    finally:
        watchdog.stop()
        dist.destroy_process_group()
    if preempted:
        sys.exit(checkpoint.EXIT_PREEMPTED)


register_configs()  # the schema and resolvers must exist before Hydra composes


@hydra.main(
    version_base="1.3",
    config_path="pkg://{{ cookiecutter.package }}.configs",
    config_name="train",
)
def main(cfg: DictConfig) -> None:
    """Hydra has composed the config; cli() has checked it."""
    hydra_cfg = HydraConfig.get()
    config: TrainConfig = OmegaConf.to_object(cfg)
    main_worker(config, Path(hydra_cfg.runtime.output_dir), hydra_cfg.runtime.choices["nccl"])


def cli() -> None:
    """Check the config first: a bad value stops every rank in one line, before any run dir."""
    overrides = sys.argv[1:]
    if not any(arg.startswith("-") for arg in overrides):  # --cfg, --help, -m: Hydra's own modes
        check.load_or_exit(overrides)
    main()


if __name__ == "__main__":
    cli()

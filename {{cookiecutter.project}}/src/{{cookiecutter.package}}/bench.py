"""Is the template's loop as fast as a hand-written DDP loop? Both, interleaved, in one launch.

    python -m {{ cookiecutter.package }}.bench                      # the default model
    python -m {{ cookiecutter.package }}.bench experiment=mlp_134m  # the 134M-parameter MLP
    python -m {{ cookiecutter.package }}.bench experiment=gpt2_small --pairs 7  # GPT-2 small
    python -m {{ cookiecutter.package }}.bench experiment=mlp_134m dist.bucket_cap_mb=25 --json b25.json

One torchrun launch over every local GPU (2 CPU processes without CUDA) times, pair after pair:
  - the template: trainer.Trainer, the loop that train runs, with the overrides given and
    checkpoints and validation off, timed by its own log windows (trainer.log_every steps, at
    most 50: what a run logs, it pays for here too);
  - the reference: a minimal hand-written DDP loop with the same model, optimizer, autocast, DDP
    knobs and micro-batches, on fixed batches already on the device, timed over windows as long,
    each ending in a synchronisation as the template's do;
first on 1 GPU (rank 0 alone, no DDP), then on all of them; the order within a pair alternates.
Step times drift between launches and within one, so every figure is a ratio within one pair:
template / reference for 1 and N GPUs, and the scaling efficiency 1 -> N of each, as the median
and range over the pairs. Also the time of one all-reduce of the fp32 gradients under the same
NCCL settings. Then, on every process, what the config's checkpoints and validations cost
(the template run again, checkpointing and validating at the config's cadence, or every
~10 s of steps if that is longer, for 3 of them, each charged
what its log rows say it held training up), and the steady-state goodput that makes at the
config's own cadence: step time over step time plus that cost spread over the steps between.
Where the model compiles (trainer.compile on a GPU), also the first step of a fresh one-GPU
process, twice: cold, then from the compile cache the first one filled, as a rescheduled pod
finds it beside its runs.
It prints a table and writes every figure as JSON (--json).
"""  # noqa: E501

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from . import PACKAGE
from .config import compose as check
from .config.error import ConfigError
from .config.logger_probes import LoggerError
from .config.schema import TrainConfig, uses_cuda
from .core.cli import Parser, at_least, seconds
from .core.exits import Exit, exit_with_error
from .core.world import World
from .data import build_dataset
from .launcher.worker_exits import root_cause
from .model import build_model
from .nccl import allreduce, process_group
from .record import perf
from .run import compilation, ddp
from .run.nccl_env import apply_nccl_env
from .run.optimizer import build as build_optimizer
from .run.trainer import Trainer, autocast_for

MAX_WINDOW = 50  # steps: a run that logs less often is timed over windows of this many
# Between the measured checkpoints: the config's own cadence, up to about CADENCE_S of steps
# (at least CADENCE_STEPS): room for a background write to end before the next save, as at the
# real cadence (gpt2_small's write takes a few seconds, about 40 of its steps on a GPU).
CADENCE_STEPS = 100
CADENCE_S = 10.0
RESULT_LINE = re.compile(r"^BENCH (\{.*\})$", re.MULTILINE)


class BenchFailed(RuntimeError):
    """The launch failed; the message says how."""


# --- the worker: runs under torchrun ------------------------------------------------------


def reference_ms(
    cfg: TrainConfig,
    world: World,
    device: torch.device,
    batches: list[tuple[torch.Tensor, ...]],
    warmup: int,
    steps: int,
) -> float:
    """A minimal hand-written DDP loop, as the DDP tutorial writes one, over `batches` (one
    step's micro-batches, first_batches()): median window step time."""
    window = cfg.trainer.log_every
    cuda = device.type == "cuda"
    torch.manual_seed(cfg.trainer.seed)
    with device:
        model = build_model(cfg.model, cfg.data)
    if world.size > 1:
        model = DDP(
            model,
            device_ids=[device] if cuda else None,
            bucket_cap_mb=cfg.dist.bucket_cap_mb,
            gradient_as_bucket_view=cfg.dist.gradient_as_bucket_view,
            static_graph=cfg.dist.static_graph,
        )
        if ddp.COMM_HOOKS[cfg.dist.comm_hook]:
            model.register_comm_hook(None, ddp.COMM_HOOKS[cfg.dist.comm_hook])
    optimizer = build_optimizer(cfg.optimizer, model, cfg.trainer.lr, device)
    compiled = compilation.compiles(cfg, device)
    # Compiled whole, as a hand-written loop does: the template's blocks compiled one by one
    # (compilation.compiled_forward) are measured against it.
    forward = torch.compile(model) if compiled else model
    loss_of = compilation.loss_function(compiled)
    autocast = autocast_for(device, cfg.trainer.precision)
    scaler = torch.amp.GradScaler(device.type, enabled=autocast.keywords["dtype"] is torch.float16)
    accumulation = cfg.trainer.grad_accumulation
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    windows = []
    for _ in range((warmup + steps) // window):
        sync()
        started = time.perf_counter()
        for _ in range(window):
            for i, (inputs, labels) in enumerate(batches, start=1):
                with model.no_sync() if i < accumulation and world.size > 1 else nullcontext():
                    with autocast():
                        loss = loss_of(forward(inputs), labels)
                    scaler.scale(loss / accumulation).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        sync()
        windows.append((time.perf_counter() - started) / window * 1e3)
    return statistics.median(windows[warmup // window :])


def first_batches(
    cfg: TrainConfig, count: int, device: torch.device
) -> list[tuple[torch.Tensor, ...]]:
    """The data set's first `count` batches (from its start again where it holds fewer), held on
    the device throughout: the loop times the step, not the data."""
    dataset = build_dataset(cfg.data, cfg.trainer.seed)
    size = cfg.data.batch_size
    rows = [[(i * size + j) % len(dataset) for j in range(size)] for i in range(count)]
    return [tuple(tensor.to(device) for tensor in dataset[batch]) for batch in rows]


def template_ms(
    cfg: TrainConfig,
    world: World,
    device: torch.device,
    control: dist.ProcessGroup | None,
    run_dir: Path,
    warmup: int,
    steps: int,
) -> float:
    """The loop train runs, timed by its own log windows (rank 0's record); NaN on other ranks."""
    timed = replace(cfg.trainer, max_steps=warmup + steps, checkpoint_every=0, val_every=0)
    rows = trained_rows(replace(cfg, trainer=timed), world, device, control, run_dir)
    if rows is None:
        return float("nan")
    return statistics.median(row["step_time_ms"] for row in rows if row["step"] > warmup)


def trained_rows(
    cfg: TrainConfig,
    world: World,
    device: torch.device,
    control: dist.ProcessGroup | None,
    run_dir: Path,
) -> list[dict] | None:
    """The Trainer run with `cfg` in `run_dir`, and its metrics rows (rank 0's; None on others)."""
    # A run dir as Hydra makes one for train: the loggers write into it and make none of their own.
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, world, device, run_dir, control)
    try:
        stopped = trainer.train()
    except LoggerError as err:  # rank 0 alone: the others wait for it in the first all-reduce
        print(f"config error: {err}", file=sys.stderr, flush=True)
        os._exit(Exit.CONFIG_ERROR)  # at once, no unwinding: theirs follows from this one
    if stopped:  # by a signal: every later timing would stop at once too
        sys.exit(trainer.preemption.signals.exit_code)
    if not world.main:
        return None
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def cadence_steps(every: dict[str, int], step_ms: float, window: int) -> int:
    """Steps between the measured checkpoints and validations (cadence_costs), in whole windows."""
    longest = (
        max(CADENCE_STEPS, math.ceil(CADENCE_S * 1e3 / step_ms)) if step_ms > 0 else CADENCE_STEPS
    )
    return whole_windows(min([longest, *(steps for steps in every.values() if steps)]), window)


def cadence_costs(
    cfg: TrainConfig,
    world: World,
    device: torch.device,
    control: dist.ProcessGroup | None,
    run_dir: Path,
    step_ms: float,
) -> dict | None:
    """What one checkpoint and one validation hold training up, as the config makes them (async
    or not, either format), from the loop's own rows over 3 × cadence_steps(): the median of
    each; None on other ranks, or with neither on. `step_ms`: the template's, rank 0's."""
    every = {"checkpoint": cfg.trainer.checkpoint_every, "validation": cfg.trainer.val_every}
    if not any(every.values()):
        return None
    window = cfg.trainer.log_every
    if world.size > 1:  # every rank trains the same steps: rank 0's figure for all
        shared = [step_ms]
        dist.broadcast_object_list(shared, src=0, group=control)
        step_ms = shared[0]
    between = cadence_steps(every, step_ms, window)
    measured = replace(
        cfg.trainer,
        max_steps=3 * between,
        checkpoint_every=between if every["checkpoint"] else 0,
        val_every=between if every["validation"] else 0,
        keep_checkpoints=2,
        keep_best=False,
    )
    rows = trained_rows(replace(cfg, trainer=measured), world, device, control, run_dir)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # gpt2_small's: 2 GB each
    if rows is None:
        return None
    # A checkpoint's stall lands in the row after its step's (the row is logged first); the
    # last step's write is waited for by the run's end, not charged to a row.
    saved = [
        row["checkpoint_s"] or 0.0 for row in rows if row["step"] - window in (between, 2 * between)
    ]
    scored = [row["val_time_s"] for row in rows if row["step"] % between == 0 and row["val_time_s"]]
    return {
        "between_steps": between,
        "every_steps": every,
        "checkpoint_s": statistics.median(saved) if every["checkpoint"] and saved else 0.0,
        "validation_s": statistics.median(scored) if every["validation"] and scored else 0.0,
    }


def gradient_allreduce(parameters: int, device: torch.device, world: World) -> dict:
    """One all-reduce of fp32 gradients, as DDP's buckets add up to, back to back."""
    tensor = torch.ones(parameters, device=device)
    allreduce.time_all_reduce(tensor, 2)  # warm-up
    seconds = allreduce.time_all_reduce(tensor, 10)
    return {
        "mib": round(tensor.nbytes / 2**20, 1),
        "time_ms": round(seconds * 1e3, 3),
        "busbw_gbps": round(allreduce.bus_bandwidth_gbps(tensor.nbytes, seconds, world.size), 3),
    }


def timed(cfg: TrainConfig) -> TrainConfig:
    """Both loops are timed over the template's log windows, trainer.log_every steps (at most
    MAX_WINDOW), each ending in a synchronisation: the template pays for what a run logs."""
    window = min(cfg.trainer.log_every, MAX_WINDOW)
    return replace(cfg, trainer=replace(cfg.trainer, log_every=window))


def whole_windows(steps: int, window: int) -> int:
    """`steps` rounded up to whole timing windows."""
    return -(-steps // window) * window


def first_step_worker(overrides: list[str], scratch: Path) -> None:
    """One process's first step of the template's loop, in a run dir of `scratch`, whose compile
    cache (<scratch>/.compile-cache) an earlier call may have filled."""
    world = World.from_env()
    cfg = check.compose_and_check(overrides, world=world)
    once = replace(cfg.trainer, max_steps=1, checkpoint_every=0, val_every=0)
    device = process_group.select_device(uses_cuda(cfg.dist.backend), world)
    with process_group.initialized(world, device, timeout_s=cfg.dist.timeout_s):
        run_dir = scratch / f"first-step-{time.time_ns()}"
        run_dir.mkdir()
        trainer = Trainer(replace(cfg, trainer=once), world, device, run_dir)
        trainer.train()
        print("BENCH " + json.dumps(trainer.first_step._asdict()), flush=True)


def worker(overrides: list[str], scratch: Path, pairs: int, warmup: int, steps: int) -> None:
    world = World.from_env()
    cfg = timed(check.compose_and_check(overrides, world=world))
    window = cfg.trainer.log_every
    warmup, steps = whole_windows(warmup, window), whole_windows(steps, window)
    cuda = uses_cuda(cfg.dist.backend)
    try:
        apply_nccl_env(cfg, world, scratch, cuda)
    except ConfigError as err:  # /dev/shm too small for the transport chosen
        exit_with_error(str(err), world)
    device = process_group.select_device(cuda, world)
    with process_group.initialized(
        world, device, timeout_s=cfg.dist.timeout_s, destroy_on_error=False
    ):
        control = process_group.control_group(world, cfg.dist.checkpoint_timeout_s)
        sizes = sorted({1, world.size})
        # built once: the reference times steps on them, pair after pair
        batches = first_batches(cfg, cfg.trainer.grad_accumulation, device)
        times = {n: {"template": [], "reference": []} for n in sizes}
        for pair in range(pairs):
            for n in sizes:
                on = replace(world, size=n, local_size=min(n, world.local_size))
                order = ["reference", "template"] if pair % 2 == 0 else ["template", "reference"]
                for loop in order:
                    ms = float("nan")
                    if world.rank < n:  # 1 GPU: rank 0 alone, the others wait
                        if loop == "template":
                            run_dir = scratch / f"template-{n}-{pair}"
                            ms = template_ms(cfg, on, device, control, run_dir, warmup, steps)
                        else:
                            ms = reference_ms(cfg, on, device, batches, warmup, steps)
                        gc.collect()  # DDP's reducer holds cycles: free its memory now
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    dist.barrier(group=control)
                    times[n][loop].append(round(ms, 4))
        step_ms = statistics.median(times[world.size]["template"]) if world.main else 0.0
        cadence = cadence_costs(cfg, world, device, control, scratch / "cadence", step_ms)
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.data)
        parameters = sum(p.numel() for p in model.parameters())
        flops = getattr(model, "flops_per_token", None)
        gradients = gradient_allreduce(parameters, device, world) if world.size > 1 else None
        if world.main:
            gpu = torch.cuda.get_device_name(device) if cuda else None
            result = {
                "overrides": overrides,
                "device": gpu or platform.processor() or "cpu",
                "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                "nccl_profile": cfg.nccl.profile if cuda else None,
                "processes": world.size,
                "parameters": parameters,
                "batch_per_process": cfg.data.batch_size * cfg.trainer.grad_accumulation,
                "tokens_per_sample": getattr(model, "tokens_per_sample", 1),
                "flops_per_token": flops() if flops else None,
                "peak_flops": perf.peak_flops(gpu) if cuda else None,
                "precision": cfg.trainer.precision.value if cuda else "fp32",
                "pairs": pairs,
                "warmup_steps": warmup,
                "timed_steps": steps,
                "window_steps": window,
                "step_ms": {str(n): loops for n, loops in times.items()},
                "gradient_allreduce": gradients,
                "cadence": cadence,
            }
            print("BENCH " + json.dumps(result), flush=True)
        process_group.finish_together()


# --- the figures: pure functions of the worker's times --------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }


def figures(result: dict) -> dict:
    """Ratios within each pair; impossible values (an efficiency above 1, more of the all-reduce
    hidden than it lasts) are clamped and named in `noise`."""
    times, n = result["step_ms"], result["processes"]
    report = {**result, "noise": []}
    report["template_over_reference"] = {
        size: spread([t / r for t, r in zip(loops["template"], loops["reference"], strict=True)])
        for size, loops in times.items()
    }
    tokens = result["batch_per_process"] * result["tokens_per_sample"]  # per process and step
    report["mfu"] = (
        {
            size: {
                loop: spread(
                    [
                        perf.mfu(
                            tokens / (ms / 1e3), result["flops_per_token"], 1, result["peak_flops"]
                        )
                        or 0.0
                        for ms in times[size][loop]
                    ]
                )
                for loop in ("template", "reference")
            }
            for size in times
        }
        if result.get("flops_per_token") and result.get("peak_flops")
        else None
    )
    report["goodput"] = steady_goodput(
        result.get("cadence"), statistics.median(times[str(n)]["template"])
    )
    if n == 1:
        return report
    one, many = times["1"], times[str(n)]
    efficiency = {}
    for loop in ("template", "reference"):
        raw = spread([t1 / tn for t1, tn in zip(one[loop], many[loop], strict=True)])
        if raw["median"] > 1:
            report["noise"].append(
                f"{loop} scaling efficiency {raw['median']:.2f} is above 1, which cannot be: the "
                f"{n} processes did not run as fast as one each (CPU processes share cores)"
            )
        efficiency[loop] = {key: min(1.0, value) for key, value in raw.items()}
    report["scaling_efficiency"] = efficiency
    exposed = statistics.median(
        tn - t1 for t1, tn in zip(one["template"], many["template"], strict=True)
    )
    allreduce_ms = result["gradient_allreduce"]["time_ms"]
    hidden = 1 - exposed / allreduce_ms
    if not 0 <= hidden <= 1:
        report["noise"].append(
            f"the step on {n} is {exposed:.2f} ms longer than on one, against an all-reduce of "
            f"{allreduce_ms:.2f} ms: the difference is not communication alone"
        )
    report["exposed_comm_ms"] = round(exposed, 3)
    report["comm_hidden_share"] = round(min(1.0, max(0.0, hidden)), 3)
    return report


def steady_goodput(cadence: dict | None, step_ms: float) -> float | None:
    """Step time over step time plus what checkpoints and validations cost per step at the
    config's cadence; None without either."""
    if not cadence:
        return None
    lost = sum(
        cadence[f"{what}_s"] / every for what, every in cadence["every_steps"].items() if every
    )
    return round(step_ms / 1e3 / (step_ms / 1e3 + lost), 4)


def render(report: dict) -> str:
    n, gpus = report["processes"], bool(report["nccl"])

    def on(count: int) -> str:
        if gpus:
            return f"{count} GPU" + ("s" if count > 1 else "")
        return f"{count} CPU process" + ("es" if count > 1 else "")

    def cell(stats: dict) -> str:
        return f"{stats['median']:.3f} ({stats['min']:.3f}-{stats['max']:.3f})"

    lines = [
        f"{report['device']}, torch {report['torch']}"
        + (f", NCCL {report['nccl']}, nccl={report['nccl_profile']}" if gpus else ""),
        f"{report['parameters'] / 1e6:.1f}M parameters, batch {report['batch_per_process']} per "
        f"process, {report['precision']}; {report['pairs']} pairs of {report['timed_steps']} timed "
        f"steps after {report['warmup_steps']}, in windows of {report.get('window_steps', 10)}; "
        f"overrides: {' '.join(report['overrides']) or 'none'}",
        "",
        "median (min-max) over the pairs",
    ]
    sizes = list(report["step_ms"])
    lines.append(f"{'':<22}" + "".join(f"{on(int(size)):>26}" for size in sizes))
    for loop in ("reference", "template"):
        row = [cell(spread(report["step_ms"][size][loop])) for size in sizes]
        lines.append(f"{loop + ' step ms':<22}" + "".join(f"{c:>26}" for c in row))
    ratios = [cell(report["template_over_reference"][size]) for size in sizes]
    lines.append(f"{'template / reference':<22}" + "".join(f"{c:>26}" for c in ratios))
    for loop in ("reference", "template") if report.get("mfu") else ():
        row = [cell(report["mfu"][size][loop]) for size in sizes]
        lines.append(f"{loop + ' MFU':<22}" + "".join(f"{c:>26}" for c in row))
    if "scaling_efficiency" in report:
        efficiency = report["scaling_efficiency"]
        allreduce_figures = report["gradient_allreduce"]
        lines += [
            "",
            f"scaling efficiency 1 -> {n}: template {cell(efficiency['template'])}, "
            f"reference {cell(efficiency['reference'])}",
            f"all-reduce of the gradients ({allreduce_figures['mib']:.0f} MiB fp32): "
            f"{allreduce_figures['time_ms']:.2f} ms, "
            f"{allreduce_figures['busbw_gbps']:.1f} GB/s bus bandwidth; "
            f"the {n}-{'GPU' if gpus else 'process'} step is "
            f"{report['exposed_comm_ms']:.2f} ms longer than one "
            f"({report['comm_hidden_share']:.0%} of the all-reduce hidden)",
        ]
    cadence = report.get("cadence")
    if cadence and report.get("goodput") is not None:
        every = cadence["every_steps"]
        costs = [
            f"a {what} every {every[what]} steps holds training {cadence[f'{what}_s']:.3f} s"
            for what in ("checkpoint", "validation")
            if every[what]
        ]
        lines += [
            "",
            f"steady-state goodput at this config's cadence on {on(n)}: {report['goodput']:.3f} "
            f"({'; '.join(costs)}; measured every {cadence['between_steps']} steps)",
        ]
    first = report.get("first_step")
    if first:
        lines += [
            "",
            "the first step of a fresh process on 1 GPU (and from the process's start):",
            *(
                f"  {when.replace('_', ' ')}: {step['seconds']:.1f} s "
                f"({step['after_launch_s']:.1f} s), {step['compiled']}"
                for when, step in first.items()
            ),
        ]
    if report.get("first_step_failed"):
        lines += ["", f"the first steps were not measured: {report['first_step_failed']}"]
    lines += [f"noise: {note}" for note in report["noise"]]
    return "\n".join(lines)


# --- the command ----------------------------------------------------------------------------


def run_workers(args: argparse.Namespace, nproc: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        timing = [
            "--pairs",
            str(args.pairs),
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
        ]
        return launched(args, nproc, ["--worker", scratch, *timing])


def first_steps(args: argparse.Namespace) -> dict:
    """A compiling run's first step in a fresh process on one GPU, cold (an empty cache), then
    from the cache the first one filled: what a rescheduled pod waits for, with and without the
    cache beside its runs."""
    with tempfile.TemporaryDirectory(prefix="bench-first-step-") as scratch:
        cold = launched(args, 1, ["--first-step", scratch])
        return {"cold": cold, "from_cache": launched(args, 1, ["--first-step", scratch])}


def launched(args: argparse.Namespace, nproc: int, worker: list[str]) -> dict:
    """The workers under torchrun, with `worker`'s arguments: the result line of rank 0."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        f"{PACKAGE}.bench",
        *worker,
        *args.overrides,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        raise BenchFailed(f"no result within {args.timeout_s:g} s") from None
    found = RESULT_LINE.search(done.stdout)
    if done.returncode != 0 or not found:
        raise BenchFailed(f"exit {done.returncode}: {root_cause(done.stdout + done.stderr)}")
    return json.loads(found.group(1))


def unwritable(path: Path) -> str | None:
    """Why the figures could not be written to `path`, found before an hour of benchmarking
    rather than after it; None when they can."""
    if path.is_dir():
        return "it is a directory"
    folder = path.parent
    if not folder.is_dir():
        return f"{folder}/ does not exist"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".bench-"):
            pass
        if path.exists():
            with path.open("a"):
                pass
    except OSError as err:
        return err.strerror or str(err)
    return None


def main() -> int:
    parser = Parser(
        prog=f"{PACKAGE}.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pairs", type=at_least(1), default=5, help="template/reference pairs")
    parser.add_argument(
        "--warmup", type=at_least(0), default=25, help="untimed steps, in whole log windows"
    )
    parser.add_argument(
        "--steps", type=at_least(1), default=50, help="timed steps, in whole log windows"
    )
    parser.add_argument(
        "--json", type=Path, default=Path("bench.json"), help="where the figures go"
    )
    parser.add_argument("--timeout-s", type=seconds, default=1800, help="for each launch")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # its scratch dir
    parser.add_argument("--first-step", type=Path, help=argparse.SUPPRESS)  # its scratch dir
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train")
    args = parser.parse_args()
    if args.worker:
        worker(args.overrides, args.worker, args.pairs, args.warmup, args.steps)
        return Exit.OK
    if args.first_step:
        first_step_worker(args.overrides, args.first_step)
        return Exit.OK
    problem = unwritable(args.json)
    if problem:
        parser.exit(
            2, f"{parser.prog}: --json {args.json}: cannot write the figures there: {problem}\n"
        )
    nproc = torch.cuda.device_count() if torch.cuda.is_available() else 2
    try:  # as the workers will see it
        cfg = check.compose_and_check(args.overrides, world=World(size=nproc, local_size=nproc))
    except check.CONFIG_ERRORS as err:
        return check.refused(err)
    try:
        report = figures(run_workers(args, nproc))
        # Only a compile makes a first step long; on a CPU nothing compiles.
        if compilation.compiles(cfg, torch.device("cuda" if torch.cuda.is_available() else "cpu")):
            try:
                report["first_step"] = first_steps(args)
            except BenchFailed as failure:  # the pairs' figures stand
                report["first_step_failed"] = str(failure)
    except BenchFailed as failure:
        print(f"bench failed: {failure}", file=sys.stderr)
        return Exit.FAILED
    except KeyboardInterrupt:
        print("bench: stopped by Ctrl-C; nothing was measured to the end", file=sys.stderr)
        return Exit.INTERRUPTED
    print(render(report))
    try:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    except OSError as err:  # writable when checked: the table above is what is left
        print(f"bench: could not write {args.json}: {err.strerror or err}", file=sys.stderr)
        return Exit.FAILED
    print(f"\nfigures: {args.json}")
    return Exit.OK


if __name__ == "__main__":
    sys.exit(main())

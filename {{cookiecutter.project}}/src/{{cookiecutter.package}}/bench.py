"""Measure the training step: on 1 GPU, on all local GPUs, and against a minimal hand-written loop.

    python -m {{ cookiecutter.package }}.bench                                 # the default model
    python -m {{ cookiecutter.package }}.bench experiment=mlp_134m             # the 134M-parameter bench model
    python -m {{ cookiecutter.package }}.bench experiment=mlp_134m nccl=pcie_safe --json pcie_safe.json
    python -m {{ cookiecutter.package }}.bench experiment=mlp_134m dist.bucket_cap_mb=25 --steps 100

Every measurement but one is a real training launch (`torchrun -m {{ cookiecutter.package }}.train` with the
overrides given, checkpoints off), timed by its own metrics: the median step time of the windows
after the warm-up.
  - 1 process, then one per local GPU (2 CPU processes without CUDA): step time, samples/s, and
    the scaling efficiency, N-process samples/s over N times the 1-process samples/s.
  - All GPUs again with dist.comm_hook=noop: the same step with no gradient communication. The
    difference is the communication the step does not hide ("exposed").
  - A minimal hand-written loop (the model, the same optimizer and autocast, batches already on
    the device, nothing else) in 1 process: the template's overhead ratio.
  - The all-reduce bus bandwidth at the gradients' size, under the same NCCL settings.
It prints a table and writes every figure as JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from {{ cookiecutter.package }} import check, doctor, nccl, probe
from {{ cookiecutter.package }}.config import TrainConfig, uses_cuda
from {{ cookiecutter.package }}.model import build_model
from {{ cookiecutter.package }}.train import AUTOCAST

PACKAGE = __package__
WINDOW = 10  # steps per timing window: train's log_every here
MINIMAL_LINE = re.compile(r"^BENCH (\[.*\])$", re.MULTILINE)


class BenchFailed(RuntimeError):
    """A launch of the bench failed; the message says which and how."""


def tail(text: str, lines: int = 12) -> str:
    """The first exception a worker raised if there is one (torchrun's own summary follows it and
    says little), else the last lines."""
    raised = re.search(
        r"^(?:\[rank\d+\]: )?(?:\w+\.)*\w+(?:Error|Exception): .*$", text, re.MULTILINE
    )
    return raised.group(0) if raised else "\n".join(text.strip().splitlines()[-lines:])


def run(command: list[str], what: str, timeout_s: float, env: dict | None = None) -> str:
    try:
        done = subprocess.run(
            command, env={**os.environ, **(env or {})}, capture_output=True, text=True,
            timeout=timeout_s,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise BenchFailed(f"{what}: no result within {timeout_s:g} s") from None
    if done.returncode != 0:
        raise BenchFailed(f"{what}: exit {done.returncode}\n{tail(done.stdout + done.stderr)}")
    return done.stdout + done.stderr


def summary(window_ms: list[float], samples_per_step: int) -> dict:
    step_ms = statistics.median(window_ms)
    return {
        "step_time_ms": round(step_ms, 3),
        "samples_per_s": round(samples_per_step / step_ms * 1e3, 1),
        "window_step_ms": [round(ms, 3) for ms in window_ms],
    }


def train_windows(
    overrides: list[str], nproc: int, run_dir: Path, warmup: int, steps: int, timeout_s: float
) -> list[float]:
    """Step times (ms) of the timing windows after the warm-up, from train's own metrics."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", f"{PACKAGE}.train", *overrides,
               f"trainer.max_steps={warmup + steps}", f"trainer.log_every={WINDOW}",
               "trainer.checkpoint_every=0", f"hydra.run.dir={run_dir}"]  # fmt: skip
    run(command, f"training with {nproc} process(es)", timeout_s)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["step_time_ms"] for row in rows if row["step"] > warmup]


def minimal_windows(cfg: TrainConfig, warmup: int, steps: int) -> list[float]:
    """The same step with nothing around it: what a hand-written script for this model does."""
    cuda = uses_cuda(cfg.dist.backend)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model, cfg.data).to(device)
    forward = torch.compile(model) if cfg.trainer.compile else model
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay,
        fused=(cfg.trainer.fused_optimizer and cuda) or None,
    )  # fmt: skip
    dtype = AUTOCAST.get(cfg.trainer.precision) if cuda else None
    batch, accumulation = cfg.data.batch_size, cfg.trainer.grad_accumulation
    batches = [
        (torch.randn(batch, cfg.data.num_features, device=device),
         torch.randint(cfg.data.num_classes, (batch,), device=device))
        for _ in range(8)
    ]  # fmt: skip
    windows = []
    for _ in range((warmup + steps) // WINDOW):
        sync()
        started = time.perf_counter()
        for step in range(WINDOW):
            for micro in range(accumulation):
                inputs, labels = batches[(step * accumulation + micro) % len(batches)]
                with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                    loss = F.cross_entropy(forward(inputs), labels)
                (loss / accumulation).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        sync()
        windows.append((time.perf_counter() - started) / WINDOW * 1e3)
    return windows[warmup // WINDOW :]


def gradient_allreduce(
    cfg: TrainConfig, profile: str, nproc: int, gradient_bytes: int, timeout_s: float
) -> dict:
    """Bus bandwidth of one all-reduce the size of the gradients, under the NCCL settings that
    training would use here, and the time it takes."""
    facts = probe.probe_node() if cfg.nccl.auto else probe.basic_facts()
    env = nccl.decide(cfg.nccl, facts, os.environ).env if uses_cuda(cfg.dist.backend) else {}
    size_mib = max(1, round(gradient_bytes / 2**20))
    result = doctor.run_profile(profile, env, nproc, [size_mib], timeout_s)
    if result.result != "works":
        raise BenchFailed(f"all-reduce under nccl={profile}: {result.result} {result.error}")
    busbw = result.busbw_gbps[f"{size_mib}MiB"]
    algbw = busbw * nproc / (2 * (nproc - 1))  # bus bandwidth back to bytes per second moved
    return {
        "size_mib": size_mib,
        "busbw_gbps": busbw,
        "time_ms": round(gradient_bytes / (algbw * 1e9) * 1e3, 3),
        "env": env,
    }


def bench(
    cfg: TrainConfig, overrides: list[str], nproc: int, warmup: int, steps: int, timeout_s: float
) -> dict:
    cuda = torch.cuda.is_available()
    profile = check.choice("nccl", overrides)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in build_model(cfg.model, cfg.data).parameters())
    per_step = cfg.data.batch_size * cfg.trainer.grad_accumulation
    report: dict = {
        "overrides": overrides,
        "device": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
        "processes": nproc,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "nccl_profile": profile if cuda else None,
        "parameters": parameters,
        "batch_per_process": per_step,
        "precision": cfg.trainer.precision.value if cuda else "fp32",
        "warmup_steps": warmup,
        "timed_steps": steps,
        "runs": {},
    }
    runs = report["runs"]
    minimal = run(
        [sys.executable, "-m", f"{PACKAGE}.bench", "--minimal", "--warmup", str(warmup),
         "--steps", str(steps), *overrides],
        "the minimal loop", timeout_s, env={"WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"},
    )  # fmt: skip
    runs["minimal_1"] = summary(json.loads(MINIMAL_LINE.search(minimal).group(1)), per_step)
    with tempfile.TemporaryDirectory(prefix="bench-") as scratch:
        launches = [("template_1", 1, []), (f"template_{nproc}", nproc, [])]
        if nproc > 1:
            launches.append((f"no_grad_sync_{nproc}", nproc, ["dist.comm_hook=noop"]))
        for name, n, extra in launches:
            windows = train_windows(
                [*overrides, *extra], n, Path(scratch) / name, warmup, steps, timeout_s
            )
            runs[name] = summary(windows, per_step * n)
    one, many = runs["template_1"], runs[f"template_{nproc}"]
    report["overhead_ratio"] = round(one["step_time_ms"] / runs["minimal_1"]["step_time_ms"], 3)
    if nproc > 1:
        report["scaling_efficiency"] = round(
            many["samples_per_s"] / (nproc * one["samples_per_s"]), 3
        )
        exposed = many["step_time_ms"] - runs[f"no_grad_sync_{nproc}"]["step_time_ms"]
        report["exposed_comm_ms"] = round(exposed, 3)
        report["exposed_comm_share"] = round(exposed / many["step_time_ms"], 3)
        allreduce = gradient_allreduce(cfg, profile, nproc, parameters * 4, timeout_s)
        report["gradient_allreduce"] = allreduce
        report["comm_hidden_share"] = round(max(0.0, 1 - exposed / allreduce["time_ms"]), 3)
    return report


def render(report: dict) -> str:
    runs, n = report["runs"], report["processes"]

    def on(count: int) -> str:
        if report["nccl"]:
            return f"{count} GPU" + ("s" if count > 1 else "")
        return f"{count} CPU process" + ("es" if count > 1 else "")

    lines = [
        f"{report['device']}, torch {report['torch']}"
        + (f", NCCL {report['nccl']}, nccl={report['nccl_profile']}" if report["nccl"] else ""),
        f"{report['parameters'] / 1e6:.1f}M parameters, batch {report['batch_per_process']} per "
        f"process, {report['precision']}; {report['timed_steps']} timed steps after "
        f"{report['warmup_steps']}; overrides: {' '.join(report['overrides']) or 'none'}",
        "",
    ]
    labels = {
        "minimal_1": f"minimal loop, {on(1)}",
        "template_1": f"template, {on(1)}",
        f"template_{n}": f"template, {on(n)}",
        f"no_grad_sync_{n}": f"template, {on(n)}, no grad sync",
    }
    width = max(map(len, labels.values())) + 2
    lines.append(f"{'run':<{width}}{'step ms':>9}{'samples/s':>12}")
    for key, label in labels.items():
        if key in runs:
            row = runs[key]
            lines.append(f"{label:<{width}}{row['step_time_ms']:9.2f}{row['samples_per_s']:12,.0f}")
    lines += ["", f"overhead ratio (template / minimal, {on(1)}): {report['overhead_ratio']:.3f}"]
    if "scaling_efficiency" in report:
        allreduce = report["gradient_allreduce"]
        lines += [
            f"scaling efficiency (1 -> {n}): {report['scaling_efficiency']:.3f}",
            f"gradient all-reduce ({allreduce['size_mib']} MiB): {allreduce['busbw_gbps']:.1f} GB/s "
            f"bus bandwidth, {allreduce['time_ms']:.2f} ms",
            f"exposed communication: {report['exposed_comm_ms']:.2f} ms, "
            f"{report['exposed_comm_share']:.0%} of the {n}-process step; "
            f"{report['comm_hidden_share']:.0%} of the all-reduce time is hidden",
        ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--warmup", type=int, default=30, help="steps before timing (rounded up to 10s)"
    )
    parser.add_argument("--steps", type=int, default=60, help="timed steps (rounded up to 10s)")
    parser.add_argument(
        "--json", type=Path, default=Path("bench.json"), help="where to write the figures"
    )
    parser.add_argument("--timeout-s", type=float, default=600, help="per launch")
    parser.add_argument("--minimal", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train")
    args = parser.parse_args()
    warmup = -(-max(0, args.warmup) // WINDOW) * WINDOW
    steps = -(-max(1, args.steps) // WINDOW) * WINDOW
    if args.minimal:
        windows = minimal_windows(check.load_config(args.overrides), warmup, steps)
        print("BENCH " + json.dumps(windows), flush=True)
        return 0
    nproc = probe.gpu_count() if torch.cuda.is_available() else 2
    os.environ["WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"] = str(nproc)  # as train will see it
    cfg = check.load_or_exit(args.overrides)
    try:
        report = bench(cfg, args.overrides, nproc, warmup, steps, args.timeout_s)
    except BenchFailed as failure:
        print(f"bench failed: {failure}", file=sys.stderr)
        return 1
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    print(f"\nfigures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Rank 0's record of a run, in its run dir: metrics.csv and metrics.jsonl, TensorBoard events,
a progress bar on a terminal (log lines elsewhere), and metrics.png at the end.

    tensorboard --logdir outputs                        # every run under outputs/ (make tensorboard)
    python -m {{ cookiecutter.package }}.metrics outputs/<run>          # redraw <run>/metrics.png
"""

import argparse
import csv
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

log = logging.getLogger(__name__)

COLUMNS = [
    "step", "max_steps", "epoch", "loss", "accuracy", "lr", "samples_per_s", "step_time_ms",
    "comm_share", "world_size",
]  # fmt: skip
TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "accuracy": "train/accuracy",
    "lr": "train/lr",
    "samples_per_s": "perf/samples_per_s",
    "step_time_ms": "perf/step_time_ms",
    "comm_share": "perf/comm_share",
}


class CommTimer:
    """A DDP comm hook around the chosen one that, on an armed step, notes when each gradient
    bucket's all-reduce starts and ends. comm_share is the part of that step with an all-reduce
    in flight, first start to last end: overlapped with the backward pass or not."""

    def __init__(self, hook: Any | None, device: torch.device) -> None:
        self.inner = hook or default_hooks.allreduce_hook
        self.cuda = device.type == "cuda"
        self.armed = False
        self.marks: list[Any] = []  # step start, bucket starts and ends, step end

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: for a callback, one that waits for the work
        return event

    def hook(
        self, state: Any, bucket: dist.GradBucket
    ) -> torch.futures.Future[torch.Tensor]:  # DDP checks these annotations
        """For DDP.register_comm_hook."""
        if not self.armed:
            return self.inner(state, bucket)
        start = self.mark()
        future = self.inner(state, bucket)

        def finished(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self.marks.append((start, self.mark()))
            return done.value()

        return future.then(finished)

    def arm(self) -> None:
        self.armed, self.marks = True, [self.mark()]

    def share(self) -> float | None:
        """After the armed step: the fraction of it with an all-reduce in flight (None if the
        step was not armed)."""
        if not self.armed:
            return None
        self.armed, marks = False, self.marks
        self.marks = []
        step_start, buckets, step_end = marks[0], marks[1:], self.mark()
        if not buckets:
            return 0.0
        if self.cuda:
            step_end.synchronize()
            elapsed = step_start.elapsed_time
            first, last = min(elapsed(s) for s, _ in buckets), max(elapsed(e) for _, e in buckets)
            return (last - first) / max(elapsed(step_end), 1e-9)
        first, last = min(s for s, _ in buckets), max(e for _, e in buckets)
        return (last - first) / max(step_end - step_start, 1e-9)


class RunRecord:
    """What rank 0 writes while it trains. Other ranks keep none (`enabled=False`)."""

    def __init__(self, run_dir: Path, max_steps: int, start_step: int, enabled: bool) -> None:
        self.run_dir, self.enabled = run_dir, enabled
        self.writer = self.progress = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run starts again after its checkpoint: forget what was logged past it.
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=start_step + 1)
        kept = [row for row in read_raw_rows(run_dir) if float(row["step"]) <= start_step]
        self.csv_file = (run_dir / "metrics.csv").open("w", newline="")
        self.csv = csv.DictWriter(self.csv_file, fieldnames=COLUMNS)
        self.csv.writeheader()
        self.csv.writerows(kept)
        self.csv_file.flush()
        jsonl = run_dir / "metrics.jsonl"
        lines = jsonl.read_text().splitlines() if jsonl.exists() else []
        jsonl.write_text(
            "".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= start_step)
        )
        if sys.stdout.isatty():
            self.progress = ProgressBar(max_steps, start_step)

    def __enter__(self) -> "RunRecord":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, step: int) -> None:
        if self.progress:
            self.progress.advance(step)

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        comm = "n/a" if row["comm_share"] is None else f"{100 * row['comm_share']:.0f}%"
        log.info(
            "step %d/%d  loss %.4f  acc %.3f  %.0f samples/s  %.1f ms/step  comm %s",
            row["step"], row["max_steps"], row["loss"], row["accuracy"], row["samples_per_s"],
            row["step_time_ms"], comm,
        )  # fmt: skip
        with (self.run_dir / "metrics.jsonl").open("a") as out:
            out.write(json.dumps(row) + "\n")
        self.csv.writerow(row)
        self.csv_file.flush()
        for key, tag in TENSORBOARD_TAGS.items():
            if row[key] is not None:  # comm_share with dist.time_comm=false
                self.writer.add_scalar(tag, row[key], global_step=row["step"])
        self.writer.flush()  # a run that dies keeps its events
        if self.progress:
            self.progress.show(row)

    def close(self) -> None:
        """Once: stop the bar, close the files."""
        if not self.enabled:
            return
        self.enabled = False
        if self.progress:
            self.progress.stop()
        self.writer.close()
        self.csv_file.close()


class ProgressBar:
    """A rich progress bar; the run's log lines (Hydra's console handler) print above it."""

    def __init__(self, max_steps: int, start_step: int) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
        )  # fmt: skip
        self.bar.start()  # sys.stdout is now the bar's proxy: point the log handlers at it
        self.streams = {
            handler: handler.setStream(sys.stdout)  # returns the stream it replaces
            for handler in logging.getLogger().handlers
            if isinstance(handler, logging.StreamHandler)
            and getattr(handler.stream, "isatty", lambda: False)()
        }
        self.task = self.bar.add_task("train", total=max_steps, completed=start_step, status="")

    def advance(self, step: int) -> None:
        self.bar.update(self.task, completed=step)

    def show(self, row: dict[str, Any]) -> None:
        status = f"loss {row['loss']:.4f}  {row['samples_per_s']:,.0f} samples/s"
        self.bar.update(self.task, status=status)

    def stop(self) -> None:
        self.bar.stop()
        for handler, stream in self.streams.items():
            handler.setStream(stream)


def plot_and_log(run_dir: Path) -> None:
    """metrics.png at the end of a run; a failure to draw it is a warning, the run is saved."""
    try:
        path = plot_metrics(run_dir)
    except Exception as err:
        log.warning("no metrics.png: %s: %s", type(err).__name__, err)
        return
    if path:
        log.info("plot %s", path.relative_to(run_dir))


def read_raw_rows(run_dir: Path) -> list[dict[str, str]]:
    """metrics.csv's rows as written, so that a rewrite keeps them as they were."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    with path.open(newline="") as rows:
        return list(csv.DictReader(rows))


def read_rows(run_dir: Path) -> list[dict[str, float | None]]:
    return [
        {key: float(value) if value else None for key, value in row.items()}
        for row in read_raw_rows(run_dir)
    ]


def plot_metrics(run_dir: Path) -> Path | None:
    """metrics.png: the loss and the throughput against the step. None without any rows."""
    rows = read_rows(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display in a pod
    from matplotlib import pyplot as plt

    steps = [row["step"] for row in rows]
    figure, (loss, speed) = plt.subplots(2, 1, sharex=True, figsize=(7, 6), layout="constrained")
    loss.plot(steps, [row["loss"] for row in rows], marker=".")
    loss.set(ylabel="loss", yscale="log", title=run_dir.name)
    speed.plot(steps, [row["samples_per_s"] for row in rows], marker=".", color="tab:green")
    speed.set(xlabel="step", ylabel="samples/s")
    for axes in (loss, speed):
        axes.grid(alpha=0.3)
    path = run_dir / "metrics.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="a run dir with metrics.csv")
    run_dir = parser.parse_args().run_dir
    path = plot_metrics(run_dir)
    if path is None:
        print(f"{run_dir}: no metrics.csv with rows", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

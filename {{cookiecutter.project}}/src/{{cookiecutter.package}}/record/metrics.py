"""Rank 0's record of a run, in its run dir: metrics.csv and metrics.jsonl, TensorBoard events,
a progress bar on a terminal (log lines elsewhere), and metrics.png at the end.

    tensorboard --logdir outputs                 # every run under outputs/ (make tensorboard)
    python -m {{ cookiecutter.package }}.metrics outputs/<run>  # redraw its metrics.png (main)
"""

import argparse
import csv
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from .. import PROJECT
from ..core.exits import Exit
from ..core.files import write_atomically
from . import loggers

log = logging.getLogger(__name__)

COLUMNS = [
    "step",
    "max_steps",
    "epoch",
    "loss",
    "accuracy",
    "grad_norm",
    "lr",
    "samples_per_s",
    "step_time_ms",
    "comm_share",
    "world_size",
    # tokens/s over all ranks; MFU (perf.py: empty on a CPU or a GPU not in its table); rank 0's
    # peak of allocated GPU memory over the window (empty on a CPU)
    "tokens_per_s",
    "mfu",
    "peak_memory_gib",
    # on the held-out data, at the steps trainer.val_every names (empty at the others); how long
    # scoring it took (left out of samples_per_s and step_time_ms)
    "val_loss",
    "val_accuracy",
    "val_time_s",
    # what checkpoints held training up in the window (a snapshot, or a wait for the last write),
    # left out of samples_per_s and step_time_ms
    "checkpoint_s",
    # trainer.ema_decay's: the moving average of the weights scored as val_loss is (empty without)
    "val_loss_ema",
]


class RunRecord:
    """What rank 0 writes while it trains. Other ranks keep none (`enabled=False`)."""

    def __init__(
        self,
        run_dir: Path,
        max_steps: int,
        start_step: int,
        enabled: bool,
        logger: Any,
        config: dict[str, Any],
    ) -> None:
        self.run_dir, self.enabled = run_dir, enabled
        self.logger = self.progress = None
        if not enabled:
            return
        # Hydra makes the run dir, but a caller without Hydra (bench) may hand over a new one.
        run_dir.mkdir(parents=True, exist_ok=True)
        # A logger that cannot start raises LoggerError, on rank 0 alone: train ends on it at
        # once, before the other ranks' first all-reduce times out.
        self.logger = loggers.build(logger, run_dir, start_step, config)
        # A resumed run starts again after its checkpoint: forget what was logged past it. Each
        # file is replaced whole, so that a kill during the rewrite leaves the old one.
        kept = [row for row in read_raw_rows(run_dir) if float(row["step"]) <= start_step]
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(kept)
        replace(run_dir / "metrics.csv", table.getvalue())
        jsonl = [line for line, row in read_jsonl(run_dir) if row["step"] <= start_step]
        replace(run_dir / "metrics.jsonl", "".join(f"{line}\n" for line in jsonl))
        self.csv_file = (run_dir / "metrics.csv").open("a", newline="")
        self.csv = csv.DictWriter(self.csv_file, fieldnames=COLUMNS)
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
        line = (
            f"step {row['step']}/{row['max_steps']}  loss {row['loss']:.4f}  "
            f"acc {row['accuracy']:.3f}  lr {row['lr']:.3g}  {row['samples_per_s']:.0f} samples/s  "
            f"{row['step_time_ms']:.1f} ms/step"
        )
        if row["grad_norm"] is not None:
            line += f"  grad norm {row['grad_norm']:.3g}"
        if row["comm_share"] is not None:
            line += f"  comm {100 * row['comm_share']:.0f}%"
        if row["tokens_per_s"] != row["samples_per_s"]:  # a model whose sample is one token: once
            line += f"  {row['tokens_per_s']:,.0f} tok/s"
        if row["mfu"] is not None:
            line += f"  MFU {100 * row['mfu']:.1f}%"
        if row["peak_memory_gib"] is not None:
            line += f"  peak mem {row['peak_memory_gib']:.1f} GiB"
        if row["val_loss"] is not None:
            line += (
                f"  val loss {row['val_loss']:.4f}  val acc {row['val_accuracy']:.3f} "
                f"({row['val_time_s']:.2f} s)"
            )
        if row.get("val_loss_ema") is not None:
            line += f"  EMA val loss {row['val_loss_ema']:.4f}"
        log.info(line)
        with (self.run_dir / "metrics.jsonl").open("a") as out:
            out.write(json.dumps(row) + "\n")
        self.csv.writerow(row)
        self.csv_file.flush()
        self.logger.log(row)
        if self.progress:
            self.progress.show(row)

    def close(self) -> None:
        """Once: stop the bar, close the files."""
        if not self.enabled:
            return
        self.enabled = False
        if self.progress:
            self.progress.stop()
        self.logger.close()
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
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
        )
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


def save_config(config: Any, run_dir: Path, overrides: list[str]) -> None:
    """The config this run uses, every value resolved, in <run dir>/config.yaml; the log names
    the file and what differs from the defaults (the overrides), not the whole of it."""
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(config)))
    changed = " ".join(overrides) if overrides else "none: the defaults"
    log.info("config: %s; overrides: %s", run_dir / "config.yaml", changed)


def plot_and_log(run_dir: Path) -> None:
    """metrics.png at the end of a run; a failure to draw it is a warning, the run is saved."""
    try:
        path = plot_metrics(run_dir)
    except Exception as err:
        log.warning("no metrics.png: %s: %s", type(err).__name__, err)
        return
    if path:
        log.info("plot %s", path.relative_to(run_dir))


def replace(path: Path, text: str) -> None:
    """Write `path` whole: a new file renamed over the old one."""
    write_atomically(path, text)


def warn_unreadable(path: Path, numbers: list[int], total: int) -> None:
    """A kill in the middle of a write leaves the last line cut short; the run goes on
    without it."""
    if numbers == [total]:
        what = f"its last line ({total}) is cut short, as a run killed while writing it leaves it"
    else:
        what = f"line(s) {', '.join(map(str, numbers))} of {total} cannot be read"
    log.warning("%s: %s; left out", path, what)


def number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


def read_raw_rows(run_dir: Path) -> list[dict[str, str]]:
    """metrics.csv's rows as written, so that a rewrite keeps them as they were: one per known
    column. A row that is cut short or not numbers is left out, with a warning."""
    path = run_dir / "metrics.csv"
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    if not lines:
        return []
    header = next(csv.reader([lines[0]]), [])
    rows, unreadable = [], []
    for line_number, line in enumerate(lines[1:], start=2):
        values = next(csv.reader([line]), [])
        row = dict(zip(header, values, strict=False))  # the lengths are checked next
        if (
            len(values) != len(header)
            or not row.get("step")
            or not all(number(value) for value in values if value)
        ):
            unreadable.append(line_number)
            continue
        rows.append({column: row.get(column, "") for column in COLUMNS})
    if unreadable:
        warn_unreadable(path, unreadable, len(lines))
    return rows


def read_jsonl(run_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """metrics.jsonl's lines with their rows; one that is cut short is left out, with a warning."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    rows, unreadable = [], []
    for line_number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
            if not isinstance(row.get("step"), int):
                raise ValueError("no step")
        except (ValueError, AttributeError):
            unreadable.append(line_number)
            continue
        rows.append((line, row))
    if unreadable:
        warn_unreadable(path, unreadable, len(lines))
    return rows


def read_rows(run_dir: Path) -> list[dict[str, float | None]]:
    return [
        {key: float(value) if value else None for key, value in row.items()}
        for row in read_raw_rows(run_dir)
    ]


def best_val_loss(run_dir: Path) -> float | None:
    """The lowest val_loss of the run's rows (those before a resume too), or None without one:
    what train returns to a Hydra sweeper, which minimises it."""
    scores = [row["val_loss"] for row in read_rows(run_dir) if row.get("val_loss") is not None]
    return min(scores) if scores else None


def plot_metrics(run_dir: Path) -> Path | None:
    """metrics.png: the loss and the throughput against the step. None with fewer than 2 rows:
    one point draws no curve (and a short run skips matplotlib's second of start-up)."""
    rows = read_rows(run_dir)
    if len(rows) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display in a pod
    from matplotlib import pyplot as plt
    from matplotlib.ticker import FuncFormatter

    steps, losses = [row["step"] for row in rows], [row["loss"] for row in rows]
    figure, (loss, speed) = plt.subplots(2, 1, sharex=True, figsize=(7, 6), layout="constrained")
    loss.plot(steps, losses, marker=".", label="train")
    validated = [(row["step"], row["val_loss"]) for row in rows if row.get("val_loss") is not None]
    if validated:
        loss.plot(*zip(*validated, strict=True), marker="o", color="tab:orange", label="held out")
        loss.legend()
    # A log scale where the loss falls by more than 10x; ticks as plain numbers
    # (2.05, not 2.05 x 10^0).
    shown = losses + [value for _, value in validated]
    spread = max(shown) / min(shown) if min(shown) > 0 else 1
    loss.set(
        ylabel="loss",
        yscale="log" if spread > 10 else "linear",
        title=f"{PROJECT} · {run_dir.name}",
    )
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    loss.yaxis.set_major_formatter(plain)
    loss.yaxis.set_minor_formatter(plain if spread > 10 else FuncFormatter(lambda *_: ""))
    speed.plot(steps, [row["samples_per_s"] for row in rows], marker=".", color="tab:green")
    speed.set(xlabel="step", ylabel="samples/s")
    speed.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
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
        print(f"{run_dir}: nothing to draw: metrics.csv has fewer than 2 rows", file=sys.stderr)
        return Exit.CONFIG_ERROR
    print(path)
    return Exit.OK

"""What rank 0 records in the run dir, and how it shows progress: on CPU, 2 processes over gloo."""

import csv
import importlib.util
import json
import math
import os
import pty
import re
import runpy
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml
from conftest import (
    PACKAGE,
    launch,
    needs,
    read_metrics,
    shared_folder,
    torchrun,
    train_command,
)
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddp_project.config.loggers import CsvLoggerConfig, LoggersConfig
from ddp_project.record import loggers, metrics

RUN = ("trainer.max_steps=60", "trainer.log_every=20", "trainer.warmup_steps=40")
MEASURED = ("dist.time_comm=true", "trainer.max_grad_norm=1.0")  # the columns left empty by default
MEASURED_RUN = (*RUN, *MEASURED, "trainer.checkpoint_every=20")
# Every logger but csv at once (logger=csv is the one-process run's), as lightning-hydra-template
# users log: W&B offline, MLflow's file store in the run dir; those installed (make install-all).
LOGGED = ["tensorboard"] + [name for name in ("wandb", "mlflow") if importlib.util.find_spec(name)]
LOGGED_RUN = (*MEASURED_RUN, f"logger=[{','.join(LOGGED)}]")
BAR = "━"  # rich's bar


# A launch costs seconds of CPU: the tests that read the same kind of run share one (module
# fixtures), and copy it where they change it.

# Installed as sitecustomize: notes what the W&B run is given, then logs it for real, in every
# process that imports wandb (none that does not pays for its import): a call from rank 1
# would show.
RECORD_WANDB = """
import importlib.abc, importlib.util, json, os, sys


def _record(module):
    _log = module.Run.log

    def _recording_log(self, data, step=None, **kwargs):
        with open(os.environ["WANDB_RECORD"], "a") as out:
            out.write(json.dumps({"step": step, "data": data}) + "\\n")
        return _log(self, data, step=step, **kwargs)

    module.Run.log = _recording_log


class _OnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "wandb.sdk.wandb_run":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module
        spec.loader.exec_module = lambda module: (run_module(module), _record(module))
        return spec


sys.meta_path.insert(0, _OnImport())
"""


@pytest.fixture(scope="module")
def run(request):
    """One 2-process run without a terminal, every column measured, logging to TensorBoard, W&B
    and MLflow at once: its run dir, its output, and the W&B calls recorded."""
    tmp_path = shared_folder(request)
    run_dir = tmp_path / "run"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(RECORD_WANDB)
    calls = tmp_path / "calls.jsonl"
    env = {
        "PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}",
        "WANDB_RECORD": str(calls),
        "WANDB_SILENT": "true",
    }
    done = torchrun(tmp_path, *LOGGED_RUN, f"hydra.run.dir={run_dir}", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done.stdout + done.stderr, calls


@pytest.fixture(scope="module")
def default_run(request):
    """A 2-process run with the default logging, on a terminal: its run dir and what the terminal
    showed."""
    tmp_path = shared_folder(request)
    controller, terminal = pty.openpty()
    command = train_command(*RUN, f"hydra.run.dir={tmp_path / 'run'}")
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        env={**os.environ, "COLUMNS": "160"},
    )
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: every process has exited
            break
        if not chunk:
            break
        chunks.append(chunk)
    assert process.wait(timeout=240) == 0
    return tmp_path / "run", b"".join(chunks).decode(errors="replace")


@pytest.fixture(scope="module")
def one_process_csv(request) -> Path:
    """A run on one process with logger=csv: `python -m <package>.train`, without torchrun."""
    tmp_path = shared_folder(request)
    command = [
        sys.executable,
        "-m",
        f"{PACKAGE}.train",
        *RUN,
        "logger=csv",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / "run"


@pytest.fixture(scope="module")
def resumed(run, request) -> Path:
    """A copy of `run` without its step-60 checkpoint (as if the pod died after step 59),
    launched again to step 80: it resumes from step 40 and trains 41-60 a second time."""
    run_dir = shared_folder(request) / "run"
    shutil.copytree(run[0], run_dir)
    (run_dir / "checkpoints" / "step_000000060.pt").unlink()
    done = torchrun(
        run_dir.parent, *MEASURED_RUN[1:], "trainer.max_steps=80", f"hydra.run.dir={run_dir}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


def test_csv_and_jsonl_hold_the_same_rows(run):
    run_dir = run[0]
    with (run_dir / "metrics.csv").open(newline="") as rows:
        table = list(csv.DictReader(rows))
    assert list(table[0]) == metrics.COLUMNS
    jsonl = read_metrics(run_dir)
    assert [int(row["step"]) for row in table] == [row["step"] for row in jsonl] == [20, 40, 60]
    for row, same in zip(table, jsonl, strict=True):
        assert {key: float(value) if value else None for key, value in row.items()} == same


def test_rows_carry_learning_rate_throughput_gradient_norm_and_communication_share(run):
    rows = read_metrics(run[0])
    # linear warm-up over 40 steps to trainer.lr, then the default cosine down to min_lr at step 60
    assert [row["lr"] for row in rows] == pytest.approx([0.003 * 20 / 40, 0.003, 0.0003])
    assert "  lr 0.003  " in run[1] and "  lr 0.0003  " in run[1]
    assert all(row["samples_per_s"] > 0 and row["step_time_ms"] > 0 for row in rows)
    # gloo all-reduces on a thread of its own: some of every timed step has one in flight
    assert all(0 < row["comm_share"] <= 1 for row in rows)
    assert all(0 < row["grad_norm"] < 100 for row in rows)
    assert "grad norm" in run[1] and "comm" in run[1]
    # an MLP's sample is its token; on a CPU there is no peak to take a share of, nor GPU memory
    assert all(row["tokens_per_s"] == pytest.approx(row["samples_per_s"]) for row in rows)
    assert all(row["mfu"] is None and row["peak_memory_gib"] is None for row in rows)
    assert "MFU" not in run[1] and "tok/s" not in run[1]


def test_tensorboard_events_hold_every_scalar(run):
    events = EventAccumulator(str(run[0] / "tensorboard"))
    events.Reload()
    unmeasured_on_a_cpu = {"perf/mfu", "perf/peak_memory_gib"}
    no_ema = {"val/loss_ema"}  # trainer.ema_decay is null
    tags = set(loggers.TAGS.values()) - unmeasured_on_a_cpu - no_ema
    assert set(events.Tags()["scalars"]) == tags
    losses = events.Scalars("train/loss")
    assert [event.step for event in losses] == [20, 40, 60]
    assert losses[-1].value == pytest.approx(read_metrics(run[0])[-1]["loss"])


def test_the_plot_lands_in_the_run_dir(run):
    png = (run[0] / "metrics.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert "plot metrics.png" in (run[0] / "train.log").read_text()


def test_the_resolved_config_is_printed_and_saved(run, compose_train):
    run_dir, output, _ = run
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg = OmegaConf.to_object(compose_train(*LOGGED_RUN))
    assert saved == OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    assert saved["trainer"]["max_steps"] == 60 and saved["dist"]["time_comm"] is True
    overrides = " ".join(LOGGED_RUN)  # hydra.* settings are not the training config's
    assert f"config: {run_dir / 'config.yaml'}; overrides: {overrides}\n" in output
    assert "max_steps: 60" not in output  # the file holds the config, the log says where


def test_without_a_terminal_progress_is_log_lines(run):
    output = run[1]
    assert "step 40/60  loss" in output and "comm" in output
    assert BAR not in output


def test_on_a_terminal_rank_0_shows_a_progress_bar(default_run):
    output = default_run[1]
    assert BAR in output and "step 40/60  loss" in output  # the bar, and log lines above it
    assert (
        re.findall(r"\b(\d+)/60\b", output)[-1] == "60" and "Traceback" not in output
    )  # it ends finished


def test_a_resumed_run_appends_to_the_csv(resumed):
    lines = (resumed / "metrics.csv").read_text().splitlines()
    assert lines[0] == ",".join(metrics.COLUMNS) and lines.count(lines[0]) == 1
    assert [row["step"] for row in metrics.read_rows(resumed)] == [20, 40, 60, 80]


def test_raising_max_steps_on_a_resume_stretches_the_decay_and_says_so(resumed):
    """Resumed from step 40 with max_steps 80 for 60: the cosine from step 40 now ends at 80."""
    decay = [0.0003 + 0.0027 * (1 + math.cos(math.pi * done)) / 2 for done in (0.05, 0.025, 0.5)]
    assert [row["lr"] for row in read_metrics(resumed)] == pytest.approx(
        [0.0015, 0.003, decay[2], 0.0003]
    )
    assert (
        f"trainer.max_steps changed from 60 to 80: the learning rate at step 41 is {decay[1]:.3g}, "
        f"was {decay[0]:.3g}: the decay now ends at step 80"
    ) in (resumed / "train.log").read_text()


def test_one_process_has_no_communication(one_process_csv):
    assert all(row["comm_share"] == 0 for row in read_metrics(one_process_csv))


def plot_command(monkeypatch, capsys, run_dir: Path) -> tuple[int, str]:
    """`python -m <package>.metrics RUN_DIR`, run as __main__ in this process (matplotlib is
    imported here already): its exit code and stderr."""
    monkeypatch.setattr(sys, "argv", ["metrics", str(run_dir)])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited, warnings.catch_warnings():
        # runpy's note that the module is imported already: `python -m` runs a copy too
        warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
        runpy.run_module(f"{PACKAGE}.metrics", run_name="__main__")
    return exited.value.code, capsys.readouterr().err


def test_the_plot_command_redraws_and_refuses_an_empty_dir(run, tmp_path, monkeypatch, capsys):
    (run[0] / "metrics.png").unlink()
    code, _ = plot_command(monkeypatch, capsys, run[0])
    assert code == 0 and (run[0] / "metrics.png").exists()
    code, stderr = plot_command(monkeypatch, capsys, tmp_path)
    assert code == 2
    assert stderr == f"{tmp_path}: nothing to draw: metrics.csv has fewer than 2 rows\n"


def test_by_default_communication_and_gradient_norm_are_not_measured(default_run):
    """dist.time_comm=false and no clipping: DDP's built-in all-reduce, no Python hook and no
    pass over the gradients, so no figure to report."""
    run_dir = default_run[0]
    for rows in (read_metrics(run_dir), metrics.read_rows(run_dir)):
        assert all(row["comm_share"] is None and row["grad_norm"] is None for row in rows)
    progress = [
        line for line in (run_dir / "train.log").read_text().splitlines() if "  loss " in line
    ]
    assert len(progress) == 3 and progress[0].endswith(" ms/step")  # nothing after the step time
    # but at the last step the validation's figures (trainer.val_every)
    assert re.search(
        r" ms/step  val loss \d\.\d{4}  val acc 0\.\d{3} \(\d+\.\d\d s\)$", progress[-1]
    )
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    unmeasured_on_a_cpu = {"perf/mfu", "perf/peak_memory_gib", "val/loss_ema"}  # and no EMA
    assert set(events.Tags()["scalars"]) == set(loggers.TAGS.values()) - unmeasured_on_a_cpu - {
        "perf/comm_share",
        "train/grad_norm",
    }


def test_a_resume_from_an_older_checkpoint_logs_each_step_once(resumed):
    """Rows past the checkpoint were trained again: the CSV, the JSONL and TensorBoard keep one
    row per step, the second run's (its max_steps is 80)."""
    assert "resumed from the checkpoint of step 40" in (resumed / "train.log").read_text()
    assert [(row["step"], row["max_steps"]) for row in metrics.read_rows(resumed)] == [
        (20, 60),
        (40, 60),
        (60, 80),
        (80, 80),
    ]
    assert [row["step"] for row in read_metrics(resumed)] == [20, 40, 60, 80]
    events = EventAccumulator(str(resumed / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [20, 40, 60, 80]


def test_logger_csv_writes_no_event_files(one_process_csv):
    assert [row["step"] for row in read_metrics(one_process_csv)] == [20, 40, 60]
    assert not (one_process_csv / "tensorboard").exists()


@needs("wandb")
def test_three_loggers_at_once_each_get_every_row(run):
    """logger=[tensorboard,wandb,mlflow]: each gets every row, once (only rank 0 logs)."""
    run_dir, _, calls_file = run
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()]
    rows = read_metrics(run_dir)
    assert [call["step"] for call in calls] == [row["step"] for row in rows] == [20, 40, 60]
    assert [call["data"]["train/loss"] for call in calls] == [row["loss"] for row in rows]
    (offline,) = (run_dir / "wandb").glob("offline-run-*")  # written for `wandb sync`
    assert (offline / "run-run.wandb").stat().st_size > 0
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (row["step"], pytest.approx(row["loss"])) for row in rows
    ]


@needs("mlflow")
def test_logger_mlflow_file_store_holds_every_row(run, monkeypatch):
    import mlflow

    run_dir = run[0]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.tracking.MlflowClient((run_dir / "mlruns").as_uri())
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    history = client.get_metric_history(run_id, "train/loss")
    rows = read_metrics(run_dir)
    assert [(m.step, m.value) for m in history] == [(row["step"], row["loss"]) for row in rows]
    assert client.get_run(run_id).data.params["trainer.max_steps"] == "60"


# In-process: a RunRecord on files as a killed run leaves them (no launch).
HEADER = ",".join(metrics.COLUMNS)


def csv_row(step: int) -> str:
    return f"{step},60,0,{2.0 - step / 100},0.5,,0.003,900.0,3.5,,2,900.0,,,,,,0.0,"


def json_row(step: int) -> str:
    return json.dumps(
        dict(
            zip(
                metrics.COLUMNS,
                [
                    step,
                    60,
                    0,
                    2.0 - step / 100,
                    0.5,
                    None,
                    0.003,
                    900.0,
                    3.5,
                    None,
                    2,
                    900.0,
                    None,
                    None,
                    None,
                    None,
                    None,
                    0.0,
                    None,
                ],
                strict=True,
            )
        )
    )


def record(run_dir: Path, start_step: int) -> metrics.RunRecord:
    logger = LoggersConfig(csv=CsvLoggerConfig())
    return metrics.RunRecord(run_dir, 60, start_step, True, logger, {})


@pytest.mark.parametrize("cut", ["last", "middle"])
def test_a_resume_drops_a_row_cut_short_and_goes_on(tmp_path, caplog, cut):
    """A kill mid-write leaves half a row at the end: every relaunch used to die of
    JSONDecodeError (Kubernetes retries exit 1 until its backoff limit)."""
    csv_lines = [HEADER, csv_row(20), csv_row(40), csv_row(60)[:9]]
    json_lines = [json_row(20), json_row(40), json_row(60)[:25]]
    if cut == "middle":  # not expected, but no crash either
        csv_lines[1], json_lines[0] = csv_lines[1][:12], json_lines[0][:30]
        csv_lines[3], json_lines[2] = csv_row(60), json_row(60)
    (tmp_path / "metrics.csv").write_text("\n".join(csv_lines))  # no newline at the end: cut
    (tmp_path / "metrics.jsonl").write_text("\n".join(json_lines))
    with record(tmp_path, start_step=60) as run:
        run.write(json.loads(json_row(80)) | {"max_steps": 80})
    kept = [40, 60] if cut == "middle" else [20, 40]
    assert [row["step"] for row in metrics.read_rows(tmp_path)] == [*kept, 80]
    assert [row["step"] for row in read_metrics(tmp_path)] == [*kept, 80]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and all(message.endswith("; left out") for message in warned)
    assert warned[0].startswith(str(tmp_path / "metrics.csv"))
    assert warned[1].startswith(str(tmp_path / "metrics.jsonl"))
    if cut == "last":
        assert "its last line (4) is cut short" in warned[0]
        assert "its last line (3) is cut short" in warned[1]
    else:
        assert "line(s) 2 of 4 cannot be read" in warned[0]
        assert "line(s) 1 of 3 cannot be read" in warned[1]


def test_the_plot_skips_a_row_cut_short(tmp_path):
    (tmp_path / "metrics.csv").write_text("\n".join([HEADER, csv_row(20), csv_row(40), "60,6"]))
    assert [row["step"] for row in metrics.read_rows(tmp_path)] == [20, 40]
    assert metrics.plot_metrics(tmp_path) == tmp_path / "metrics.png"


def test_a_record_creates_a_run_dir_that_is_not_there(tmp_path):
    """bench hands each timed loop a new run dir: with logger=csv nothing else created it."""
    run_dir = tmp_path / "template-1-0"
    with record(run_dir, start_step=0) as run:
        run.write(json.loads(json_row(20)))
    # read back as written; the columns not measured (empty in the CSV) as None, not 0
    assert metrics.read_rows(run_dir) == read_metrics(run_dir) == [json.loads(json_row(20))]


def test_a_resume_keeps_the_rows_up_to_its_checkpoint_in_both_files(tmp_path):
    (tmp_path / "metrics.csv").write_text("\n".join([HEADER, *map(csv_row, (20, 40, 60))]) + "\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json_row(s) + "\n" for s in (20, 40, 60)))
    record(tmp_path, start_step=40).close()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [HEADER, csv_row(20), csv_row(40)]
    assert (tmp_path / "metrics.jsonl").read_text() == json_row(20) + "\n" + json_row(40) + "\n"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["metrics.csv", "metrics.jsonl"]


def test_a_resume_rewrites_a_read_only_metrics_file(tmp_path):
    """The files are replaced whole (a kill mid-rewrite keeps the old one): a read-only copy
    left by another user or a restore is replaced too, in a run dir this user may write."""
    (tmp_path / "metrics.csv").write_text("\n".join([HEADER, csv_row(20), csv_row(40)]) + "\n")
    (tmp_path / "metrics.csv").chmod(0o444)
    with record(tmp_path, start_step=20) as run:
        run.write(json.loads(json_row(40)))
    assert [row["step"] for row in metrics.read_rows(tmp_path)] == [20, 40]


def test_the_plot_draws_the_loss_and_the_throughput_against_the_step(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(
        Figure, "savefig", lambda self, *a, **k: (drawn.append(self), save(self, *a, **k))
    )
    held_out = {1: ",,", 20: "0.6,0.7,0.1", 40: "0.3,0.9,0.1"}  # val_loss, val_accuracy, val_time_s
    lines = [HEADER] + [
        f"{s},60,0,{10 / s},0.5,,0.003,{100.0 * s},3.5,,2,,,,{held_out[s]},0.0,"
        for s in (1, 20, 40)
    ]
    (tmp_path / "metrics.csv").write_text("\n".join(lines) + "\n")
    assert metrics.plot_metrics(tmp_path) == tmp_path / "metrics.png"
    (figure,) = drawn
    loss, speed = figure.axes
    assert loss.lines[0].get_xydata().tolist() == [[1, 10], [20, 0.5], [40, 0.25]]
    assert loss.lines[1].get_xydata().tolist() == [[20, 0.6], [40, 0.3]]  # the validations
    assert speed.lines[0].get_xydata().tolist() == [[1, 100], [20, 2000], [40, 4000]]
    assert loss.get_yscale() == "log"  # the loss fell 40x
    assert (tmp_path / "metrics.png").read_bytes().startswith(b"\x89PNG")


def test_a_kill_during_the_resume_rewrite_keeps_the_old_rows(tmp_path, monkeypatch):
    """The rewrite goes to a new file renamed over the old: a kill halfway loses nothing."""
    before = "\n".join([HEADER, csv_row(20), csv_row(40)]) + "\n"
    (tmp_path / "metrics.csv").write_text(before)

    write_atomically = metrics.write_atomically

    def killed_halfway(path, text, *args, **kwargs):
        def half(out):
            out.write(text[: len(text) // 2].encode())
            raise KeyboardInterrupt  # as a signal would, between two writes

        write_atomically(path, half, *args, **kwargs)

    monkeypatch.setattr(metrics, "write_atomically", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        record(tmp_path, start_step=20)
    monkeypatch.undo()
    assert (tmp_path / "metrics.csv").read_text() == before
    assert not list(tmp_path.glob(".partial-*"))  # nor the half-written new file


@pytest.mark.slow
@needs("mlflow")
def test_a_logger_that_cannot_start_ends_the_launch_in_one_line_from_rank_0(tmp_path, not_mlflow):
    """The check reaches the server; MLflow's start on rank 0 then fails. Rank 0 ends at once
    (train.end_before_the_others), before the other rank's first all-reduce gives up: one line,
    exit 2, no traceback, and no other rank's report."""
    done = launch(
        tmp_path,
        "--nproc-per-node",
        "2",
        "logger=mlflow",
        f"logger.mlflow.tracking_uri={not_mlflow}",
        "trainer.max_steps=3",
        "dist.timeout_s=60",
    )
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"config error: logger.mlflow: could not start ({not_mlflow}): ")

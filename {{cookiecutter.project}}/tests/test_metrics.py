"""What rank 0 records in the run dir, and how it shows progress: on CPU, 2 processes over gloo."""

import csv
import json
import os
import pty
import re
import subprocess
import sys

import pytest
import yaml
from conftest import PACKAGE, read_metrics, torchrun, train_command
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from {{ cookiecutter.package }} import loggers, metrics

RUN = ("trainer.max_steps=60", "trainer.log_every=20", "trainer.warmup_steps=40")
MEASURED = ("dist.time_comm=true", "trainer.max_grad_norm=1.0")  # the columns left empty by default
BAR = "━"  # rich's bar


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One 2-process run without a terminal, every column measured, and its output."""
    tmp_path = tmp_path_factory.mktemp("metrics")
    run_dir = tmp_path / "run"
    done = torchrun(tmp_path, *RUN, *MEASURED, f"hydra.run.dir={run_dir}")
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done.stdout + done.stderr


def test_csv_and_jsonl_hold_the_same_rows(run):
    run_dir, _ = run
    with (run_dir / "metrics.csv").open(newline="") as rows:
        table = list(csv.DictReader(rows))
    assert list(table[0]) == metrics.COLUMNS
    jsonl = read_metrics(run_dir)
    assert [int(row["step"]) for row in table] == [row["step"] for row in jsonl] == [20, 40, 60]
    for row, same in zip(table, jsonl, strict=True):
        assert {key: float(value) if value else None for key, value in row.items()} == same


def test_rows_carry_learning_rate_throughput_gradient_norm_and_communication_share(run):
    rows = read_metrics(run[0])
    # linear warm-up over 40 steps: the rate used by step s is min(1, s / 40) x trainer.lr
    assert [row["lr"] for row in rows] == pytest.approx([0.003 * 20 / 40, 0.003, 0.003])
    assert all(row["samples_per_s"] > 0 and row["step_time_ms"] > 0 for row in rows)
    # gloo all-reduces on a thread of its own: some of every timed step has one in flight
    assert all(0 < row["comm_share"] <= 1 for row in rows)
    assert all(0 < row["grad_norm"] < 100 for row in rows)
    assert "grad norm" in run[1] and "comm" in run[1]


def test_tensorboard_events_hold_every_scalar(run):
    events = EventAccumulator(str(run[0] / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(loggers.TAGS.values())
    losses = events.Scalars("train/loss")
    assert [event.step for event in losses] == [20, 40, 60]
    assert losses[-1].value == pytest.approx(read_metrics(run[0])[-1]["loss"])


def test_the_plot_lands_in_the_run_dir(run):
    png = (run[0] / "metrics.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert "plot metrics.png" in (run[0] / "train.log").read_text()


def test_the_resolved_config_is_printed_and_saved(run, compose_train):
    run_dir, output = run
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    cfg = OmegaConf.to_object(compose_train(*RUN, *MEASURED))
    assert saved == OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
    assert saved["trainer"]["max_steps"] == 60 and saved["dist"]["time_comm"] is True
    overrides = " ".join([*RUN, *MEASURED])  # hydra.* settings are not the training config's
    assert f"config: {run_dir / 'config.yaml'}; overrides: {overrides}\n" in output
    assert "max_steps: 60" not in output  # the file holds the config, the log says where


def test_without_a_terminal_progress_is_log_lines(run):
    _, output = run
    assert "step 40/60  loss" in output and "comm" in output
    assert BAR not in output


def test_on_a_terminal_rank_0_shows_a_progress_bar(tmp_path):
    controller, terminal = pty.openpty()
    command = train_command(*RUN, f"hydra.run.dir={tmp_path / 'run'}")
    process = subprocess.Popen(command, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=terminal,
                               stderr=terminal, env={**os.environ, "COLUMNS": "160"})  # fmt: skip
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
    assert process.wait(timeout=60) == 0
    output = b"".join(chunks).decode(errors="replace")
    assert BAR in output and "step 40/60  loss" in output  # the bar, and log lines above it
    assert (
        re.findall(r"\b(\d+)/60\b", output)[-1] == "60" and "Traceback" not in output
    )  # it ends finished


def test_a_resumed_run_appends_to_the_csv(run, tmp_path):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(run[0], run_dir)
    done = torchrun(
        tmp_path, *RUN[1:], *MEASURED, "trainer.max_steps=80", f"hydra.run.dir={run_dir}"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (run_dir / "metrics.csv").read_text().splitlines()
    assert lines[0] == ",".join(metrics.COLUMNS) and lines.count(lines[0]) == 1
    assert [row["step"] for row in metrics.read_rows(run_dir)] == [20, 40, 60, 80]


def test_one_process_has_no_communication(tmp_path):
    done = torchrun(tmp_path, *RUN, f"hydra.run.dir={tmp_path / 'run'}", nproc=1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(row["comm_share"] == 0 for row in read_metrics(tmp_path / "run"))


def test_the_plot_command_redraws_and_refuses_an_empty_dir(run, tmp_path):
    (run[0] / "metrics.png").unlink()
    done = subprocess.run([sys.executable, "-m", f"{PACKAGE}.metrics", str(run[0])],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and (run[0] / "metrics.png").exists()
    empty = subprocess.run([sys.executable, "-m", f"{PACKAGE}.metrics", str(tmp_path)],
                           capture_output=True, text=True)  # fmt: skip
    assert empty.returncode == 2
    assert empty.stderr == f"{tmp_path}: nothing to draw: metrics.csv has fewer than 2 rows\n"


def test_by_default_communication_and_gradient_norm_are_not_measured(tmp_path):
    """dist.time_comm=false and no clipping: DDP's built-in all-reduce, no Python hook and no
    pass over the gradients, so no figure to report."""
    done = torchrun(tmp_path, *RUN, f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    for rows in (read_metrics(tmp_path / "run"), metrics.read_rows(tmp_path / "run")):
        assert all(row["comm_share"] is None and row["grad_norm"] is None for row in rows)
    progress = [
        line
        for line in (tmp_path / "run" / "train.log").read_text().splitlines()
        if "  loss " in line
    ]
    assert len(progress) == 3 and progress[-1].endswith(" ms/step")  # nothing after the step time
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(loggers.TAGS.values()) - {
        "perf/comm_share",
        "train/grad_norm",
    }


def test_a_resume_from_an_older_checkpoint_logs_each_step_once(tmp_path):
    """Rows past the checkpoint were trained again: the CSV, the JSONL and TensorBoard keep one
    row per step, the second run's."""
    run_dir = tmp_path / "run"
    first = torchrun(tmp_path, *RUN, "trainer.checkpoint_every=20", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    (run_dir / "checkpoints" / "step_000000060.pt").unlink()  # as if the pod died after step 59
    again = torchrun(tmp_path, *RUN, "trainer.checkpoint_every=20", f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from the checkpoint of step 40" in (run_dir / "train.log").read_text()
    assert [row["step"] for row in metrics.read_rows(run_dir)] == [20, 40, 60]
    assert (
        (run_dir / "metrics.csv").read_text().splitlines()[1].startswith("20,60,0,")
    )  # as written
    assert [row["step"] for row in read_metrics(run_dir)] == [20, 40, 60]
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == [20, 40, 60]


def test_logger_csv_writes_no_event_files(tmp_path):
    done = torchrun(tmp_path, *RUN, "logger=csv", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [20, 40, 60]
    assert not (tmp_path / "run" / "tensorboard").exists()


# Installed as sitecustomize in the workers: notes what the W&B run is given, then logs it for real.
RECORD_WANDB = """
import json, os
import wandb.sdk.wandb_run as wandb_run

_log = wandb_run.Run.log

def _recording_log(self, data, step=None, **kwargs):
    with open(os.environ["WANDB_RECORD"], "a") as out:
        out.write(json.dumps({"step": step, "data": data}) + "\\n")
    return _log(self, data, step=step, **kwargs)

wandb_run.Run.log = _recording_log
"""


def test_logger_wandb_offline_gets_every_row(tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(RECORD_WANDB)
    env = {"PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}", "WANDB_RECORD": str(tmp_path / "calls.jsonl"),
           "WANDB_SILENT": "true"}  # fmt: skip
    done = torchrun(tmp_path, *RUN, "logger=wandb", f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    rows = read_metrics(tmp_path / "run")
    assert [call["step"] for call in calls] == [row["step"] for row in rows] == [20, 40, 60]
    assert [call["data"]["train/loss"] for call in calls] == [row["loss"] for row in rows]
    (offline,) = (tmp_path / "run" / "wandb").glob("offline-run-*")  # written for `wandb sync`
    assert (offline / "run-run.wandb").stat().st_size > 0


def test_logger_mlflow_file_store_holds_every_row(tmp_path, monkeypatch):
    import mlflow

    done = torchrun(tmp_path, *RUN, "logger=mlflow", f"hydra.run.dir={tmp_path / 'run'}")
    assert done.returncode == 0, done.stderr[-3000:]
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow.tracking.MlflowClient((tmp_path / "run" / "mlruns").as_uri())
    run_id = (tmp_path / "run" / "mlflow_run_id").read_text().strip()
    history = client.get_metric_history(run_id, "train/loss")
    rows = read_metrics(tmp_path / "run")
    assert [(m.step, m.value) for m in history] == [(row["step"], row["loss"]) for row in rows]
    assert client.get_run(run_id).data.params["trainer.max_steps"] == "60"

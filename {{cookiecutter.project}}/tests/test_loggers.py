"""The logger group: several at once, and every problem a logger has found by check, in one line,
before anything starts. In-process: no launch here (test_metrics launches each logger)."""

import os
import socket
import sys
import time

import pytest
from conftest import needs
from omegaconf import OmegaConf

from ddp_project import PROJECT, check
from ddp_project.config import compose, logger_probes
from ddp_project.config.compose import config_problem
from ddp_project.config.error import ConfigError
from ddp_project.config.loggers import (
    CsvLoggerConfig,
    LoggersConfig,
    MlflowLoggerConfig,
    TensorBoardConfig,
)
from ddp_project.core.world import World
from ddp_project.nccl import failfast
from ddp_project.record import loggers, metrics


def chosen(compose_train, *overrides: str) -> list[str]:
    return OmegaConf.to_object(compose_train(*overrides)).logger.chosen()


@pytest.mark.parametrize(
    "override, names",
    [
        pytest.param("logger=[tensorboard,wandb]", ["tensorboard", "wandb"], marks=needs("wandb")),
        pytest.param("logger=[csv,mlflow]", ["csv", "mlflow"], marks=needs("mlflow")),
        pytest.param(
            "logger=[wandb,mlflow]", ["wandb", "mlflow"], marks=[needs("wandb"), needs("mlflow")]
        ),
        pytest.param(
            "logger=[tensorboard,csv,wandb,mlflow]",
            ["tensorboard", "csv", "wandb", "mlflow"],
            marks=[needs("wandb"), needs("mlflow")],
        ),
        ("logger=csv", ["csv"]),  # one alone, as before: metrics.csv and nothing else
    ],
)
def test_any_loggers_combine(compose_train, override, names):
    assert chosen(compose_train, override) == names
    assert config_problem([override]) is None


def test_tensorboard_is_the_default_and_each_logger_keeps_its_keys(compose_train):
    assert chosen(compose_train) == ["tensorboard"]
    cfg = OmegaConf.to_object(
        compose_train(
            "logger=[tensorboard,wandb,mlflow]",
            "logger.wandb.mode=disabled",
            "logger.mlflow.experiment=mine",
        )
    ).logger
    assert cfg.wandb.mode.value == "disabled" and cfg.wandb.tags == []
    assert cfg.mlflow.experiment == "mine" and cfg.mlflow.tracking_uri is None


def closed_port() -> int:
    """A loopback port nothing listens on: bound, then let go."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


BAD = [
    ("logger=neptune", "logger=neptune: no such option; allowed: csv, mlflow, tensorboard, wandb"),
    (
        "logger=[tensorboard,neptune]",
        "logger=neptune: no such option; allowed: csv, mlflow, tensorboard, wandb",
    ),
    (
        "logger=[tensorboard,wandbb]",
        "logger=wandbb: no such option; did you mean wandb? allowed: csv, mlflow,",
    ),
    (
        "logger.wandb.mode=online",
        "logger.wandb.mode=online: wandb is not among the chosen loggers; choose it as well, "
        "e.g. logger=[tensorboard,wandb]",
    ),
    (
        "logger=wandb logger.wandb.mode=loud",
        "logger.wandb.mode: Invalid value 'loud', expected one of [offline, online, disabled]",
    ),
    (
        "logger=wandb logger.wandb.project=",
        "logger.wandb.project='': must be null (this project's name) or a name of 1 to 128 "
        "characters without / \\ # ? % :",
    ),
    ("logger=wandb logger.wandb.project=team/run", "logger.wandb.project='team/run': must be null"),
    (f"logger=wandb logger.wandb.project={'p' * 129}", "logger.wandb.project='ppp"),
    (
        "logger=wandb logger.wandb.entity=' '",
        "logger.wandb.entity=' ': must be null (your default entity) or a name that is not blank",
    ),
    (
        "logger=wandb logger.wandb.tags=[ok,'']",
        "logger.wandb.tags=['ok', '']: each tag must be 1 to 64 characters",
    ),
    (
        "logger=mlflow logger.mlflow.experiment=''",
        "logger.mlflow.experiment='': must be null (this project's name) "
        "or a name that is not blank",
    ),
    (
        "logger=mlflow logger.mlflow.tracking_uri=mlflow:5000",
        "logger.mlflow.tracking_uri=mlflow:5000: mlflow scheme; use http(s)://host:port for a "
        "server, file:/absolute/path for a folder, or null for a file store in the run dir",
    ),
    (
        "logger=mlflow logger.mlflow.tracking_uri=ftp://host/x",
        "logger.mlflow.tracking_uri=ftp://host/x: ftp scheme; use http(s)://host:port",
    ),
    (
        "logger=mlflow logger.mlflow.tracking_uri=mlruns",
        "logger.mlflow.tracking_uri=mlruns: no scheme; use",
    ),
    (
        "logger=mlflow logger.mlflow.tracking_uri=file:mlruns",
        "logger.mlflow.tracking_uri=file:mlruns: not an absolute path; use",
    ),
    (
        "logger=mlflow logger.mlflow.tracking_uri=http://",
        "logger.mlflow.tracking_uri=http://: no host and port to reach; use",
    ),
    (
        "logger=mlflow logger.mlflow.tracking_uri=http://host:port",
        "logger.mlflow.tracking_uri=http://host:port: "
        "Port could not be cast to integer value as 'port'; use",
    ),
    (
        "logger=mlflow logger.mlflow.tracking_uri=http://host:70000",
        "logger.mlflow.tracking_uri=http://host:70000: Port out of range 0-65535; use",
    ),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[case[0] for case in BAD])
def test_each_bad_logger_setting_is_one_line_naming_the_key(overrides, message):
    problem = config_problem(overrides.split(" ", 1))
    assert problem is not None and problem.startswith(message) and "\n" not in problem


@pytest.mark.parametrize(
    "uri", ["http://127.0.0.1:5000", "https://mlflow.example/x", "file:/tmp/mlruns", "databricks"]
)
def test_tracking_uris_mlflow_reads_pass_the_settings_check(uri):
    assert MlflowLoggerConfig(tracking_uri=uri, experiment=None).tracking_uri == uri


def test_check_refuses_a_chosen_logger_whose_package_is_missing(monkeypatch, capsys):
    """Without it, check said `config ok` and every rank then died of ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec and import see: not installed
    monkeypatch.setattr(sys, "argv", ["check", "logger=[tensorboard,wandb]"])
    assert check.main() == 2
    assert capsys.readouterr().err == (
        "config error: logger.wandb: needs the wandb package, which is not installed here; "
        f"pip install '{PROJECT}[wandb]' (in the project's folder: pip install -e '.[wandb]')\n"
    )
    monkeypatch.setitem(sys.modules, "mlflow", None)
    assert config_problem(["logger=[wandb,mlflow]"]).startswith(
        "logger.wandb, logger.mlflow: need the wandb and mlflow packages, which are not installed "
        f"here; pip install '{PROJECT}[wandb,mlflow]'"
    )
    assert config_problem(["logger=[tensorboard,csv]"]) is None  # no extra needed


@needs("mlflow")
def test_check_names_an_unreachable_tracking_server_at_once(figure):
    """It used to surface 194 s into the run, blamed on another process."""
    port = closed_port()
    uri = f"http://127.0.0.1:{port}"
    problem = config_problem(["logger=mlflow", f"logger.mlflow.tracking_uri={uri}"])
    assert problem == (
        f"logger.mlflow.tracking_uri={uri}: no server answers at 127.0.0.1:{port} "
        "(Connection refused); start the MLflow server, or set logger.mlflow.tracking_uri=null for "
        "a file store in the run dir"
    )
    started = time.monotonic()
    with pytest.raises(ConfigError):  # refused at once: no wait for the probe's 60 s timeout
        logger_probes.check(LoggersConfig(mlflow=MlflowLoggerConfig(uri, None)), timeout_s=60)
    seconds = time.monotonic() - started
    figure(f"{seconds:.2f} s to find that no MLflow server answers (refused)")
    assert seconds < 30


@needs("mlflow")
@pytest.mark.parametrize("where", ["/proc/mlruns", "{file}/mlruns"])
def test_check_refuses_a_file_store_it_cannot_write(tmp_path, where):
    """/proc refuses even root; a path below a file is no folder."""
    (tmp_path / "file").write_text("")
    uri = "file:" + where.format(file=tmp_path / "file")
    problem = config_problem(["logger=mlflow", f"logger.mlflow.tracking_uri={uri}"])
    assert problem is not None
    assert problem.startswith(f"logger.mlflow.tracking_uri={uri}: cannot write in ")
    fine = f"logger.mlflow.tracking_uri=file:{tmp_path}/a/b"  # made when the logger starts
    assert config_problem(["logger=mlflow", fine]) is None
    assert sorted(tmp_path.iterdir()) == [tmp_path / "file"]  # the check left nothing


@needs("mlflow")
def test_a_server_gone_when_the_logger_starts_fails_fast_naming_it(tmp_path, monkeypatch, figure):
    """check passed, then the server went: the logger's start fails in one line naming it, well
    inside dist.timeout_s: one attempt of 2 s, as the line says (MLflow alone retries for minutes
    while the other ranks wait, far past the bound below)."""
    for var in ("TIMEOUT", "MAX_RETRIES", "BACKOFF_FACTOR"):
        monkeypatch.delenv(f"MLFLOW_HTTP_REQUEST_{var}", raising=False)  # restored afterwards
    import mlflow  # noqa: F401 - imported before the clock starts: seconds on a loaded machine

    uri = f"http://127.0.0.1:{closed_port()}"
    cfg = LoggersConfig(tensorboard=TensorBoardConfig(), mlflow=MlflowLoggerConfig(uri, None))
    started = time.monotonic()
    with pytest.raises(logger_probes.LoggerError) as failed:
        loggers.build(cfg, tmp_path, 0, {"dist": {"timeout_s": 16}})
    seconds = time.monotonic() - started
    figure(f"{seconds:.1f} s for the logger's start to give up on a server that is gone")
    assert seconds < 60
    assert str(failed.value) == (
        f"logger.mlflow: could not start ({uri}): MlflowException: API request to {uri}/api/2.0/"
        "mlflow/experiments/get-by-name failed: NewConnectionError (1 attempt(s), 2 s each)"
    )  # dist.timeout_s=16: no retry, 2 s for the one attempt
    assert "\n" not in str(failed.value)


def test_a_logger_that_cannot_start_ends_rank_0_at_once_as_the_cause(tmp_path, monkeypatch, capsys):
    """The other ranks wait in an all-reduce for rank 0: it must end first, exit 2, one line, and
    claim the failure report, or theirs blame a lost peer (and the launcher names them)."""
    from ddp_project import train

    cfg = LoggersConfig(mlflow=MlflowLoggerConfig(f"http://127.0.0.1:{closed_port()}", None))
    with pytest.raises(
        logger_probes.LoggerError
    ) as failed:  # the run's record raises: train ends on it
        metrics.RunRecord(tmp_path, 60, 0, True, cfg, {"dist": {"timeout_s": 8}})
    monkeypatch.setattr(os, "_exit", lambda code: sys.exit(code))  # not pytest's own process
    with pytest.raises(SystemExit) as ended:
        train.end_before_the_others(failed.value, World(), tmp_path)
    assert ended.value.code == 2
    assert capsys.readouterr().err.startswith("config error: logger.mlflow: could not start (")
    assert failfast.claim_report(tmp_path, World()) is False  # already claimed: the others: "too"


class Recorder:
    def __init__(self, fail_at: int | None = None) -> None:
        self.rows, self.closed, self.fail_at = [], False, fail_at

    def log(self, row):
        if row["step"] == self.fail_at:
            raise ConnectionError("the server went away")
        self.rows.append(loggers.scalars(row))

    def close(self):
        self.closed = True


ROW = {
    "step": 20,
    "max_steps": 60,
    "epoch": 0,
    "loss": 2.5,
    "accuracy": 0.25,
    "grad_norm": None,
    "lr": 0.001,
    "samples_per_s": 900.0,
    "step_time_ms": 3.5,
    "comm_share": None,
    "world_size": 2,
    "tokens_per_s": 900.0,
    "mfu": None,
    "peak_memory_gib": None,
    "val_loss": None,
    "val_accuracy": None,
    "val_time_s": None,
    "checkpoint_s": 0.0,
}


def test_each_row_goes_to_every_logger_with_its_tags():
    first, second = Recorder(), Recorder()
    both = loggers.Loggers({"tensorboard": first, "wandb": second})
    both.log(ROW)
    both.close()
    expected = {
        "train/loss": 2.5,
        "train/accuracy": 0.25,
        "train/lr": 0.001,
        "perf/samples_per_s": 900.0,
        "perf/step_time_ms": 3.5,
        "perf/tokens_per_s": 900.0,
        "perf/checkpoint_s": 0.0,
    }
    assert first.rows == second.rows == [expected]  # the columns not measured are left out
    assert first.closed and second.closed


def test_a_logger_that_fails_mid_run_is_dropped_with_a_warning_and_the_others_go_on(caplog):
    flaky, steady = Recorder(fail_at=40), Recorder()
    both = loggers.Loggers({"mlflow": flaky, "tensorboard": steady})
    for step in (20, 40, 60):
        both.log(ROW | {"step": step})
    assert len(flaky.rows) == 1 and len(steady.rows) == 3
    warning = "logger.mlflow: stopped logging at step 40 (ConnectionError: the server went away)"
    assert warning in caplog.text


def test_csv_alone_starts_no_logger(tmp_path):
    started = loggers.build(LoggersConfig(csv=CsvLoggerConfig()), tmp_path, 0, {})
    assert started.named == {} and list(tmp_path.iterdir()) == []


def test_each_run_dir_keeps_one_wandb_run_id(tmp_path):
    """A relaunch into the same run dir continues the same W&B run (resume="allow")."""
    first, other = tmp_path / "2026-12-01_05-00-00_abc123", tmp_path / "my run/x"
    assert loggers.wandb_id(first) == loggers.wandb_id(first) == "2026-12-01-05-00-00-abc123"
    assert loggers.wandb_id(other) == "x" != loggers.wandb_id(first)
    assert loggers.wandb_id(tmp_path / ("r" * 100)) == "r" * 64  # W&B's limit


@needs("mlflow")
def test_a_resume_continues_the_same_mlflow_run(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    cfg = LoggersConfig(mlflow=MlflowLoggerConfig(None, None))
    config = {"trainer": {"max_steps": 60}, "dist": {"timeout_s": 180}}
    for step in (20, 40):  # the second launch resumes from the checkpoint of step 20
        started = loggers.build(cfg, tmp_path, step - 20, config)
        started.log(ROW | {"step": step, "loss": step / 10})
        started.close()
    client = mlflow.tracking.MlflowClient((tmp_path / "mlruns").as_uri())
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    history = client.get_metric_history(run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(20, 2.0), (40, 4.0)]
    params = client.get_run(run_id).data.params
    assert params == {"trainer.max_steps": "60", "dist.timeout_s": "180"}
    assert len(client.search_runs([client.get_experiment_by_name(PROJECT).experiment_id])) == 1


def test_train_checks_the_loggers_in_every_process_before_the_run_dir_exists(
    compose_train, monkeypatch, capsys
):
    """python -m <package>.train under torchrun skips the launcher: its ConfigCheck refuses."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit) as ended:
        compose.ConfigCheck().on_run_start(compose_train("logger=[tensorboard,wandb]"))
    assert ended.value.code == 2
    assert capsys.readouterr().err.startswith("config error: logger.wandb: needs the wandb package")


def test_rendering_for_a_cluster_does_not_ask_this_machine_for_logger_packages(monkeypatch):
    """k8s/ is rendered on a laptop for the image's pods: what is installed here does not count."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert compose.compose_and_check(["logger=wandb"], this_node=False).logger.chosen() == ["wandb"]

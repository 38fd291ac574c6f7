"""Helpers that run the project the way users do: compose the real config, launch torchrun."""

import functools
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from heartbeat import register as register_heartbeat
from hydra import compose, initialize_config_module

from ddp_project.config.schema import register_configs

# One thread per process for what the tests start and for torch in the test processes, as
# torchrun gives each worker: on 2 cores, with several test workers and ranks at once, a thread
# per core each spends more CPU spinning than computing (8% of the suite's CPU). The launcher's
# launches get the environment as a user has it (users_env): it sets its own, and says so.
os.environ.setdefault("OMP_NUM_THREADS", "1")
PACKAGE = "ddp_project"
ROOT = Path(__file__).resolve().parents[1]
RUN_NAME = re.compile(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{6}")  # world.run_name's


# Modules whose every test reads what this project was made with (the k8s flavor, nodes, GPUs,
# NCCL profile, package) from configs/ or k8s/: with the tests marked render, what the template
# runs for each of its renders (pytest -m render), beside the whole suite for its default one.
RENDER_MODULES = {"test_config", "test_check", "test_k8s", "test_project_files"}


def pytest_configure(config: pytest.Config) -> None:
    register_heartbeat(config)  # a line naming the running tests whenever none has ended for 30 s


@pytest.fixture
def figure(record_property):
    """figure(text): a measured figure (seconds a stop took on this machine, say) for the summary
    at the end of the run. Tests bound what load can stretch generously, where only the cause of a
    failure could reach the bound, and report the tight figure here rather than assert it."""
    return lambda text: record_property("figure", text)


def pytest_terminal_summary(terminalreporter) -> None:
    """The figures the tests reported (fixture figure), with xdist too: they travel with the
    reports."""
    figures = [
        (report.nodeid, value)
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name == "figure"
    ]
    if figures:
        terminalreporter.section(
            "figures measured on this machine (bounded generously, not asserted)"
        )
        for nodeid, text in sorted(figures):
            terminalreporter.write_line(f"{nodeid}: {text}")


def needs(module: str) -> pytest.MarkDecorator:
    """For a test of logger=<module>: skipped where its package is missing, saying how to get it
    (make install leaves wandb and mlflow out; make install-all, and CI, bring both)."""
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"{module} is not installed: make install-all (or pip install -e '.[{module}]')",
    )


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked gpu measure the machine's GPUs: one xdist worker runs them, one at a time.
    Tests that share a module-scoped fixture (a trained run: seconds of CPU) run on one worker,
    which makes it once; spread over workers, each would make its own."""
    for item in items:
        if item.module.__name__ in RENDER_MODULES:
            item.add_marker(pytest.mark.render)
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.xdist_group("gpus"))
            continue
        if any(
            fixture.scope == "module"
            for name in item.fixturenames
            for fixture in item._fixtureinfo.name2fixturedefs.get(name, ())[-1:]
        ):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture
def launcher_state(monkeypatch):
    """launch.main() in this process names the run in os.environ and installs signal handlers:
    both undone after each test (and no world size is left in the environment to mislead it)."""
    for name in (
        "DDP_RUN_NAME",
        "DDP_LAUNCHED_AT",
        "DDP_LAUNCHER_IMPORTED_AT",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
    ):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def no_torchrun(monkeypatch) -> None:
    """launch.main() in this process stops before torchrun, or the test fails."""
    from ddp_project import launch

    monkeypatch.setattr(launch, "run", lambda parsed: pytest.fail("torchrun was started"))


def deploy_defaults() -> dict:
    """configs/deploy/default.yaml: the flavor, nodes and GPUs that k8s/ was rendered for."""
    return yaml.safe_load((ROOT / "configs" / "deploy" / "default.yaml").read_text())


def trainer_container(flavor: str, workload: dict) -> dict:
    """The container that runs the launcher in each pod of `workload` (k8s/<flavor>.yaml): its
    command, args, env and resources. A TrainJob's is its spec.trainer, from which Trainer's
    torch plugin makes the container (resourcesPerNode, numProcPerNode)."""
    spec = workload["spec"]
    if flavor == "trainjob":
        return spec["trainer"]
    if flavor == "pytorchjob":
        pod = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    elif flavor == "jobset":
        (replicated,) = spec["replicatedJobs"]
        pod = replicated["template"]["spec"]["template"]["spec"]
    else:
        pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    return container


@pytest.fixture(autouse=True)
def environment_as_it_was():
    """Entry points called in-process (the launcher's main) set DDP_RUN_NAME and the like for
    their workers: a later test's subprocess on the same worker must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def shared_folder(request: pytest.FixtureRequest) -> Path:
    """A module fixture's folder, made once per session; the test fails if a second xdist worker
    makes it too (the grouping above did not hold, and the run would be paid twice)."""
    base = request.getfixturevalue("tmp_path_factory").getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the session's
    folder = root / f"{request.module.__name__}.{request.fixturename}"
    try:
        folder.mkdir()
    except FileExistsError:
        pytest.fail(f"{folder.name} was made on two xdist workers: its tests must run on one")
    return folder


@pytest.fixture
def compose_train():
    """compose_train(*overrides) -> the composed DictConfig of configs/train.yaml."""
    register_configs()

    def _compose(*overrides: str):
        with initialize_config_module(config_module=f"{PACKAGE}.configs", version_base="1.3"):
            return compose(config_name="train", overrides=list(overrides))

    return _compose


@pytest.fixture
def trainer_for(compose_train, tmp_path):
    """trainer_for(*overrides, run="run") -> a Trainer of one CPU process (gloo), in process,
    its run dir tmp_path/run."""
    import torch
    from omegaconf import OmegaConf

    import ddp_project.data  # noqa: F401  (registers the data options)
    import ddp_project.model  # noqa: F401  (and the models)
    from ddp_project.core.world import World
    from ddp_project.run.trainer import Trainer

    def make(*overrides: str, run: str = "run") -> Trainer:
        cfg = OmegaConf.to_object(compose_train("dist.backend=gloo", *overrides))
        (tmp_path / run).mkdir(exist_ok=True)
        return Trainer(cfg, World(), torch.device("cpu"), tmp_path / run)

    return make


def make_line(line: str, *more: str) -> list[str]:
    """The command a docs line `make <target> [ARGS="..."]` runs, `more` appended to its ARGS,
    as make expands it (-n: printed, not run): the recipe's last line."""
    words = shlex.split(line)
    args = [word for word in words if word.startswith("ARGS=")] or ["ARGS="]
    rest = [word for word in words[1:] if not word.startswith("ARGS=")]
    given = " ".join([args[0].removeprefix("ARGS="), *more]).strip()
    # --no-print-directory: under a parent make (make test-full) the last line would be "Leaving".
    make = ["make", "-n", "--no-print-directory", "-f", str(ROOT / "Makefile")]
    dry = subprocess.run([*make, *rest, f"ARGS={given}"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return shlex.split(dry.stdout.strip().splitlines()[-1])


def train_command(*overrides: str, nproc: int = 2) -> list[str]:
    """`torchrun --standalone --nproc-per-node N -m <package>.train <overrides>`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        f"{PACKAGE}.train",
        *overrides,
    ]


def launch_command(*args: str) -> list[str]:
    """`<project> train <args>`: the launcher that make train and the Job use."""
    return [sys.executable, "-m", f"{PACKAGE}.launch", "train", *args]


def users_env() -> dict[str, str]:
    """This environment as a user's shell has it: without the tests' OMP_NUM_THREADS, which the
    launcher sets for its workers itself (torchrun would print a banner about it otherwise)."""
    return {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}


def launch(cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        launch_command(*args),
        cwd=cwd,
        env=users_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@functools.cache
def launcher_bin() -> Path:
    """A folder holding `<project>`, the console script that `pip install` makes, for launch
    lines (the manifests') run from this test environment, where the project may be on
    PYTHONPATH only."""
    from ddp_project.launch import COMMAND

    folder = Path(tempfile.mkdtemp(prefix="launcher-bin-"))
    script = folder / COMMAND
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {PACKAGE}.launch "$@"\n')
    script.chmod(0o755)
    return folder


def torchrun(
    cwd: Path, *overrides: str, nproc: int = 2, env: dict | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """Train in `cwd` and wait for it to end."""
    return subprocess.run(
        train_command(*overrides, nproc=nproc),
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_for_metrics(launcher: subprocess.Popen, run_dir: Path, timeout_s: float = 180) -> None:
    """Until the run has logged its first steps; fails if it ends or stalls first."""
    deadline = time.monotonic() + timeout_s
    rows = run_dir / "metrics.jsonl"  # written empty at the start, a row at each log step
    while not (rows.exists() and rows.stat().st_size):
        assert launcher.poll() is None and time.monotonic() < deadline, "training never started"
        time.sleep(0.2)


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of the torchrun workers among the launcher's children (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        ranks = [item[len(b"RANK=") :] for item in environ if item.startswith(b"RANK=")]
        if parent == launcher_pid and ranks:
            found[int(ranks[0])] = int(entry.name)
    return found


def worker_pid(launcher_pid: int, rank: int) -> int | None:
    return worker_pids(launcher_pid).get(rank)


def hang_one_rank(
    cwd: Path, *overrides: str, timeout_s: int, env: dict | None = None
) -> tuple[int, str, float]:
    """Train, SIGSTOP rank 1 once steps are being logged, and wait for torchrun to give up.

    Returns (exit code, output, seconds from the stop to the exit).
    """
    run_dir = cwd / "hung-run"
    command = train_command(
        "trainer.max_steps=100000000",
        "trainer.log_every=5",
        f"dist.timeout_s={timeout_s}",
        f"hydra.run.dir={run_dir}",
        *overrides,
    )
    launcher = subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    workers = []
    try:
        wait_for_metrics(launcher, run_dir)
        workers = [worker_pid(launcher.pid, rank) for rank in (0, 1)]
        assert None not in workers, f"workers not found: {workers}"
        os.kill(workers[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        output, _ = launcher.communicate(timeout=timeout_s + 300)  # a loaded machine's slack
        return launcher.returncode, output, time.monotonic() - stopped_at
    finally:
        # Workers may sit in sessions of their own and keep the output pipe open: end them first.
        for pid in [*workers, launcher.pid]:
            if pid is not None and Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
        launcher.communicate(timeout=30)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


class NotMlflow(BaseHTTPRequestHandler):
    """A server that answers, so that the check passes, but not as MLflow: 404 to everything."""

    def do_GET(self) -> None:
        self.send_error(404)

    do_POST = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def not_mlflow():
    """http://127.0.0.1:<port> of a NotMlflow server, for as long as the test runs."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), NotMlflow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()

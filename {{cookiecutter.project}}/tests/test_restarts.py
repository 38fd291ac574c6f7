"""torchrun's --max-restarts restarts the workers in place on any failure: not on one that no
retry fixes (exits.FAIL_AT_ONCE: a config error, a divergence), which ends the launch at once in
its one line, and a round that trained a while gives the budget back (worker_exits.Agent)."""

import os
import subprocess
import time
from types import SimpleNamespace

import pytest
from conftest import launch_command, users_env
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from ddp_project.launcher import worker_exits

pytestmark = pytest.mark.usefixtures("launcher_state")  # conftest.py

RESTARTS = ("--nproc-per-node", "2", "--max-restarts", "3")


def run(tmp_path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(
        launch_command(*RESTARTS, "hydra.run.dir=run", *args),
        cwd=tmp_path,
        env={**users_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=400,
    )
    return done, time.monotonic() - started


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_diverging_run_is_not_restarted_in_place(tmp_path, figure):
    """trainer.lr=1e30 blows the weights up at the first log window: under --max-restarts 3 it
    ran 4 times, its line printed 4 times."""
    done, seconds = run(tmp_path, "trainer.lr=1e30", "trainer.log_every=1", "trainer.max_steps=50")
    figure(f"a diverging run under --max-restarts 3 ended in {seconds:.1f} s")
    assert done.returncode == 4, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith("training diverged: step "), said


# In the workers only (the launcher has no RANK): trainer.lr=${oc.env:RESTARTS_LR,...} passes the
# launcher's check and fails the workers' own, as a config error only a worker finds.
BAD_IN_WORKERS = """
import os
if "RANK" in os.environ:
    os.environ["RESTARTS_LR"] = "-1"
"""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_config_error_a_worker_raises_is_not_restarted_in_place(tmp_path, figure):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(BAD_IN_WORKERS)
    env = {"PYTHONPATH": f"{hook}:{os.environ.get('PYTHONPATH', '')}"}
    done, seconds = run(tmp_path, "trainer.lr=${oc.env:RESTARTS_LR,0.1}", env=env)
    figure(f"a worker's config error under --max-restarts 3 ended in {seconds:.1f} s")
    assert done.returncode == 2, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith("config error: trainer.lr=-1"), said


def agent_seeing(monkeypatch, *codes: int, ran_s: float) -> worker_exits.Agent:
    """The agent as _invoke_run finds it after a monitor that saw these exits, its round having
    run ran_s, 1 of 3 restarts left."""
    failures = {
        rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        for rank, code in enumerate(codes)
    }
    result = RunResult(
        state=WorkerState.FAILED if codes else WorkerState.HEALTHY, failures=failures
    )
    monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", lambda self, group: result)
    agent = worker_exits.Agent.__new__(worker_exits.Agent)  # no rendezvous, no workers
    agent._remaining_restarts, agent.round_started = 1, time.monotonic() - ran_s
    group = SimpleNamespace(spec=SimpleNamespace(max_restarts=3))
    assert agent._monitor_workers(group) is result
    return agent


@pytest.mark.parametrize(
    ("codes", "ran_s", "left"),
    [
        ((4, 4), 0, 0),  # diverged: no retry
        ((2, -15), 10_000, 0),  # a config error, however long the round ran
        ((3, 1), 10, 1),  # a crash soon after the start: the budget counts it
        ((3, -9), worker_exits.HEALTHY_ROUND_S, 3),  # a round that trained: a fresh budget
        ((), 10_000, 1),  # healthy: nothing to count
    ],
)
def test_the_restart_budget_after_a_round(monkeypatch, codes, ran_s, left):
    assert agent_seeing(monkeypatch, *codes, ran_s=ran_s)._remaining_restarts == left

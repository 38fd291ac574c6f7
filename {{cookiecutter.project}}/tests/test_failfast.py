"""Fail fast, with a remedy: a hung rank ends every process promptly and explains what to try."""

import time

import pytest
import torch
import torch.distributed as dist
from conftest import PACKAGE, hang_one_rank

from ddp_project.config.schema import NcclConfig
from ddp_project.core.world import World
from ddp_project.nccl import decision as nccl
from ddp_project.nccl import failfast

NCCL_TIMEOUT = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, "
    "NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600013 milliseconds "
    "before timing out."
)


def test_nccl_watchdog_message_names_the_collective_and_sequence():
    error = dist.DistBackendError(NCCL_TIMEOUT)
    failure = failfast.as_collective_failure(error, phase="training", backend="nccl")
    assert (failure.collective, failure.sequence) == ("ALLREDUCE", "1")


@pytest.mark.parametrize(
    "err", [ValueError("bad shape"), RuntimeError("CUDA out of memory. Tried to allocate")]
)
def test_other_errors_are_not_dressed_up_as_collective_failures(err):
    assert failfast.as_collective_failure(err, phase="training", backend="nccl") is None


def block_for(message: str, phase: str, backend: str) -> str:
    decision = nccl.decide(NcclConfig(p2p_disable=True), None, {"NCCL_DEBUG": "WARN"})
    failure = failfast.as_collective_failure(RuntimeError(message), phase=phase, backend=backend)
    return failfast.remedy_block(
        failure,
        rank=0,
        backend=backend,
        timeout_s=180,
        decision=decision,
        profile="pcie_safe",
        launch=f"{PACKAGE} train --nproc-per-node 2",
        package=PACKAGE,
        trace_prefix="/runs/x/nccl/trace_rank_",
    )


def test_a_failed_gate_under_nccl_gets_the_transport_causes_in_order():
    block = block_for(NCCL_TIMEOUT, phase=failfast.GATE_PHASE, backend="nccl")
    assert "ALLREDUCE, sequence number 1" in block
    assert "NCCL_P2P_DISABLE = 1       config nccl.p2p_disable" in block
    assert "NCCL_DEBUG       = WARN    environment" in block
    causes = [
        block.index(word)
        for word in ("peer-to-peer over PCIe", "/dev/shm", "InfiniBand", "interface")
    ]
    assert causes == sorted(causes)
    assert f"python -m {PACKAGE}.doctor" in block
    assert f"{PACKAGE} train --nproc-per-node 2 nccl=pcie_safe" in block
    assert "NCCL_DEBUG=INFO" in block and "Flight recorder" in block


SILENT_PEER = [
    ("nccl", NCCL_TIMEOUT.replace("SeqNum=1", "SeqNum=4021")),
    (
        "gloo",
        "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation",
    ),
    ("gloo", "Application timeout caused pair closure"),  # from DDP's backward
]
DEAD_PEER = [
    ("gloo", "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41919"),
    (
        "gloo",
        "[gloo/transport/tcp/pair.cc:589] Read error [127.0.0.1]:5678: Connection reset by peer",
    ),
    ("nccl", "NCCL error: remote process exited or there was a network error, NCCL version 2.28.9"),
    (
        "nccl",
        "ncclRemoteError: A call failed possibly due to a network error or a remote process "
        "exiting prematurely.",
    ),
]


@pytest.mark.parametrize(("backend", "message"), SILENT_PEER)
def test_a_peer_that_stops_answering_mid_run_is_not_blamed_on_the_transport(backend, message):
    block = block_for(message, phase="training", backend=backend)
    assert "stopped answering: nothing came from it for 180 s" in block
    assert "peer-to-peer" not in block and "/dev/shm" not in block and "doctor" not in block
    assert ("NCCL environment in force" in block) == (backend == "nccl")


@pytest.mark.parametrize(("backend", "message"), DEAD_PEER)
def test_a_peer_that_died_is_named_as_such_with_no_transport_advice(backend, message):
    block = block_for(message, phase="training", backend=backend)
    assert "Another process of this run ended while this one waited for it" in block
    assert "why it ended is not known here" in block
    assert "torchrun's summary names the process that ended first" in block
    # what each exit says, none guessed first: SIGKILL is not always memory, 143 is a stop
    assert "Likely causes" not in block and "143 or 130 (SIGTERM, SIGINT)" in block
    assert "peer-to-peer" not in block and "doctor" not in block


def test_gloo_never_gets_nccl_advice_even_at_the_gate():
    message = (
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
        "Timed out waiting 60000ms for recv"
    )
    block = block_for(message, phase=failfast.GATE_PHASE, backend="gloo")
    assert "NCCL" not in block and "peer-to-peer" not in block


def test_only_the_first_failing_process_prints_the_block(tmp_path):
    assert failfast.claim_report(tmp_path, World(run_id="job")) is True
    assert failfast.claim_report(tmp_path, World(rank=1, run_id="job")) is False


@pytest.mark.slow
def test_a_hung_rank_ends_every_process_within_the_timeout_with_the_true_cause(tmp_path, figure):
    """dist.timeout_s=10: the run ends with the remedy, not after the default's 180 s (the bound
    below, which only a timeout not in force can reach on a loaded machine)."""
    timeout_s = 10
    code, output, seconds = hang_one_rank(tmp_path, timeout_s=timeout_s)
    figure(f"{seconds:.1f} s from rank 1's SIGSTOP to the end, under dist.timeout_s={timeout_s}")
    assert code != 0
    assert seconds < 150, output[-3000:]
    assert output.count("A collective failed on rank 0 (gloo)") == 1, output[-3000:]
    assert "Another process stopped answering" in output
    assert "NCCL" not in output.split("A collective failed", 1)[1].split("=" * 78)[0]
    assert "exitcode  : 3" in output  # rank 0's own: Exit.COLLECTIVE_FAILED


def test_stall_watchdog_reports_only_when_progress_stops():
    """Beats 15 times as often as the limit: a loaded machine that delays a beat by seconds is
    still short of it. Then no beat: the report comes, however late the watchdog is woken."""
    stalls = []
    watchdog = failfast.StallWatchdog(limit_s=3, on_stall=stalls.append)
    try:
        for _ in range(20):  # 4 s of regular progress, more than the limit: no report
            time.sleep(0.2)
            watchdog.beat()
        assert stalls == []
        deadline = time.monotonic() + 60
        while not stalls and time.monotonic() < deadline:
            time.sleep(0.2)
        (stall,) = stalls
        assert "no step finished for 3 s" in stall.phase
    finally:
        watchdog.stop()


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("DataLoader worker (pid 12) is killed by signal: Aborted."),
        RuntimeError("DataLoader timed out after 5 seconds"),
    ],
)
def test_dataloader_failures_are_not_reported_as_collective_failures(err):
    assert failfast.as_collective_failure(err, phase="training", backend="gloo") is None


@pytest.mark.parametrize(
    "message",
    [
        "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms",
        "Application timeout caused pair closure",  # gloo, from DDP's backward (CI, 2026-11-29)
    ],
)
def test_gloo_timeouts_are_collective_failures(message):
    error = RuntimeError(message)
    assert failfast.as_collective_failure(error, phase="training", backend="gloo") is not None


def test_each_launch_reports_its_own_failure(tmp_path):
    assert failfast.claim_report(tmp_path, World(run_id="job")) is True
    retried = World(run_id="job", restart=1)  # a retried pod, same run dir
    assert failfast.claim_report(tmp_path, retried) is True


@pytest.fixture
def lone_group():
    """A gloo group of this process alone."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_gate_passes_a_right_sum_and_refuses_a_wrong_one(lone_group, monkeypatch):
    failfast.gate(torch.device("cpu"), timeout_s=10)
    monkeypatch.setattr(dist, "get_world_size", lambda *args: 2)  # a peer whose values were lost
    with pytest.raises(failfast.GateFailed, match="returned 1048576 wrong values .expected 3."):
        failfast.gate(torch.device("cpu"), timeout_s=10)


def test_a_gate_that_does_not_finish_in_time_fails(lone_group, monkeypatch):
    class Stuck:
        def wait(self, timeout):
            assert timeout.total_seconds() == 7
            return False

    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: Stuck())
    with pytest.raises(failfast.GateFailed, match="did not finish within 7 s"):
        failfast.gate(torch.device("cpu"), timeout_s=7)


@pytest.mark.parametrize(("backend", "cause"), [("nccl", "transport"), ("gloo", "peer_silent")])
def test_a_gate_that_timed_out_blames_the_transport_only_under_nccl(backend, cause):
    """Over gloo the transport is TCP on the CPU: a gate that times out waits for a peer."""
    err = failfast.GateFailed("the gate all-reduce did not finish within 60 s")
    failure = failfast.as_collective_failure(err, phase=failfast.GATE_PHASE, backend=backend)
    assert failure.cause is failfast.Cause(cause) and failure.phase == failfast.GATE_PHASE

"""The node probe: hard timeouts on hanging peer copies, and one probe shared by a node's ranks."""

import os
import subprocess
import sys
import time

import pytest
from conftest import PACKAGE

from ddp_project.config.schema import NcclConfig
from ddp_project.core.world import World
from ddp_project.nccl import decision as nccl
from ddp_project.nccl import probe

SLEEPS = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_hanging_command_is_killed_at_its_timeout(figure):
    """The command sleeps 60 s: only a wait for it, not a slow machine, takes 30."""
    started = time.monotonic()
    assert probe.run_with_hard_timeout(SLEEPS, timeout_s=1).status == "hang"
    seconds = time.monotonic() - started
    figure(f"{seconds:.1f} s to give up on a hanging command with a 1 s timeout")
    assert seconds < 30


@pytest.mark.parametrize(("code", "status"), [(0, "ok"), (1, "failed")])
def test_exit_status_gives_ok_or_failed(code, status):
    assert (
        probe.run_with_hard_timeout([sys.executable, "-c", f"raise SystemExit({code})"], 5).status
        == status
    )


def test_a_pcie_pair_whose_peer_copy_hangs_loses_p2p(monkeypatch, figure):
    """Two GPUs with no NVLink, and a peer-copy probe that sleeps past its timeout (60 s: only a
    wait for it takes 30)."""
    monkeypatch.setattr(probe, "topology", lambda gpus: probe.Topology(frozenset(), {}, "none"))
    started = time.monotonic()
    two = World(size=2, local_size=2)
    facts = probe.probe_node(two, timeout_s=1, command=lambda i, j: SLEEPS, count=lambda: 2)
    seconds = time.monotonic() - started
    figure(f"{seconds:.1f} s to probe a pair whose peer copy hangs, with a 1 s timeout")
    assert seconds < 30
    assert facts.p2p_tests == {(0, 1): "hang"}
    env = nccl.decide(NcclConfig(auto=True), facts, inherited={}).env
    assert env["NCCL_P2P_DISABLE"] == "1"


def test_nvlink_pairs_are_not_copy_tested(monkeypatch):
    monkeypatch.setattr(
        probe, "topology", lambda gpus: probe.Topology(frozenset({(0, 1)}), {}, "nvml")
    )
    facts = probe.probe_node(
        World(local_size=2),
        command=lambda i, j: pytest.fail("NVLink pair was copy-tested"),
        count=lambda: 2,
    )
    assert facts.p2p_tests == {} and facts.nvlink_pairs == {(0, 1)}


def test_local_rank_0_probes_once_and_the_others_read_its_result(tmp_path):
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from pathlib import Path; from {PACKAGE}.nccl.probe import shared_node_facts; "
            f"from {PACKAGE}.core.world import World; "
            "world = World(local_rank=1, run_id='test-run'); "
            f"print(shared_node_facts(Path({str(tmp_path)!r}), world, wait_s=60).to_json())",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(1)  # the reader is waiting before anything is published
    published = nccl.NodeFacts(2, frozenset(), 0, 2, 2, 2**30, {(0, 1): "hang"}, 0.5)
    calls = []
    facts = probe.shared_node_facts(
        tmp_path, World(run_id="test-run"), probe=lambda: calls.append(1) or published
    )
    output, _ = reader.communicate(timeout=60)
    assert calls == [1] and facts == published
    assert nccl.NodeFacts.from_json(output) == published
    assert [p.name for p in (tmp_path / "nccl").iterdir()] == [
        f"probe-{os.uname().nodename}-test-run-0.json"
    ]


def test_a_reader_gives_up_when_nothing_is_published(tmp_path):
    with pytest.raises(TimeoutError, match="local rank 0 published no node probe"):
        probe.shared_node_facts(tmp_path, World(local_rank=1), wait_s=0.3)


def test_world_reads_the_launch_and_its_restart_from_torchruns_environment():
    """The probe's file and the failure marker are named per launch and restart from World."""
    env = {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "job-7",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    world = World.from_env(env)
    assert (world.rank, world.local_rank, world.size, world.local_size) == (3, 1, 4, 2)
    assert world.launched and world.main is False and world.attempt == "job-7-2"
    alone = World.from_env({})
    assert not alone.launched and alone.main and alone.attempt == "local-0"

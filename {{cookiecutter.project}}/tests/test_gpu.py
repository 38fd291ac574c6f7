"""The same end-to-end run with backend nccl on 2 GPUs. Skipped where fewer than 2 are visible."""

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import PACKAGE, hang_one_rank, read_metrics, torchrun

from ddp_project import doctor
from ddp_project.nccl.probe import nvidia_smi_topology, nvlink_pairs_from_topo
from ddp_project.run import checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

# NCCL_DEBUG=INFO prints one line per channel, e.g. "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read"
TRANSPORT = re.compile(r"via (P2P/[\w/]+|SHM/[\w/]+|NET/[\w/]+)")


@pytest.mark.parametrize("profile", ["auto", "nccl_default", "pcie_safe"])
def test_two_gpus_train_with_nccl(tmp_path, profile):
    run_dir = tmp_path / "run"
    done = torchrun(
        tmp_path,
        f"nccl={profile}",
        "trainer.max_steps=300",
        f"hydra.run.dir={run_dir}",
        "dist.time_comm=true",
        "trainer.max_grad_norm=1.0",  # every metric, on CUDA
        env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,P2P,SHM,NET"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    transports = sorted(set(TRANSPORT.findall(done.stdout + done.stderr)))
    assert transports, "NCCL printed no transport lines"
    if profile == "pcie_safe":
        assert not any(t.startswith("P2P") for t in transports)
    elif (0, 1) in nvlink_pairs_from_topo(nvidia_smi_topology()):
        assert any(t.startswith("P2P") for t in transports), "NVLink GPUs must keep P2P"
    rows = read_metrics(run_dir)
    log = (run_dir / "train.log").read_text()
    assert "backend nccl, gate all-reduce passed" in log
    if profile == "auto":
        probe_s = float(re.search(r"probe took ([\d.]+) s", log).group(1))
        assert probe_s <= 3.0
        print(f"\nGPU-RESULT probe_s={probe_s}")
    assert rows[-1]["loss"] < 0.75 * rows[0]["loss"]
    assert checkpoint.checkpoint_paths(run_dir)[-1].name == "step_000000300.pt"
    # the comm hook's CUDA events: an all-reduce was in flight for part of each timed step
    assert all(0 < row["comm_share"] <= 1 for row in rows)
    assert all(0 < row["grad_norm"] < 1e3 for row in rows)
    assert (run_dir / "metrics.png").exists() and list((run_dir / "tensorboard").iterdir())
    samples_per_s = sum(row["samples_per_s"] for row in rows[1:]) / len(rows[1:])  # after warm-up
    comm = sorted(row["comm_share"] for row in rows)[len(rows) // 2]
    print(
        f"\nGPU-RESULT nccl={profile} transports={','.join(transports)} "
        f"samples_per_s={samples_per_s:.0f} final_loss={rows[-1]['loss']:.4f} comm_share={comm:.2f}"
    )


def test_doctor_recommends_a_working_profile_and_auto_is_near_the_best():
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    results = {r["profile"]: r for r in report["profiles"]}
    best = max(r["busbw_gbps"]["1024MiB"] for r in results.values() if r["result"] == "works")
    assert results["auto"]["result"] == "works"
    assert results["auto"]["busbw_gbps"]["1024MiB"] >= 0.95 * best
    if any(row["link"] == "NVLink" for row in report["p2p"]):
        assert "NCCL_P2P_DISABLE" not in results["auto"]["env"]
    print("\nGPU-DOCTOR\n" + doctor.render(report))


def test_a_hung_rank_under_nccl_fails_fast_with_the_remedy(tmp_path):
    timeout_s = 20
    code, output, seconds = hang_one_rank(tmp_path, timeout_s=timeout_s)
    print(f"\nGPU-RESULT hung rank: exit {code} after {seconds:.0f} s")
    assert code != 0
    assert seconds <= timeout_s + 60, output[-3000:]
    assert output.count("A collective failed on rank 0 (nccl)") == 1, output[-3000:]
    block = output.split("A collective failed", 1)[1].split("=" * 78)[0]
    # The gate passed, so the transport works: the cause is the silent peer, not P2P or /dev/shm.
    assert "Another process stopped answering" in block and "NCCL environment in force" in block
    assert "peer-to-peer" not in block and "/dev/shm" not in block

"""The same end-to-end run with backend nccl on 2 GPUs. Skipped where fewer than 2 are visible."""

import re

import pytest
import torch
from conftest import read_metrics, torchrun

from {{ cookiecutter.package }}.probe import nvidia_smi_topology, nvlink_pairs_from_topo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

# NCCL_DEBUG=INFO prints one line per channel, e.g. "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read"
TRANSPORT = re.compile(r"via (P2P/[\w/]+|SHM/[\w/]+|NET/[\w/]+)")


@pytest.mark.parametrize("profile", ["auto", "nccl_default", "pcie_safe"])
def test_two_gpus_train_with_nccl(tmp_path, profile):
    run_dir = tmp_path / "run"
    done = torchrun(tmp_path, f"nccl={profile}", "trainer.max_steps=300", f"hydra.run.dir={run_dir}",
                    env={"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,P2P,SHM,NET"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    transports = sorted(set(TRANSPORT.findall(done.stdout + done.stderr)))
    assert transports, "NCCL printed no transport lines"
    if profile == "pcie_safe":
        assert not any(t.startswith("P2P") for t in transports)
    elif (0, 1) in nvlink_pairs_from_topo(nvidia_smi_topology()):
        assert any(t.startswith("P2P") for t in transports), "NVLink GPUs must keep P2P"
    rows = read_metrics(run_dir)
    assert "backend nccl" in (run_dir / "train.log").read_text()
    assert rows[-1]["loss"] < 0.75 * rows[0]["loss"]
    samples_per_s = sum(row["samples_per_s"] for row in rows[1:]) / len(rows[1:])  # after warm-up
    print(f"\nGPU-RESULT nccl={profile} transports={','.join(transports)} "
          f"samples_per_s={samples_per_s:.0f} final_loss={rows[-1]['loss']:.4f}")  # fmt: skip

"""The doctor on a machine without GPUs: it says so, and checks gloo instead."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import PACKAGE


def doctor(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(
    torch.cuda.device_count() > 0, reason="GPUs present: tests/test_gpu.py covers them"
)
def test_doctor_without_gpus_checks_gloo_and_says_so():
    done = doctor("--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert "no CUDA device is visible" in report["note"]
    (gloo,) = report["profiles"]
    assert gloo["result"] == "works" and gloo["busbw_gbps"]["64MiB"] > 0
    assert report["dev_shm_bytes"] > 0 and "lo" in report["interfaces"]


def test_doctor_text_report_names_the_checks():
    done = doctor()
    assert done.returncode == 0, done.stderr[-2000:]
    for heading in ("torch ", "InfiniBand:", "/dev/shm:", "Interfaces:", "profile", "(bus GB/s)"):
        assert heading in done.stdout

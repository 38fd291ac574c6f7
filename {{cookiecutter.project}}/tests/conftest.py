"""Helpers that run the project the way users do: compose the real config, launch torchrun."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from {{ cookiecutter.package }}.config import register_configs

PACKAGE = "{{ cookiecutter.package }}"


@pytest.fixture
def compose_train():
    """compose_train(*overrides) -> the composed DictConfig of configs/train.yaml."""
    register_configs()

    def _compose(*overrides: str):
        with initialize_config_module(config_module=f"{PACKAGE}.configs", version_base="1.3"):
            return compose(config_name="train", overrides=list(overrides))

    return _compose


def torchrun(
    cwd: Path, *overrides: str, nproc: int = 2, env: dict | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node N -m <package>.train <overrides>` in `cwd`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", f"{PACKAGE}.train", *overrides]  # fmt: skip
    return subprocess.run(
        command, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

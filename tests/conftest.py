"""Render the template the way users do: cookiecutter's API and its real command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter

TEMPLATE = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEFAULTS = json.loads((TEMPLATE / "cookiecutter.json").read_text())
PROFILES = DEFAULTS["nccl_profile"]


def render(output_dir: Path, **context) -> Path:
    """Render with `context` over the defaults, no prompts; returns the project directory."""
    return Path(cookiecutter(str(TEMPLATE), no_input=True, extra_context=context, output_dir=str(output_dir)))


def cookiecutter_cli(output_dir: Path, *answers: str) -> subprocess.CompletedProcess:
    """`cookiecutter <template> --no-input key=value ...`, as a user would type it."""
    return subprocess.run(
        [str(BIN / "cookiecutter"), str(TEMPLATE), "--no-input", "--output-dir", str(output_dir), *answers],
        capture_output=True,
        text=True,
        timeout=120,
    )


def install(project: Path, target: Path) -> Path:
    """A non-editable `pip install .` into `target`, as the Dockerfile does; returns `target`."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(project)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def env_with_path(site: Path, **extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(site), **extra}


@pytest.fixture(scope="session")
def default_project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="session")
def installed_default(default_project, tmp_path_factory) -> Path:
    """The default project installed non-editably; put it on PYTHONPATH to use it."""
    return install(default_project, tmp_path_factory.mktemp("site"))

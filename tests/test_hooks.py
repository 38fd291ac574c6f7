"""Hostile or invalid answers: refused in one clear line with nothing left behind, or rendered
into files that stay valid and carry the text exactly."""

import json
import subprocess
import sys
import tomllib

import pytest
import yaml
from conftest import DEFAULTS, TEMPLATE, cookiecutter_cli, render

REFUSED = [
    ("project", "My Project", "project 'My Project' is not a Kubernetes DNS-1123 label"),
    ("project", "a" * 64, "is not a Kubernetes DNS-1123 label: use 1 to 63 lowercase"),
    ("project", "-leading-dash", "is not a Kubernetes DNS-1123 label"),
    ("project", "../escape", "project '../escape' is not a Kubernetes DNS-1123 label"),
    ("project", 'x"; rm -rf ~; "', "is not a Kubernetes DNS-1123 label"),
    ("project", "$(touch pwned)", "is not a Kubernetes DNS-1123 label"),
    ("project", "a`id`b", "is not a Kubernetes DNS-1123 label"),
    ("package", "class", "package 'class' is a Python keyword"),
    ("package", "1st_model", "package '1st_model' is not a Python package name"),
    ("package", "my-package", "is not a Python package name"),
    ("package", "torch", "package 'torch' would shadow the module of the same name"),
    ("package", "os", "package 'os' would shadow the module of the same name"),
    ("package", "café", "is not a Python package name: use lowercase ASCII letters"),
    ("num_gpus", "0", "num_gpus '0' is not a whole number of GPUs per node: use an integer from 1 to 16"),
    ("num_gpus", "17", "use an integer from 1 to 16"),
    ("num_gpus", "two", "use an integer from 1 to 16"),
    ("num_gpus", "2; reboot", "use an integer from 1 to 16"),
    ("num_nodes", "0", "num_nodes '0' is not a whole number of nodes: use an integer from 1 to 256"),
    ("num_nodes", "many", "use an integer from 1 to 256"),
    ("python_version", "2.7", "python_version '2.7' is not supported: use one of 3.11, 3.12, 3.13"),
    ("image", 'evil" && curl x', "is not an image reference"),
    ("image", "ghcr.io/acme/x:$(id)", "is not an image reference"),
    ("base_image", "pytorch/pytorch:latest\nRUN curl x", "is not an image reference"),
    ("namespace", "Kube-System", "namespace 'Kube-System' is not a Kubernetes DNS-1123 label"),
    ("description", "line one\nRUN rm -rf /", "contains a newline or control character"),
    ("author", "{% raw %}{{ cookiecutter.__class__ }}{% endraw %}", "contains template delimiters"),
    ("description", "x" * 201, "description is 201 characters long: use at most 200"),
]


@pytest.mark.parametrize(("key", "value", "message"), REFUSED, ids=[f"{k}:{v[:20]!r}" for k, v, _ in REFUSED])
def test_bad_answer_is_refused_in_one_line_and_leaves_nothing(tmp_path, key, value, message):
    done = cookiecutter_cli(tmp_path, f"{key}={value}")
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1, done.stderr
    assert message in ours[0]
    assert list(tmp_path.iterdir()) == []


def test_derived_answers_do_not_repeat_the_first_problem(tmp_path):
    """A bad project name also spoils the derived package and image: report only the cause."""
    done = cookiecutter_cli(tmp_path, "project=Bad Name")
    ours = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert ours == [
        "error: project 'Bad Name' is not a Kubernetes DNS-1123 label: use 1 to 63 lowercase "
        "letters, digits and '-', starting and ending with a letter or digit (e.g. ddp-project)"
    ]


SHELL_AND_QUOTES = """O'Brien "the \\"DDP\\" one" $(id) `uname` ${HOME}; rm -rf ~ & <b> ''' \"\"\" \\"""


@pytest.mark.parametrize("key", ["description", "author"])
def test_quotes_and_shell_text_render_into_valid_files_verbatim(tmp_path, key):
    project = render(tmp_path, **{key: SHELL_AND_QUOTES})
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    rendered = meta["description"] if key == "description" else meta["authors"][0]["name"]
    assert rendered == SHELL_AND_QUOTES
    for path in project.rglob("*.yaml"):
        yaml.safe_load(path.read_text())
    for name in ("Dockerfile", "k8s/job.yaml") + tuple(str(p.relative_to(project)) for p in project.rglob("*.py")):
        assert "$(id)" not in (project / name).read_text(), name  # free text stays out of code and shell


def test_invalid_profile_choice_leaves_nothing(tmp_path):
    done = cookiecutter_cli(tmp_path, "nccl_profile=fastest")
    assert done.returncode != 0
    assert "fastest provided for choice variable nccl_profile" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_gpus", "16"),
        ("num_gpus", "1"),
        ("num_nodes", "256"),
        ("python_version", "3.13"),
        ("image", "registry.local:5000/team/ddp@sha256:" + "a" * 64),
    ],
)
def test_boundary_values_are_accepted(tmp_path, key, value):
    done = cookiecutter_cli(tmp_path, f"{key}={value}")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ddp-project" / "k8s" / "job.yaml").exists()


def test_old_cookiecutter_is_refused_with_the_upgrade_command(tmp_path):
    """Run the pre-gen hook as cookiecutter would, but under a stand-in cookiecutter 2.6."""
    fake = tmp_path / "fake" / "cookiecutter"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.6.0"\n')
    answers = {**DEFAULTS, "package": "ddp_project", "image": "ghcr.io/acme/ddp-project:latest"}
    answers["nccl_profile"] = answers["nccl_profile"][0]
    hook = (TEMPLATE / "hooks" / "pre_gen_project.py").read_text()
    script = tmp_path / "hook.py"
    script.write_text(hook.replace("{{ cookiecutter | tojson }}", json.dumps(answers)))
    done = subprocess.run(
        [sys.executable, str(script)], env={"PYTHONPATH": str(fake.parent)}, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "error: cookiecutter 2.6.0 is too old: this template needs 2.7 or newer (pip install 'cookiecutter>=2.7')"
    )

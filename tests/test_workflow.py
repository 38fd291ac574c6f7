"""The generated GitHub workflow: valid for GitHub, its actions pinned, the image built on every
push and pull request, and on a version tag the image that k8s/ pulls pushed, or nothing."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import BIN, render

WORKFLOW = Path(".github", "workflows", "ci.yml")
# A release's tag (v1.2.3) or a commit: a major tag (@v7) moves under the workflow.
PINNED = re.compile(r"[\w.-]+/[\w.-]+@(v\d+\.\d+\.\d+|[0-9a-f]{40})")
OTHER_IMAGE = "registry.example.com:5000/team/other-run:2.0.1"


@pytest.fixture(scope="module")
def other_project(tmp_path_factory) -> Path:
    """Unlike the default in every answer the workflow depends on: the Python version it tests
    with, and an image on a registry that is not ghcr.io, reached through a port."""
    return render(tmp_path_factory.mktemp("workflow"), project="other-run", python_version="3.13", image=OTHER_IMAGE)


def workflow_of(project: Path) -> dict:
    return yaml.safe_load((project / WORKFLOW).read_text())


def test_the_rendered_workflows_pass_githubs_workflow_schema(default_project, other_project):
    """SchemaStore's schema for GitHub workflows, as check-jsonschema ships it (no network):
    actionlint's PyPI package builds by downloading its binary from GitHub, which neither this
    machine nor CI reaches."""
    files = [default_project / WORKFLOW, other_project / WORKFLOW]
    done = subprocess.run([BIN / "check-jsonschema", "--builtin-schema", "vendor.github-workflows", *files],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (setup_python,) = [s for s in workflow_of(other_project)["jobs"]["test"]["steps"]
                       if s.get("uses", "").startswith("actions/setup-python@")]  # fmt: skip
    assert setup_python["with"]["python-version"] == "3.13"


def test_every_action_is_pinned_to_a_release_or_a_commit(default_project):
    uses = [step["uses"] for job in workflow_of(default_project)["jobs"].values() for step in job["steps"]
            if "uses" in step]  # fmt: skip
    assert {use.split("@")[0] for use in uses} >= {
        "actions/checkout", "docker/setup-buildx-action", "docker/login-action", "docker/build-push-action",
    }  # fmt: skip
    assert [use for use in uses if not PINNED.fullmatch(use)] == []


def steps_using(job: dict, action: str) -> list[dict]:
    return [step for step in job["steps"] if step.get("uses", "").startswith(f"{action}@")]


def test_the_image_is_built_on_every_push_and_pushed_only_for_a_tag_once_the_tests_pass(default_project):
    workflow = workflow_of(default_project)
    events = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert events["push"] == {"branches": ["main"], "tags": ["v*"]} and "pull_request" in events
    assert workflow["permissions"] == {"contents": "read"}
    jobs = workflow["jobs"]
    (build,) = steps_using(jobs["image"], "docker/build-push-action")
    assert build["with"]["push"] is False and "if" not in jobs["image"]
    assert build["with"]["cache-to"] == "type=gha,mode=max"
    release = jobs["push-image"]
    assert release["if"] == "github.ref_type == 'tag'" and set(release["needs"]) == {"test", "image"}
    # Only the pushing job may write packages.
    assert release["permissions"] == {"contents": "read", "packages": "write"}
    assert [name for name, job in jobs.items() if "permissions" in job] == ["push-image"]
    (push,) = steps_using(release, "docker/build-push-action")
    assert push["with"]["push"] is True and push["with"]["tags"] == "${{ steps.image.outputs.image }}"
    (login,) = steps_using(release, "docker/login-action")
    assert login["with"]["registry"] == "${{ steps.image.outputs.registry }}"
    steps = [step.get("id", step.get("uses", "").split("@")[0]) for step in release["steps"]]
    assert steps.index("image") < steps.index("docker/login-action") < steps.index("docker/build-push-action")


def tag_check(project: Path, folder: Path, tag: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The push job's step `image`, run as GitHub runs it (bash -e) in `folder` on the tag `tag`:
    what it printed, and its outputs."""
    (step,) = [s for s in workflow_of(project)["jobs"]["push-image"]["steps"] if s.get("id") == "image"]
    outputs = folder / "github_output"
    outputs.write_text("")
    done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], cwd=folder,
                          env={"PATH": "/usr/bin:/bin", "GITHUB_REF_NAME": tag, "GITHUB_OUTPUT": str(outputs)},
                          capture_output=True, text=True)  # fmt: skip
    return done, dict(line.split("=", 1) for line in outputs.read_text().splitlines())


def test_a_tag_pushes_the_image_k8s_pulls_when_it_carries_the_tags_version(default_project, other_project):
    done, outputs = tag_check(default_project, default_project, "v0.1.0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert outputs == {"image": "ghcr.io/your-org/ddp-project:0.1.0", "registry": "ghcr.io"}
    done, outputs = tag_check(other_project, other_project, "v2.0.1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert outputs == {"image": OTHER_IMAGE, "registry": "registry.example.com:5000"}


def test_a_tag_that_k8s_does_not_pull_pushes_nothing_and_says_what_to_set(default_project):
    done, outputs = tag_check(default_project, default_project, "v0.2.0")
    assert done.returncode != 0 and outputs == {}
    assert done.stdout.strip() == (
        "::error::tag v0.2.0 pushes ghcr.io/your-org/ddp-project:0.2.0, k8s/ pulls "
        "ghcr.io/your-org/ddp-project:0.1.0: set deploy.image=ghcr.io/your-org/ddp-project:0.2.0, "
        "regenerate k8s/, tag again"
    )


DIGEST = "@sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("image", "tag", "outcome"),
    [
        ("acme/trainer:1.0.0", "v1.0.0", "registry=docker.io"),  # Docker Hub: no registry named
        ("localhost/trainer:1.0.0", "v1.0.0", "registry=localhost"),
        # A digest names a build made before the push: the tagged commit names the tag.
        (f"ghcr.io/acme/trainer:1.0.0{DIGEST}", "v1.0.0", "set deploy.image=ghcr.io/acme/trainer:1.0.0"),
        (f"ghcr.io/acme/trainer{DIGEST}", "v1.0.0", "set deploy.image=ghcr.io/acme/trainer:1.0.0"),
        (f"example.com:5000/trainer{DIGEST}", "v1.0.0", "set deploy.image=example.com:5000/trainer:1.0.0"),  # a port
        ("ghcr.io/acme/trainer:1.0.0", "v1.0.1", "set deploy.image=ghcr.io/acme/trainer:1.0.1"),
    ],
)
def test_the_registry_follows_dockers_naming_and_only_the_tags_own_image_is_pushed(
    default_project, tmp_path, image, tag, outcome
):
    """The images a user may set in deploy.image, in k8s/ as the renderer writes them."""
    (tmp_path / "k8s").mkdir()
    (tmp_path / "k8s" / "job.yaml").write_text(f"spec:\n  containers:\n    - name: node\n      image: {image}\n")
    (tmp_path / "k8s" / "service.yaml").write_text("kind: Service\n")
    done, outputs = tag_check(default_project, tmp_path, tag)
    if outcome.startswith("set "):
        assert done.returncode != 0 and outputs == {}
        assert f": {outcome}, regenerate k8s/" in done.stdout, done.stdout
    else:
        assert done.returncode == 0, done.stdout + done.stderr
        assert outputs == {"image": image, "registry": outcome.removeprefix("registry=")}

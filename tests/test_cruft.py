"""Projects follow template changes with cruft: create, then update across a template commit,
offline, against a local git copy of this template."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, TEMPLATE

GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "init.defaultBranch=main"]
TEMPLATE_FILES = ["cookiecutter.json", "local_extensions.py", "hooks", "{{cookiecutter.project}}"]


def run(*command, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([str(part) for part in command], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def commit(repo: Path, message: str) -> str:
    run(*GIT, "add", "-A", cwd=repo)
    run(*GIT, "commit", "-q", "-m", message, cwd=repo)
    return run(*GIT, "rev-parse", "HEAD", cwd=repo).stdout.strip()


@pytest.fixture
def template_repo(tmp_path) -> Path:
    """A git repository holding a copy of this template."""
    repo = tmp_path / "template"
    repo.mkdir()
    for name in TEMPLATE_FILES:
        source = TEMPLATE / name
        if source.is_dir():
            shutil.copytree(source, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, repo / name)
    run(*GIT, "init", "-q", cwd=repo)
    commit(repo, "template v1")
    return repo


def test_no_nested_templates():
    """cruft renders the one project folder; a second cookiecutter.json would be a nested template."""
    projects = [p.name for p in TEMPLATE.iterdir() if p.name.startswith("{{")]
    assert projects == ["{{cookiecutter.project}}"]
    nested = TEMPLATE.glob("*/**/cookiecutter.json")
    # .bench-ref/ holds another commit's template for scripts/gpu-compare.sh: git-ignored, never cruft's
    assert [path for path in nested if path.relative_to(TEMPLATE).parts[0] != ".bench-ref"] == []


def test_cruft_create_then_update_across_a_template_change(template_repo, tmp_path):
    out = tmp_path / "out"
    run(BIN / "cruft", "create", template_repo, "--no-input", "--output-dir", out,
        "--extra-context", json.dumps({"project": "tracked", "num_gpus": 4}), cwd=tmp_path)  # fmt: skip
    project = out / "tracked"
    state = json.loads((project / ".cruft.json").read_text())
    assert state["template"] == str(template_repo) and state["context"]["cookiecutter"]["num_gpus"] == "4"
    assert (project / "k8s" / "job.yaml").exists()  # the post-generation hook ran
    run(*GIT, "init", "-q", cwd=project)
    commit(project, "generated")
    run(BIN / "cruft", "check", cwd=project)

    # A local edit the update must keep, and a template change it must bring in.
    readme = project / "README.md"
    readme.write_text(readme.read_text() + "\nOur own notes.\n")
    commit(project, "our notes")
    trainer = template_repo / "{{cookiecutter.project}}" / "configs" / "trainer" / "default.yaml"
    trainer.write_text(trainer.read_text().replace("max_steps: 300 ", "max_steps: 400 "))
    new_head = commit(template_repo, "template v2: longer default run")
    stale = subprocess.run([BIN / "cruft", "check"], cwd=project, capture_output=True, text=True)
    assert stale.returncode != 0

    run(BIN / "cruft", "update", "--skip-apply-ask", cwd=project)
    assert "max_steps: 400 " in (project / "configs" / "trainer" / "default.yaml").read_text()
    assert readme.read_text().endswith("\nOur own notes.\n")
    assert json.loads((project / ".cruft.json").read_text())["commit"] == new_head
    run(BIN / "cruft", "check", cwd=project)
    # The hook's output is the same on every render: the update leaves k8s/ untouched.
    changed = run(*GIT, "status", "--porcelain", cwd=project).stdout.split("\n")
    assert not [line for line in changed if "k8s/" in line]

"""docs/extending.md's recipes, followed to the letter: its edits, read from the page, made in a
copy of the project's package and configs/, which its commands then use (PYTHONPATH; the installed
package knows none of the three). The flavor renders and is accepted as deploy.flavor=<name>, the
model and the logger pass the check and build. Three subprocesses, a few seconds."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import PACKAGE, ROOT

from ddp_project.config import registry
from ddp_project.k8s.flavors import FLAVORS

DOC = ROOT / "docs" / "extending.md"
# An edit: its file and where, in bold before its code block.
EDIT = re.compile(
    r"\*\*`(?P<path>[^`]+)`\*\*, (?:(?P<new>a new file)|above the line `(?P<above>[^`]+)`"
    r"|below the line `(?P<below>[^`]+)`|the line `(?P<replace>[^`]+)` becomes)"
)
CODE = re.compile(r"```[a-z]*\n(.*?)```", re.DOTALL)
NAMES = {"model": "linear", "logger": "console", "flavor": "appwrapper"}  # the page's examples


def edits(section: str) -> list[tuple[re.Match, str]]:
    """The edits under `## <section>`, each with the code block that follows it."""
    text = DOC.read_text()
    part = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    found = []
    for match in EDIT.finditer(part):
        code = CODE.search(part, match.end())
        assert code, f"{DOC}: {match[0]} has no code block after it"
        found.append((match, code[1]))
    return found


def make(root: Path, edit: re.Match, code: str) -> None:
    path = root / edit["path"].replace("src/ddp_project/", f"src/{PACKAGE}/")
    if edit["new"]:
        assert not path.exists(), f"{edit['path']}: the page adds it, but the project has one"
        path.write_text(code)
        return
    marker = edit["above"] or edit["below"] or edit["replace"]
    lines = path.read_text().splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line.rstrip("\n") == marker]
    assert len(at) == 1, f"{edit['path']}: the line {marker!r} is there {len(at)} times, not once"
    (i,) = at
    if edit["above"]:
        lines[i:i] = [code]
    elif edit["below"]:
        lines[i + 1 : i + 1] = [code]
    else:
        lines[i] = code
    path.write_text("".join(lines))


@pytest.fixture(scope="module")
def extended(tmp_path_factory) -> Path:
    """A copy of the package with configs/ inside it, as an install has it (and configs/ beside,
    as the page names it), with every edit of the page made."""
    root = tmp_path_factory.mktemp("extended")
    package = root / "src" / PACKAGE
    shutil.copytree(ROOT / "src" / PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(
        ROOT / "configs", package / "configs", ignore=shutil.ignore_patterns("__pycache__", "local")
    )
    (root / "configs").symlink_to(package / "configs")
    for section in ("Add a model", "Add a logger", "Add a flavor"):
        found = edits(section)
        assert found, f"{DOC}: no edits under ## {section}"
        for edit, code in found:
            make(root, edit, code)
    return root


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_examples_are_new_to_the_project():
    """What the copy accepts, the project itself does not have: the page adds it."""
    assert registry.named("model", NAMES["model"]) is None
    assert registry.named("logger", NAMES["logger"]) is None
    assert NAMES["flavor"] not in FLAVORS


def test_a_flavor_added_as_the_page_says_renders_and_is_accepted(extended):
    flavor = NAMES["flavor"]
    done = run(
        extended,
        "-m",
        f"{PACKAGE}.k8s",
        "--out",
        "k8s",
        f"deploy.flavor={flavor}",
        "deploy.nodes=2",
        "deploy.runs_access_mode=ReadWriteMany",
        "deploy.queue=team-a",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    files = sorted(p.name for p in (extended / "k8s").iterdir())
    assert files == [f"{flavor}.yaml", "runs-pvc.yaml"], done.stdout
    text = (extended / "k8s" / f"{flavor}.yaml").read_text()
    assert "# Needs the AppWrapper controller (workload.codeflare.dev).\n" in text
    workload = yaml.safe_load(text)
    assert (workload["kind"], workload["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]) == (
        "AppWrapper",
        "team-a",
    )
    job, service = (c["template"] for c in workload["spec"]["components"])
    assert (job["kind"], service["kind"]) == ("Job", "Service")
    assert "kueue.x-k8s.io/queue-name" not in job["metadata"]["labels"]  # the AppWrapper's alone
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    # the entry's notes: the lost node's, and Kueue's integration to enable
    assert "the Job replaces it only when it has failed" in done.stdout
    assert "its workload.codeflare.dev/appwrapper integration" in done.stdout
    deploy = yaml.safe_load((extended / "configs" / "deploy" / "default.yaml").read_text())
    assert deploy["flavor"] == flavor  # the override, written where the page says


def test_a_model_and_a_logger_added_as_the_page_says_pass_the_check_and_build(extended):
    model, logger, flavor = NAMES["model"], NAMES["logger"], NAMES["flavor"]
    both = [f"model={model}", f"logger=[csv,{logger}]", f"deploy.flavor={flavor}"]
    done = run(extended, "-m", f"{PACKAGE}.check", *both)
    assert (done.returncode, done.stdout) == (0, "config ok\n"), done.stderr[-3000:]
    refused = run(
        extended, "-m", f"{PACKAGE}.check", f"logger={logger}", f"logger.{logger}.every=0"
    )
    assert (refused.returncode, refused.stderr) == (
        2,
        f"config error: logger.{logger}.every=0: must be at least 1\n",
    )
    # The builders the page registers: the model as training builds it, the logger given a row.
    script = """
import json, sys, tempfile
from pathlib import Path
import torch
from PACKAGE.config.compose import compose_and_check
from PACKAGE.record import loggers
from PACKAGE.model import build_model
cfg = compose_and_check(sys.argv[1:])
net = build_model(cfg.model, cfg.data)
out = net(torch.zeros(3, cfg.data.num_features))
started = loggers.build(cfg.logger, Path(tempfile.mkdtemp()), 0, dict())
started.log(dict.fromkeys(loggers.TAGS) | dict(step=7, loss=0.5, lr=0.001))
named = sorted(started.named)
started.close()
print(json.dumps([type(net).__name__, list(out.shape), net.flops_per_token(), named]))
""".replace("PACKAGE", PACKAGE)
    built = run(extended, "-c", script, *both)
    assert built.returncode == 0, built.stderr[-3000:]
    printed, result = built.stdout.splitlines()[-2:]
    assert printed == "step 7: train/loss=0.5 train/lr=0.001"
    data = yaml.safe_load((extended / "configs" / "data" / "synthetic.yaml").read_text())
    weights = (data["num_features"] + 1) * data["num_classes"]  # model.linear.bias: true
    assert json.loads(result) == ["Linear", [3, data["num_classes"]], 6 * weights, [logger]]

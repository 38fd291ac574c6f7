"""Render k8s/ from the generated configs/ with the project's own renderer, then print the next
steps. Local and idempotent: cruft re-runs this hook on every update."""

import fnmatch
import importlib
import json
import os
import re
import shlex
import sys
from pathlib import Path

ANSWERS = json.loads(r'''{{ cookiecutter | tojson }}''')  # fmt: skip

# The tests (and ruff's first-party setting) spell the package as the default answers name it, so
# that the template's tests are Python that ruff and an editor read; here they take this project's
# name, in whichever file of the project spells it. The package imports its own modules relatively.
TESTS_PACKAGE = "ddp_project"


def project_files():
    """What the template wrote. A render over an existing project (--overwrite-if-exists) finds
    more there: git's files, what .gitignore keeps out (a venv, runs), links to elsewhere."""
    gitignore = Path(".gitignore")
    lines = gitignore.read_text(encoding="utf-8").splitlines() if gitignore.exists() else []
    ignored = [".git", *(line.strip().strip("/") for line in lines if line.strip() and not line.startswith("#"))]

    def mine(path: Path) -> bool:
        return not any(fnmatch.fnmatch(path.name, p) or fnmatch.fnmatch(path.as_posix(), p) for p in ignored)

    for folder, dirs, files in os.walk("."):
        dirs[:] = [d for d in dirs if mine(Path(folder, d))]
        yield from (path for path in (Path(folder, f) for f in files) if mine(path) and not path.is_symlink())


if ANSWERS["package"] != TESTS_PACKAGE:
    for path in project_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: it spells no module name
        renamed = re.sub(rf"\b{TESTS_PACKAGE}\b", ANSWERS["package"], text)
        if renamed != text:
            path.write_text(renamed, encoding="utf-8")

# The renderer needs only the standard library and PyYAML (a dependency of cookiecutter).
sys.path.insert(0, "src")
sys.dont_write_bytecode = True  # a new project holds what was rendered: no __pycache__ in src/
render = importlib.import_module(f"{ANSWERS['package']}.k8s.render")
sync = importlib.import_module(f"{ANSWERS['package']}.k8s.sync")
try:
    rendered = render.from_files(Path("configs"), ANSWERS["nccl_profile"])
except ValueError as problem:  # a deploy value the renderer refuses: one line; cookiecutter removes the project
    print(f"error: {problem}", file=sys.stderr, flush=True)
    sys.exit(1)
sync.write(rendered, Path("k8s"))

STEPS = [  # the same lines as the quick starts of the project's and the template's READMEs
    "python3 -m venv .venv && . .venv/bin/activate",
    "make torch                               # PyTorch's CPU build, or PyPI's where that index is out of reach",
    "make install                             # the project, editable, with its test tools",
    f'make train-cpu ARGS="experiment=smoke"   # 2 CPU processes, 20 steps; make train: {ANSWERS["num_gpus"]} GPU(s)',
    "make test                                # the fast CPU tests; GPU tests run where 2 GPUs are visible",
]
# This hook runs in the new project, not where the user typed the command (./new-project -o ..
# from a clone, cookiecutter --output-dir ...): only the absolute path is right from anywhere.
print(f"\nCreated {ANSWERS['project']}/. Next:\n  cd {shlex.quote(str(Path.cwd()))}")
print("".join(f"  {step}\n" for step in STEPS))

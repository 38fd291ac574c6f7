"""Render k8s/ from the generated configs/ with the project's own renderer, then print the next
steps. Local and idempotent: cruft re-runs this hook on every update."""

import importlib
import json
import re
import shlex
import sys
from pathlib import Path

ANSWERS = json.loads(r'''{{ cookiecutter | tojson }}''')  # fmt: skip

# The tests (and ruff's first-party setting) spell the package as the default answers name it, so
# that the template's tests are Python that ruff and an editor read; here they take this project's
# name. The package itself imports its own modules relatively.
TESTS_PACKAGE = "ddp_project"
if ANSWERS["package"] != TESTS_PACKAGE:
    for path in [*Path("tests").glob("*.py"), Path("ruff.toml")]:
        text = path.read_text(encoding="utf-8")
        path.write_text(re.sub(rf"\b{TESTS_PACKAGE}\b", ANSWERS["package"], text), encoding="utf-8")

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

"""Render k8s/ from the generated configs/ with the project's own renderer, then print the next
steps. Local and idempotent: cruft re-runs this hook on every update."""

import importlib
import json
import sys
from pathlib import Path

ANSWERS = json.loads(r'''{{ cookiecutter | tojson }}''')  # fmt: skip

# The renderer needs only the standard library and PyYAML (a dependency of cookiecutter).
sys.path.insert(0, "src")
k8s = importlib.import_module(f"{ANSWERS['package']}.k8s")
try:
    rendered = k8s.from_files(Path("configs"), ANSWERS["nccl_profile"])
except ValueError as problem:  # a deploy value k8s.py refuses: one line; cookiecutter removes the project
    print(f"error: {problem}", file=sys.stderr, flush=True)
    sys.exit(1)
k8s.write(rendered, Path("k8s"))

print(
    f"""
Created {ANSWERS["project"]}/. Next:
  cd {ANSWERS["project"]}
  python -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'
  {ANSWERS["project"]} train --nproc-per-node 2     # checks the config, then torchrun: 2 GPUs, or 2 CPU processes
  pytest
  python -m {ANSWERS["package"]}.k8s --check     # k8s/ matches configs/ (after edits: drop --check)
"""
)

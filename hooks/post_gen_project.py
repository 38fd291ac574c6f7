"""Print the next steps. Local and idempotent: cruft re-runs this hook on every update."""

import json

ANSWERS = json.loads(r'''{{ cookiecutter | tojson }}''')  # fmt: skip

print(
    f"""
Created {ANSWERS["project"]}/. Next:
  cd {ANSWERS["project"]}
  python -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]'
  torchrun --standalone --nproc-per-node 2 -m {ANSWERS["package"]}.train
  pytest
"""
)

"""The package's folders are its architecture (docs/layout.md): the commands and the user's files at
the top, the machinery in wings below them, each wing importing only itself and the wings under it;
only a command (or a Hydra callback, where Hydra hands train control) ends the process.

    python -m pytest tests/test_architecture.py     # after moving a module, or adding an import

Read from the source with ast, every import counted, those inside functions too: what a reader has
to trace, whether or not it runs at import time.
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "src" / "ddp_project"
# The wings, from the ground up: a wing imports itself and those before it, never one after it.
WINGS = ["core", "nccl", "k8s", "config", "record", "run", "launcher"]
# The user's files: beside the commands at the top, and imported by them.
USERS_FILES = {"model", "data"}
# Where a wing's command reads what only the top may: each with its reason. The test fails once
# one is gone, so that the list never keeps an exception the code no longer has.
ALLOWED_UPWARD = {
    # make k8s-doctor renders the doctor's Job from the config as train composes it, as
    # python -m <package>.k8s (a __main__, so at the top) does.
    ("k8s.doctor", "config.compose"),
}


def modules(root: Path) -> dict[str, Path]:
    """Every module of the package, by its dotted name under it ('run.trainer', 'k8s.__main__')."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The package's modules that `name` imports: `from .x import y` names module x.y where one is
    there, else x."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
            elif node.module and node.module.split(".")[0] == "ddp_project":
                base, node.module = [], node.module.partition(".")[2] or None
            else:
                continue
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{target}.{alias.name}" if target else alias.name
                # a wing's __init__ defines nothing: what is taken from it is a module of it
                yield child if child in known or target in WINGS else target
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ddp_project":
                    yield alias.name.partition(".")[2]


def floor(name: str) -> int:
    """The wing's place from the ground; the top (commands, the user's files, every __main__)
    above them all; the package's face (its __init__) under everything."""
    if name == "":
        return -1
    wing = name.split(".")[0]
    if wing not in WINGS or name.endswith("__main__"):
        return len(WINGS)
    return WINGS.index(wing)


def is_command(name: str, path: Path) -> bool:
    """A command at the top: run as python -m <package>.<name>, and nothing of it for another to
    import (the user's files are imported by the commands)."""
    if "." in name or name in USERS_FILES or name == "":
        return False
    return runs_as_main(path)


# Ending the process: a command's to do. Below the commands, code raises (ConfigError, its
# message the line to print) and the command decides how it ends. An exit is a call of sys.exit,
# os._exit or exit_with_error (however imported), any `.exit(...)` (argparse's), or `raise
# SystemExit`.
EXIT_NAMES = {"exit", "_exit", "exit_with_error"}
# Where the process ends outside a command, each with its reason.
ALLOWED_EXITS = {
    # exit_with_error itself: what commands and callbacks call
    "core.exits",
    # argparse's error(), as one line: only a command's parse_args reaches it
    "core.cli",
    # a stop signal's handler (or the step a stop waited for) ends the process where it lands
    "run.stopping",
}


def exit_calls(path: Path, wing_command: bool) -> Iterator[tuple[str, int]]:
    """(what, line) for each way `path` ends the process, outside a Hydra callback's methods (where
    Hydra hands the train command control, and which end it as a command does). In a wing module
    that python -m also runs (`wing_command`: k8s.apply, nccl.probe), its own entry point may: the
    `if __name__ == "__main__":` block and its main() or cli()."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    exempt = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(base).endswith("Callback") for base in node.bases)
    ]
    if wing_command:
        exempt += [
            node
            for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name in ("main", "cli"))
            or (isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))
        ]
    inside = {id(inner) for node in exempt for inner in ast.walk(node)}
    for node in ast.walk(tree):
        if id(node) in inside:
            continue
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in EXIT_NAMES:
                yield ast.unparse(func), node.lineno
        elif isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if ast.unparse(raised) == "SystemExit":
                yield "raise SystemExit", node.lineno


def runs_as_main(path: Path) -> bool:
    """python -m runs it: a command at the top, or a wing's own (k8s.apply, nccl.probe)."""
    return 'if __name__ == "__main__":' in path.read_text(encoding="utf-8")


def at_the_top(name: str, path: Path) -> bool:
    """A command whose whole module is its own: the top's commands, and every __main__."""
    return is_command(name, path) or name.endswith("__main__")


def problems(root: Path) -> list[str]:
    """Each way the package breaks its layout, one line each."""
    known = modules(root)
    found = [
        f"{name}:{line} ends the process ({what}): only a command or a Hydra callback may; raise "
        "ConfigError (or an error of its own) for the command to end on"
        for name, path in known.items()
        if name not in ALLOWED_EXITS and not at_the_top(name, path)
        for what, line in exit_calls(path, wing_command=runs_as_main(path))
    ]
    graph = {name: set(imported(name, path, known)) - {name} for name, path in known.items()}
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if target not in known:
                found.append(f"{name} imports {target}, which the package does not have")
            elif floor(target) > floor(name) and (name, target) not in ALLOWED_UPWARD:
                found.append(
                    f"{name} imports {target}, above it (a wing imports only the wings under it)"
                )
            elif is_command(target, known[target]):
                found.append(f"{name} imports {target}, a command: what two use belongs in a wing")
    found += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    for pair in sorted(ALLOWED_UPWARD):
        if pair[1] not in graph.get(pair[0], set()):
            found.append(f"{pair[0]} no longer imports {pair[1]}: take it off ALLOWED_UPWARD")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle for each group of modules that import each other, through any path."""
    found, done, stack = [], set(), []

    def visit(name: str) -> None:
        if name in stack:
            loop = stack[stack.index(name) :]
            first = loop.index(min(loop))  # told from its first name, wherever the walk met it
            found.append([*loop[first:], *loop[:first], loop[first]])
            return
        if name in done:
            return
        stack.append(name)
        for target in sorted(graph.get(name, ())):
            visit(target)
        stack.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    return found


def test_the_package_keeps_its_layout():
    assert problems(PACKAGE_DIR) == []


def test_every_wing_is_a_folder_and_every_folder_a_wing():
    folders = {path.name for path in PACKAGE_DIR.iterdir() if (path / "__init__.py").is_file()}
    assert folders == set(WINGS)


@pytest.fixture
def planted(tmp_path):
    """A copy of the package to break."""
    copy = tmp_path / "ddp_project"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def plant(root: Path, module: str, line: str) -> None:
    path = root / module
    path.write_text(path.read_text(encoding="utf-8") + f"\n{line}\n", encoding="utf-8")


@pytest.mark.parametrize(
    ("module", "line", "said"),
    [
        (
            "run/trainer.py",
            "from ..launcher import worker_exits",
            "run.trainer imports launcher.worker_exits, above it",
        ),
        (
            "config/schema.py",
            "from ..record import metrics",
            "config.schema imports record.metrics, above it",
        ),
        ("run/trainer.py", "from .. import model", "run.trainer imports model, above it"),
        (
            "core/world.py",
            "from ddp_project.nccl import probe",
            "core.world imports nccl.probe, above it",
        ),
        ("evaluate.py", "from .train import main_worker", "evaluate imports train, a command"),
        (
            "run/schedule.py",
            "from .trainer import Trainer",
            "import cycle: run.schedule -> run.trainer -> run.schedule",
        ),
        (
            "run/ddp.py",
            "from . import gone",
            "run.ddp imports run.gone, which the package does not have",
        ),
        (
            "config/validate.py",
            "def refused():\n    sys.exit(2)",
            "config.validate:",
        ),
        (
            "run/rundir.py",
            "def refused(world):\n    exit_with_error('config error: x', world)",
            "run.rundir:",
        ),
        (
            "record/perf.py",
            "def corrupt():\n    raise SystemExit('wrong values')",
            "record.perf:",
        ),
        (
            "nccl/probe.py",
            "def refused():\n    exits.exit_with_error('no', World())",
            "nccl.probe:",
        ),
        (
            "config/overrides.py",
            "def refused(parser):\n    parser.exit(2, 'no')",
            "config.overrides:",
        ),
    ],
    ids=[
        "wing-upward",
        "config-upward",
        "wing-imports-user",
        "absolute-upward",
        "command",
        "cycle",
        "missing",
        "exit-in-a-helper",
        "exit-with-error-outside-a-callback",
        "system-exit",
        "exit-in-a-wing-commands-helper",
        "argparse-exit-in-a-helper",
    ],
)
def test_a_planted_break_is_named(planted, module, line, said):
    plant(planted, module, line)
    assert any(problem.startswith(said) for problem in problems(planted)), problems(planted)


def test_an_exception_the_code_no_longer_needs_is_named(planted):
    path = planted / "k8s" / "doctor.py"
    path.write_text(
        path.read_text(encoding="utf-8").replace(
            "from ..config import compose as check", "check = None"
        )
    )
    assert problems(planted) == [
        "k8s.doctor no longer imports config.compose: take it off ALLOWED_UPWARD"
    ]

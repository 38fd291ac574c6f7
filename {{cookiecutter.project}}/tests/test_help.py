"""Every command a user can run answers --help and -h: a usage line on stdout, exit 0, and
nothing done (no run dir, no file, no kubectl call)."""

import json
import re
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import pytest
from conftest import PACKAGE, ROOT

from ddp_project.launch import COMMAND

SOURCE = Path(str(files(PACKAGE)))
MAIN = re.compile(r'^if __name__ == "__main__"', re.MULTILINE)


def module_commands() -> dict[str, tuple[str, ...]]:
    """Every `python -m <module>` of the package: each module that runs as a script
    (src/ddp_project/k8s/__main__.py is `python -m <package>.k8s`), with the
    flags to ask it: argparse reads -h as --help, so -h is asked of the others only (each answer
    costs a process and its imports)."""
    found = {}
    for path in sorted(SOURCE.rglob("*.py")):
        text = path.read_text()
        if MAIN.search(text):
            parts = path.relative_to(SOURCE).with_suffix("").parts
            module = ".".join((PACKAGE, *parts[: -1 if parts[-1] == "__main__" else None]))
            found[module] = ("--help",) if ".parse_args()" in text else ("--help", "-h")
    return found


MODULES = module_commands()
COMMANDS = {  # by the command line shown: (module run as __main__, its argv)
    **{
        f"python -m {module} {flag}": (module, [module, flag])
        for module, flags in MODULES.items()
        for flag in flags
    },
    **{
        f"{COMMAND} {args}": (f"{PACKAGE}.launch", [COMMAND, *args.split()])
        for args in ("--help", "-h", "train --help", "train -h")
    },
}
# Runs each command as `python -m` does (runpy, as __main__, with its argv), one after the other
# in one fresh interpreter: each in an empty folder of its own, its exit code and output kept. A
# process each would pay torch's import 21 times over (45 CPU-seconds) to test what argparse,
# Hydra and the launcher do with --help.
ASK = """
import contextlib, io, json, os, runpy, sys, warnings
answers = {}
for name, (module, argv, cwd) in json.loads(sys.argv[1]).items():
    os.chdir(cwd)
    sys.argv = argv
    out, err, code = io.StringIO(), io.StringIO(), 0
    with (
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    answers[name] = (code, out.getvalue(), err.getvalue())
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """Each command's answer, and the folder it ran in (empty before)."""
    asked = {
        name: (module, argv, str(tmp_path_factory.mktemp("help")))
        for name, (module, argv) in COMMANDS.items()
    }
    done = subprocess.run(
        [sys.executable, "-c", ASK, json.dumps(asked)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path_factory.mktemp("asker"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.splitlines()[-1])
    return {
        name: (subprocess.CompletedProcess(asked[name][1], *said[name]), Path(asked[name][2]))
        for name in asked
    }


def test_the_commands_found_hold_every_one_the_makefile_runs():
    """The list is the package's own modules that run as scripts: the Makefile's are among them."""
    makefile = (ROOT / "Makefile").read_text()
    run = set(re.findall(r"python -m \$\(PACKAGE\)\.([\w.]+)", makefile))
    assert {"doctor", "bench", "k8s", "k8s.apply"} <= run
    assert {f"{PACKAGE}.{name}" for name in run} <= set(MODULES)
    assert len(MODULES) >= 12, MODULES


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_answers_help_with_a_usage_and_does_nothing(answers, name):
    done, cwd = answers[name]
    assert done.returncode == 0, f"{name}: exit {done.returncode}: {done.stderr[-2000:]}"
    assert re.search(r"^usage: ", done.stdout, re.MULTILINE), f"{name}: {done.stdout[:2000]}"
    assert list(cwd.iterdir()) == [], name


def test_trains_help_lists_the_options_a_user_may_choose(answers):
    """Hydra's list of the groups: the schemas the options' YAML names (/mlp_schema) are no
    option of a group (config.register_configs)."""
    done, _ = answers[f"python -m {PACKAGE}.train --help"]
    groups = done.stdout.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    assert "model: gpt, mlp\n" in groups and "data: synthetic, tokens\n" in groups
    assert "schema" not in groups

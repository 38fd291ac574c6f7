"""Every command in both READMEs, and in the project's docs/ pages, runs as written (issue 20, day
one). The project's README is its first hour; docs/*.md are its reference, read the same way.

The commands are read out of the READMEs and the pages, never copied by hand: each line of a ```bash block
(its comment cut off), each `$ ` line of a plain block (with the output shown under it), and each
inline code span that starts with a command, a Hydra override or a `config error:` line. Each one
must match a rule of CLASSIFIED, or the test fails: a new README line cannot slip past. The rule
decides how it runs:

- offline on CPU, for real: the config check (`python -m <package>.check`), `k8s` renders and
  `--check`, `data`, `--cfg job`, `make torch`, `make help`, venv, git, cookiecutter renders;
- to the last step before a launch (a dry run): `<project> train` through the launcher's own checks
  up to the point where it would start torchrun; `bench`, `doctor`, `metrics` and `evaluate`
  through their own argument parsers; `make <target>` as `make -n`, whose lines are classified in
  turn; torchrun's options through its parser;
- what needs a cluster, a registry or the internet: kubectl against an unreachable server (its
  flags and files are read, and it gets as far as connecting), docker as the Dockerfile and the
  tags `make -n` shows, pip as requirements that the project's extras or the template's
  requirements name, `gh:` templates from the local one.

Every Hydra override shown in a README goes through `python -m <package>.check`. The checks and
dry runs share one process beside the project (drive()), so the imports are paid once; the whole
file, its five renders included, costs about 35 CPU-seconds.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from conftest import BIN, FLAVORS, TEMPLATE, local_k8s, render

# ---------------------------------------------------------------- reading the READMEs

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# An inline span is a command when it starts with one of these (or ./something).
COMMAND_WORDS = {
    "make", "python", "python3", "torchrun", "kubectl", "docker", "pip", "cookiecutter", "cruft", "git",
    "cd", "bash", "pre-commit", "pytest", "tensorboard", "wandb", "nvidia-smi", "py-spy", "torchfrtrace",
    "yamllint", "kubernetes-validate", "tune", "yes", "<project>",
}  # fmt: skip
# Quoted log lines that start as a command would: any other span that starts with a bare lowercase
# word is taken for a command, so that a new one must be classified.
LOG_LINES = {"node probe: ...", "rank 1 (pid 4242) was killed by SIGKILL", "via P2P/..."}
LOG_LINE_STARTS = ("training diverged: ",)
OVERRIDE = re.compile(r"^[+~]?[a-z][a-z0-9_]*(\.[A-Za-z0-9_]+)*=\S+$")
HEADING = re.compile(r"^#+ (.*)$", re.MULTILINE)
NOT_HYDRA = {"iommu=pt": "a kernel parameter"}  # key=value in prose that is not an override
# key=value in prose that generate or export takes (not Hydra): read by that command's parser
ARGUMENTS = {
    "generate": {"ckpt", "prompt", "prompt_ids", "max_new_tokens", "temperature", "top_k", "seed", "weights"},
    "export": {"out", "overwrite"},
}


@dataclass(frozen=True)
class Found:
    readme: str  # template, project, local (configs/local/README.md) or docs/<page>.md
    kind: str  # command, override, argument (generate's, export's), error (a `config error:` line) or yaml
    text: str
    section: str = ""  # the heading above it
    expected: str = ""  # for a `$ ` line: the output shown under it

    @property
    def context(self) -> str:
        """The template's README means the template's own Makefile, except in its quick start."""
        return "template" if self.readme == "template" and self.section != "Quick start" else ""


def command_text(line: str) -> str:
    """A shell line without its comment: the first # after a space, outside quotes."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].strip()
    return line.strip()


def extract(text: str, readme: str, project: str = "ddp-project") -> list[Found]:
    """Everything the README shows that can be run or composed, in the order it shows it."""
    found: list[Found] = []
    position = 0
    for fence in [*FENCE.finditer(text), None]:
        prose = text[position : fence.start() if fence else len(text)]
        section = ([""] + HEADING.findall(FENCE.sub("", text[: fence.start() if fence else len(text)])))[-1]
        for span in SPAN.finditer(prose):
            content = " ".join(span.group(2).replace("\\|", "|").split())
            words = content.split()
            if content.startswith("config error: "):
                found.append(Found(readme, "error", content, section))
            elif content in NOT_HYDRA:
                continue
            elif all(OVERRIDE.match(w) and w.split("=")[0] in set().union(*ARGUMENTS.values()) for w in words):
                found.append(Found(readme, "argument", content, section))
            elif all(OVERRIDE.match(word) for word in words):  # one line's worth: checked together
                found.append(Found(readme, "override", content, section))
            elif len(words) == 1 and not words[0].startswith("./"):
                continue  # a name: `torchrun`, `make`, `wandb`, `yes` (an answer), not a command
            elif content in LOG_LINES or content.startswith(LOG_LINE_STARTS):
                continue
            elif words[0] in {*COMMAND_WORDS, project} or re.fullmatch(r"\./[\w-]+|[a-z][a-z0-9-]*", words[0]):
                found.append(Found(readme, "command", content, section))
        if fence is None:
            break
        position = fence.end()
        language, body = fence.group(1), fence.group(2)
        if language == "bash":
            joined = body.replace("\\\n", " ")
            for line in joined.splitlines():
                if command_text(line):
                    found.append(Found(readme, "command", command_text(line), section))
        elif language == "yaml":
            found.append(Found(readme, "yaml", body, section))
        elif language == "":
            lines = body.splitlines()
            for i, line in enumerate(lines):
                if line.startswith("$ "):
                    shown = []
                    for after in lines[i + 1 :]:
                        if after.startswith("$ "):
                            break
                        shown.append(after)
                    found.append(Found(readme, "command", line[2:].strip(), section, "\n".join(shown)))
    return found


# ---------------------------------------------------------------- what each command is

# Named in prose, not run as written: each with the reason.
MENTIONS = {
    "make -n": "what test_render runs on every target",
    "python -m": "the form of a command",
    "yes > /dev/null": "the CPU hog of a timing in the template's README",
    "tune run": "torchtune's command, named for comparison",
    "wandb sync": "uploads to wandb.ai: the internet",
    "py-spy dump": "a debugger, attached to a hung process on a node",
    "nvidia-smi topo -m": "the driver's tool, on a GPU node",
    "pre-commit install": "writes a git hook; test_render validates the config it installs",
    "pre-commit validate-config": "run by test_render",
    "yamllint --strict": "run by test_render",
    "kubernetes-validate --strict": "run by test_render",
    "kubectl apply --dry-run=server --validate=strict": "run by test_cluster on every render",
    "torchrun --nproc-per-node <GPUs>": "the option the pods' launch line passes on, in prose",
    "bash .ci/run": "this suite",
    "cruft create": "a subcommand's name; the fenced cruft lines run it",
    "cruft check": "a subcommand's name; the fenced cruft lines run it",
    "cruft update": "a subcommand's name; the fenced cruft lines run it",
}
# (pattern, rule): the first that matches decides. {project} and {package} are the render's.
CLASSIFIED = [
    (r"python src/", "theirs"),  # lightning-hydra-template's, in the comparison table
    (r"{project} train( |$)", "launcher"),
    (r"python -m {package}\.(check)( |$)", "module-run"),
    (r"python -m {package}\.(k8s|prepare)( |$)", "module-run"),
    (r"python -m {package}\.train (--cfg job|-m \.\.\.)$", "module-run"),
    (r"python -m {package}\.(bench|doctor|metrics)( |$)", "module-parse"),
    (r"python -m {package}\.(evaluate|generate|export)( |$)", "evaluate"),  # their parse()
    (r"python -m pytest( |$)", "generated-suite"),
    (r"pytest -m render$", "generated-suite"),  # the renders' selection, run by test_project
    (r"torchrun .* -m {package}\.train", "torchrun"),
    (r"make (demo|clean)$", "template-make"),
    (r"DDP_TEMPLATE_K8S=\S+ make test-full$", "template-make"),  # the template's, with its API server
    (r"make ", "make"),
    (r"kubectl ", "kubectl"),
    (r"python -m {package}\.k8s\.apply$", "cluster"),  # make k8s-apply's last step
    (r"python -m {package}\.k8s\.doctor( |$)", "cluster"),  # make k8s-doctor: test_cluster runs it
    (r"docker ", "docker"),
    (r"(python3? -m )?pip install ", "pip"),
    (r'python -c "import torch"', "ready"),  # make's guards before a target that needs torch
    (r"command -v {project} ", "ready"),  # and the installed project
    (r"tensorboard --logdir ", "server"),
    (r"python3 -m venv ", "venv"),
    (r"\./new-project( |$)", "new-project"),
    (r"cd \.\./my-run$", "quick-start-cd"),
    (r"cd {project} && git ", "git"),
    (r"cookiecutter ", "cookiecutter"),
    (r"cruft ", "cruft"),
]
# Placeholders in the READMEs and what stands in for them. A command that shows only its form
# (USAGE) runs as --help.
PLACEHOLDERS = {
    "gh:<org>/ddp-template": str(TEMPLATE),
    "<template>": str(TEMPLATE),
    "<package>": "{package}",
    "<project>": "{project}",
    "<pod>": "{project}-0-x7k2p",
    "<GPUs>": "2",
    "<deploy.nodes>": "2",
    "<deploy.max_restarts>": "3",
    "<deploy.rdzv_timeout_s>": "900",
    "deploy.image=<name>@sha256:<digest>": "deploy.image=ghcr.io/your-org/{project}@sha256:" + "0" * 64,
    "deploy.image=...": "deploy.image=ghcr.io/your-org/{project}:0.2.0",
    "data.path=...": "data.path=data/sample",
    "ckpt=...": "ckpt=outputs/run/checkpoints/step_000000020.pt",
    "<image>": "{base_image}",
}
USAGE = ("[overrides]", "[torchrun options]", "<run dir>", " ...")
# Shown as what is refused: check must exit 2 with one line that names the key.
REFUSED = {
    "nccl.p2p_disable=maybe": "nccl.p2p_disable",
    "nccl.p2p_disabel=true": "nccl.p2p_disabel",
    "+trainer.foo=1": "trainer.foo",
    "projct=x": "projct",  # a cookiecutter answer ./new-project refuses (the template's README)
    "key=value": None,  # the form of a cookiecutter answer, in prose
}


def classify(command: str, names: dict) -> str | None:
    if command in MENTIONS:
        return "mention"
    command = substitute(command, names)
    for pattern, rule in CLASSIFIED:
        if re.match(pattern.format(**{k: re.escape(v) for k, v in names.items()}), command):
            return rule
    return None


def substitute(command: str, names: dict) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value.format(**names))
    return command


def is_usage(command: str) -> bool:
    return any(marker in command for marker in USAGE)


# ---------------------------------------------------------------- one process beside the project


class Stop(Exception):
    """Raised where the program would start its work: what it parsed so far is all we need."""


def drive(jobs_file: str) -> None:
    """Runs in the rendered project's interpreter (PYTHONPATH: the installed project): each job as
    `python -m` would run it, in this one process; writes each outcome back as JSON."""
    import argparse
    import runpy

    from hydra.core.global_hydra import GlobalHydra

    jobs = json.loads(Path(jobs_file).read_text())
    parse_args = argparse.ArgumentParser.parse_args
    outcomes = []
    for job in jobs:
        environ, cwd, checked = dict(os.environ), Path.cwd(), None
        out, err, code, parsed = io.StringIO(), io.StringIO(), 0, None

        def stop_after_parsing(self, args=None, namespace=None):
            raise Stop(parse_args(self, args, namespace))

        def stop_before_torchrun(parsed):
            raise Stop(parsed)

        try:
            os.chdir(job["cwd"])
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                sys.argv = [job["module"], *job["argv"]]
                if job["how"] == "parse":
                    argparse.ArgumentParser.parse_args = stop_after_parsing
                if job["how"] == "launcher":
                    launch = __import__(job["module"], fromlist=["main"])
                    launch.run = stop_before_torchrun
                    code = launch.main(job["argv"])
                elif job["how"] == "evaluate":
                    evaluate = __import__(job["module"], fromlist=["parse"])
                    print(evaluate.parse(job["argv"]))
                elif job["how"] == "torchrun":
                    from torch.distributed.run import parse_args as torchrun_args

                    parsed = torchrun_args(job["argv"])
                    found = __import__("importlib.util").util.find_spec(parsed.training_script)
                    code = 0 if parsed.module and found else 1
                    parsed = {"overrides": parsed.training_script_args}
                elif job["how"] == "check-folder":
                    check = __import__(job["module"], fromlist=["compose_and_check"])
                    check.compose_and_check([], Path("configs"))
                else:
                    runpy.run_module(job["module"], run_name="__main__", alter_sys=True)
        except Stop as stop:
            code, parsed = 0, {"overrides": getattr(stop.args[0], "overrides", [])}
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            if not isinstance(exit_.code, int | None):
                err.write(str(exit_.code))
        except Exception as error:  # noqa: BLE001  (reported as the job's outcome)
            code = 1
            err.write(f"{type(error).__name__}: {error}")
        finally:
            argparse.ArgumentParser.parse_args = parse_args
        overrides = (parsed or {}).get("overrides") or []
        if code == 0 and job.get("check") and overrides:  # what the program parsed, through check
            sys.argv, checked = [job["check"], *overrides], io.StringIO()
            try:
                with contextlib.redirect_stdout(checked), contextlib.redirect_stderr(checked):
                    runpy.run_module(job["check"], run_name="__main__", alter_sys=True)
            except SystemExit as exit_:
                code = exit_.code
                err.write(checked.getvalue())
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        GlobalHydra.instance().clear()
        outcomes.append({"code": code, "out": out.getvalue(), "err": err.getvalue(), "parsed": parsed})
    Path(jobs_file).write_text(json.dumps(outcomes))


def run_jobs(jobs: list[dict], site: Path, tmp: Path) -> list[dict]:
    jobs_file = tmp / "jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{TEMPLATE / 'tests'}", "PATH": path_with(site)}
    done = subprocess.run(
        [sys.executable, "-c", f"from test_readme import drive; drive({str(jobs_file)!r})"],
        env=env, capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(jobs_file.read_text())


def path_with(site: Path) -> str:
    """The installed project's console script first, then the template's tools (python, make's)."""
    return f"{site / 'bin'}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}"


# ---------------------------------------------------------------- running what the READMEs show


@dataclass
class Step:
    found: Found
    what: str  # the command as run, or what stands for it
    job: dict | None = None  # for drive()
    judge: object = None  # outcome -> a problem (str) or None
    problem: str | None = None


class Plan:
    """Turns each README item into steps; local ones run at once, drive() jobs in one batch."""

    def __init__(self, names: dict, work: Path, tmp: Path, site: Path):
        self.names, self.work, self.tmp, self.site = names, work, tmp, site
        self.steps: list[Step] = []
        self.env = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL"}}
        self.env |= {"PATH": path_with(site), "PYTHONPATH": str(site)}
        self.package = names["package"]
        self.clone = tmp / "quick-start" / "clone"  # ./new-project -o .. lands beside it
        self.clone.mkdir(parents=True)
        (self.clone / "new-project").symlink_to(TEMPLATE / "new-project")
        self.images, self.ready, self.rendered = set(), {}, {}

    def shell(self, command: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], cwd=cwd, env=self.env, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip

    def add(self, found: Found, what: str, problem: str | None = None, **job) -> None:
        step = Step(found, what, problem=problem)
        if job:
            step.judge = job.pop("judge", None) or exits_0
            step.job = {"cwd": str(self.work), **job}
        self.steps.append(step)

    def module(self, found: Found, words: list[str], what: str, cwd: Path | None = None, **extra) -> None:
        self.add(found, what, module=words[2], argv=words[3:], cwd=str(cwd or self.work), **extra)

    # Each rule: (found, the command after placeholders, its words).
    def command(self, found: Found, text: str, context: str = "") -> None:
        template_tests = context == "template" and text in ("make test", "make test-full")
        rule = "template-make" if template_tests else classify(text, self.names)
        if rule is None:
            self.add(found, text, f"unclassified: {text}")
            return
        command = substitute(text, self.names)
        if rule in ("mention", "theirs", "generated-suite"):
            self.add(found, f"{rule}: {text}")
            return
        words = shlex.split(command)
        if is_usage(command):  # shows only the form: the program's --help
            words = [w for w in shlex.split(command.split(" [")[0].split(" <")[0].split(" ...")[0])]
            words.append("--help")
            rule = {"module-parse": "module-run", "evaluate": "module-run"}.get(rule, rule)
        getattr(self, "rule_" + rule.replace("-", "_"))(found, command, words)

    def rule_launcher(self, found, command, words):
        self.add(found, command, module=f"{self.package}.launch", argv=words[1:], how="launcher")

    def rule_module_run(self, found, command, words):
        self.module(found, words, command, how="run")

    def rule_module_parse(self, found, command, words):
        self.module(found, words, command, how="parse", check=f"{self.package}.check")

    def rule_evaluate(self, found, command, words):
        self.module(found, words, command, how="evaluate")

    def rule_torchrun(self, found, command, words):
        self.add(found, command, module="torchrun", argv=words[1:], how="torchrun", check=f"{self.package}.check")

    def rule_make(self, found, command, words):
        target = words[1]
        if target in ("torch", "help"):  # cheap and offline where torch is installed: for real
            done = subprocess.run(words, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=120)
            wanted = "is installed" if target == "torch" else "k8s-apply"
            ok = done.returncode == 0 and wanted in done.stdout
            self.add(found, command, None if ok else f"{command}: {done.stdout[-500:]}{done.stderr[-500:]}")
            return
        done = subprocess.run(["make", "-n", *words[1:]], cwd=self.work, env=self.env, capture_output=True, text=True)
        if done.returncode != 0:
            self.add(found, command, f"make -n: {done.stderr[-500:]}")
            return
        given = [w.removeprefix("ARGS=") for w in words if w.startswith("ARGS=")]
        dropped = [arg for arg in shlex.split(" ".join(given)) if arg not in done.stdout]
        if dropped:  # a target that ignores what the README passes it
            self.add(found, command, f"make {target} drops ARGS {dropped}: {done.stdout[-500:]}")
        for line in done.stdout.splitlines():
            self.command(found, " ".join(line.split()))

    def rule_template_make(self, found, command, words):
        settings = dict(word.split("=", 1) for word in words[: words.index("make")])  # VAR=value make ...
        env = {**self.env, **settings}
        done = subprocess.run(["make", "-n", *words[words.index("make") + 1 :]], cwd=TEMPLATE, env=env,
                              capture_output=True, text=True)  # fmt: skip
        trains = re.findall(r"ddp-project (train .*)$", done.stdout, re.MULTILINE)
        problem = None if done.returncode == 0 and (trains or "pytest" in done.stdout) else done.stderr[-500:]
        self.add(found, f"{command} (template): make -n", problem)
        for train in trains:  # the demo's launch, through the launcher's checks
            self.add(found, train, module=f"{self.package}.launch", argv=shlex.split(train), how="launcher")

    def rule_ready(self, found, command, words):
        if command not in self.ready:  # the same guards before each target: run once
            done = self.shell(command, self.work)
            self.ready[command] = None if done.returncode == 0 else done.stderr[-500:]
        self.add(found, command, self.ready[command])

    def rule_server(self, found, command, words):
        self.add(found, command, None if shutil.which(words[0], path=self.env["PATH"]) else f"no {words[0]}")

    def rule_cluster(self, found, command, words):
        self.add(found, command, None)  # run on the API server by test_cluster (make k8s-apply)

    def rule_kubectl(self, found, command, words):
        self.add(found, command, "kubectl")  # judged by test_kubectl_lines_..., which needs kubectl

    def rule_docker(self, found, command, words):
        dockerfile = (self.work / "Dockerfile").read_text()
        base = re.search(r"^FROM (\S+)$", dockerfile, re.MULTILINE).group(1)
        deploy = yaml.safe_load((self.work / "configs" / "deploy" / "default.yaml").read_text())
        problem = None
        if words[1] == "build":
            tag = words[words.index("-t") + 1]
            self.images.add(tag)
            if not (self.work / words[-1] / "Dockerfile").is_file() or tag != deploy["image"]:
                problem = f"{tag}: not configs/deploy's image {deploy['image']}, or no Dockerfile in {words[-1]}"
            arguments = [words[i + 1].split("=")[0] for i, word in enumerate(words) if word == "--build-arg"]
            unknown = [name for name in arguments if not re.search(rf"^ARG {name}(=|$)", dockerfile, re.M)]
            if unknown:
                problem = f"--build-arg {unknown[0]}: the Dockerfile has no ARG {unknown[0]}"
        elif words[1] == "push":
            problem = None if words[2] in self.images else f"{words[2]}: pushed before it is built"
        elif words[1:4] == ["buildx", "imagetools", "inspect"]:
            problem = None if words[4] == base else f"{words[4]}: not the Dockerfile's FROM {base}"
        else:
            problem = f"docker {words[1]}: not a step this test knows"
        self.add(found, command, problem)

    def rule_pip(self, found, command, words):
        from importlib.metadata import version

        from packaging.requirements import Requirement

        words = words[words.index("install") + 1 :]
        extras = tomllib.loads((self.work / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        problems = []
        for word in [w for w in words if w != "-e"]:
            if word.startswith("."):  # the project, with extras
                wanted = set(re.findall(r"\[(.*)\]", word)[0].split(",")) if "[" in word else set()
                problems += [f"{word}: no extra {e}" for e in sorted(wanted - set(extras))]
            else:  # a tool of the template's: CI installs it from requirements-test.txt
                requirement = Requirement(word)
                if not requirement.specifier.contains(version(requirement.name)):
                    problems.append(f"{word}: the template's environment has {version(requirement.name)}")
        self.add(found, command, "; ".join(problems) or None)

    def rule_venv(self, found, command, words):
        venv, rest = command.split(" && ", 2)[:2], command.split(" && ")[2:]
        folder = self.tmp / "venv"
        folder.mkdir(exist_ok=True)
        done = self.shell(" && ".join(venv) + " && command -v python", folder)
        ok = done.returncode == 0 and done.stdout.strip() == str(folder / ".venv" / "bin" / "python")
        self.add(found, " && ".join(venv), None if ok else done.stdout + done.stderr[-500:])
        for part in rest:
            self.command(found, part)

    def rule_new_project(self, found, command, words):
        if words == ["./new-project"]:  # asks its questions: its --help
            words = [*words, "--help"]
        done = subprocess.run(words, cwd=self.clone, env=self.env, capture_output=True, text=True, timeout=120)
        if found.expected:  # a refusal, shown with its output
            ok = done.returncode == 1 and done.stdout == "" and done.stderr.strip() == found.expected.strip()
        elif "-o" in words:  # the quick start: its cd is right, its steps are the README's
            target = (self.clone / words[words.index("-o") + 1]).resolve() / "my-run"
            ok = done.returncode == 0 and f"  cd {target}\n" in done.stdout
        else:
            ok = done.returncode == 0
        self.add(found, command, None if ok else f"exit {done.returncode}: {done.stdout[-800:]}{done.stderr[-800:]}")

    def rule_quick_start_cd(self, found, command, words):
        done = self.shell(f"{command} && test -f Makefile", self.clone)
        self.add(found, command, None if done.returncode == 0 else done.stderr or "no project there")

    def rule_git(self, found, command, words):
        folder = self.tmp / "git"
        shutil.copytree(self.work, folder / self.names["project"], ignore=IGNORED)
        env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@example.com"}  # fmt: skip
        done = subprocess.run(["bash", "-c", command], cwd=folder, env={**self.env, **env}, capture_output=True,
                              text=True)  # fmt: skip
        self.add(found, command, None if done.returncode == 0 else done.stderr[-500:])

    def rule_cookiecutter(self, found, command, words):
        if command in self.rendered:  # gh:<org>/ddp-template and <template> are the same here
            self.add(found, command, self.rendered[command])
            return
        out = self.tmp / f"cookiecutter-{len(self.steps)}"
        words = [str(BIN / "cookiecutter"), *words[1:]]
        if "--no-input" not in words:  # it would ask: take the defaults
            words.insert(2, "--no-input")
        done = subprocess.run([*words, "--output-dir", str(out)], env=self.env, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        ok = done.returncode == 0 and any(out.glob("*/Makefile"))
        self.rendered[command] = None if ok else done.stderr[-800:]
        self.add(found, command, self.rendered[command])

    def rule_cruft(self, found, command, words):
        # test_cruft.py runs create, check and update against a git copy of the template
        done = subprocess.run([str(BIN / "cruft"), words[1], "--help"], capture_output=True, text=True)
        self.add(found, f"cruft {words[1]} --help", None if done.returncode == 0 else done.stderr[-500:])

    # What prose shows: overrides, refused ones, config errors, YAML.
    def override(self, found: Found) -> None:
        text = substitute(found.text, self.names)
        key, words = text.lstrip("+~").split("=", 1)[0], shlex.split(text)  # as a shell passes them on
        if found.readme == "template" and key in ANSWERS:  # a cookiecutter answer, not Hydra's
            self.add(found, text, answer_problem(text, expect_refused=text in REFUSED))
        elif text in REFUSED and REFUSED[text] is None:
            self.add(found, f"the form: {text}")
        elif text in REFUSED:
            self.add(found, f"refused: {text}", module=f"{self.package}.check", argv=words, how="run",
                     judge=refused_with_one_line(REFUSED[text]))  # fmt: skip
        else:
            self.add(found, text, module=f"{self.package}.check", argv=words, how="run")

    def argument(self, found: Found) -> None:
        """generate's or export's key=value, through that command's parse() with what it needs
        beside it (a prompt, an out folder)."""
        words = shlex.split(found.text)
        keys = {word.split("=")[0] for word in words}
        command = "export" if keys & ARGUMENTS["export"] else "generate"
        needed = {"generate": ["prompt=x"] if not keys & {"prompt", "prompt_ids"} else [],
                  "export": ["out=x"] if "out" not in keys else []}[command]  # fmt: skip
        self.add(found, f"{command}: {found.text}", module=f"{self.package}.{command}", argv=[*words, *needed],
                 how="evaluate")  # fmt: skip

    def error(self, found: Found) -> None:
        override = re.match(r"config error: (\S+?=\S+?): ", found.text).group(1)
        self.add(found, found.text, module=f"{self.package}.check", argv=[override], how="run",
                 judge=lambda o: None if o["code"] == 2 and o["err"].strip() == found.text else o["err"])  # fmt: skip


def exits_0(outcome: dict) -> str | None:
    return None if outcome["code"] == 0 else f"exit {outcome['code']}: {outcome['err'][-600:]}"


IGNORED = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache", "outputs")
ANSWERS = {k for k in json.loads((TEMPLATE / "cookiecutter.json").read_text()) if not k.startswith("_")}


def refused_with_one_line(key: str):
    def judge(outcome: dict) -> str | None:
        lines = outcome["err"].strip().splitlines()
        if outcome["code"] == 2 and len(lines) == 1 and key in lines[0]:
            return None
        return f"not refused in one line naming {key}: exit {outcome['code']}, {outcome['err'][-400:]}"

    return judge


def answer_problem(answer: str, expect_refused: bool) -> str | None:
    """A cookiecutter answer through ./new-project's own checks, in this process."""
    import runpy

    new_project = runpy.run_path(str(TEMPLATE / "new-project"), run_name="new_project")
    variables = {k: v for k, v in json.loads((TEMPLATE / "cookiecutter.json").read_text()).items() if k[0] != "_"}
    try:
        given = new_project["read_answers"]([answer], variables)
        problem = new_project["pre_gen_project"].first_problem(new_project["with_defaults"](given, variables))
    except new_project["Refused"] as refused:
        problem = str(refused)
    if expect_refused:
        return None if problem else f"{answer}: accepted, but the README shows it refused"
    return f"{answer}: {problem}" if problem else None


# ---------------------------------------------------------------- fixtures


def names_of(project: Path) -> dict:
    package = next(p.name for p in (project / "src").iterdir() if (p / "__init__.py").is_file())
    base = re.search(r"^FROM (\S+)$", (project / "Dockerfile").read_text(), re.MULTILINE).group(1)
    return {"project": project.name, "package": package, "base_image": base}


# Its commands and YAML hold once its recipes are applied: the project's tests/test_extending.py
# applies them to a copy and runs what the page says.
RUN_ELSEWHERE = {"extending.md"}


@pytest.fixture(scope="module")
def readmes(default_project) -> dict[str, str]:
    """Both READMEs, configs/local's, and every page of the project's docs/ (its reference)."""
    pages = sorted((default_project / "docs").glob("*.md"))
    pages = [page for page in pages if page.name not in RUN_ELSEWHERE]
    return {
        "template": (TEMPLATE / "README.md").read_text(),
        "project": (default_project / "README.md").read_text(),
        "local": (default_project / "configs" / "local" / "README.md").read_text(),
        **{f"docs/{page.name}": page.read_text() for page in pages},
    }


@pytest.fixture(scope="module")
def found(readmes, default_project) -> list[Found]:
    """Each item once, in README order (the template's quick start repeats the project's)."""
    items, seen, names = [], set(), names_of(default_project)
    for readme, text in readmes.items():
        for item in extract(text, readme, names["project"]):
            if (item.kind, item.text, item.expected, item.context) not in seen:
                seen.add((item.kind, item.text, item.expected, item.context))
                items.append(item)
    return items


@pytest.fixture(scope="module")
def plan(found, default_project, installed_default, tmp_path_factory) -> Plan:
    """Every README item run as its rule says; drive()'s jobs in one process at the end."""
    tmp = tmp_path_factory.mktemp("readme")
    work = tmp / "work" / default_project.name
    shutil.copytree(default_project, work, ignore=IGNORED)
    plan = Plan(names_of(default_project), work, tmp, installed_default)
    for item in found:
        if item.kind == "command":
            plan.command(item, item.text, item.context)
        elif item.kind == "override":
            plan.override(item)
        elif item.kind == "argument":
            plan.argument(item)
        elif item.kind == "error":
            plan.error(item)
    yaml_copy = tmp / "yaml" / default_project.name  # the YAML examples, in a copy of their own
    shutil.copytree(default_project, yaml_copy, ignore=IGNORED)
    for item in (i for i in found if i.kind == "yaml"):
        target = yaml_copy / re.search(r"^# (configs/\S+\.yaml)", item.text, re.MULTILINE).group(1)
        text = target.read_text() if target.exists() else ""
        for line in item.text.splitlines():  # each key the example sets, in place of the file's line
            key = re.match(r"^(\w+):", line)
            if key and re.search(rf"^{key.group(1)}:.*$", text, re.MULTILINE):
                text = re.sub(rf"^{key.group(1)}:.*$", line, text, count=1, flags=re.MULTILINE)
        target.write_text(text or item.text)
        plan.add(item, f"{target.relative_to(yaml_copy)}: composed", module=f"{plan.package}.config.compose",
                 argv=[], how="check-folder", cwd=str(yaml_copy))  # fmt: skip
        plan.add(item, f"{target.relative_to(yaml_copy)}: rendered", module=f"{plan.package}.k8s", argv=[],
                 how="run", cwd=str(yaml_copy))  # fmt: skip
    jobs = [step for step in plan.steps if step.job]
    for step, outcome in zip(jobs, run_jobs([s.job for s in jobs], installed_default, tmp), strict=True):
        step.problem = step.judge(outcome)
    return plan


def problems(steps: list[Step]) -> list[str]:
    return [f"{where(s.found.readme)}: {s.what}: {s.problem}" for s in steps if s.problem]


def where(readme: str) -> str:
    return readme if readme.startswith("docs/") else f"{readme} README"


# ---------------------------------------------------------------- the tests


def test_every_docs_page_is_read_as_the_readmes_are(readmes, found, default_project):
    """The reference moved out of the project's README into docs/: each page is read, and the
    pages that show commands give theirs (a page the fixture skipped would run nothing)."""
    pages = {f"docs/{page.name}" for page in (default_project / "docs").glob("*.md") if page.name not in RUN_ELSEWHERE}
    assert len(pages) >= 10 and pages <= set(readmes)
    shown = {item.readme for item in found if item.kind == "command"}
    assert {"docs/nccl.md", "docs/kubernetes.md", "docs/checkpoints.md", "docs/performance.md"} <= shown
    assert {item.readme for item in found if item.kind == "yaml"} == {"local", "docs/configuration.md"}


def test_every_command_in_the_readmes_is_classified(found, default_project):
    names = names_of(default_project)
    commands = [item.text for item in found if item.kind == "command"]
    assert len(commands) > 60  # the extraction reads the READMEs at all
    assert [c for c in commands if classify(c, names) is None] == []


def test_every_readme_command_runs_as_written_or_passes_its_dry_run(plan):
    steps = [s for s in plan.steps if s.found.kind == "command" and s.problem != "kubectl"]
    bad = problems(steps)
    assert bad == [], "\n".join(bad)


def test_every_hydra_override_a_readme_shows_is_accepted_by_check(plan):
    """Inline ones (`nccl=pcie_safe`, `logger=[tensorboard,wandb]`) one by one; those on a command
    line went through check with their command. The ones shown as refused are refused, in one
    line; a `config error:` line shown is the one check prints."""
    steps = [s for s in plan.steps if s.found.kind in ("override", "argument", "error")]
    assert {s.found.text for s in steps} >= {"logger=[tensorboard,wandb]", "nccl.p2p_disable=maybe"}
    bad = problems(steps)
    assert bad == [], "\n".join(bad)


def test_the_yaml_examples_compose_and_render(plan):
    steps = [s for s in plan.steps if s.found.kind == "yaml"]
    assert len(steps) == 4  # configs/local/default.yaml and configs/deploy/default.yaml, twice each
    bad = problems(steps)
    assert bad == [], "\n".join(bad)


@pytest.fixture(scope="module")
def kubectl(tmp_path_factory) -> Path:
    import lzma

    folder = tmp_path_factory.mktemp("kubectl")
    binary = folder / "kubectl"
    with lzma.open(local_k8s() / "bin" / "kubectl.xz") as packed, binary.open("wb") as out:
        shutil.copyfileobj(packed, out, 1 << 20)
    binary.chmod(0o755)
    # A server that is not there: kubectl reads its flags and files, then fails to connect.
    (folder / "config").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: none\n"
        "clusters: [{name: none, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: none, user: {token: none}}]\n"
        "contexts: [{name: none, context: {cluster: none, user: none}}]\n"
    )
    return binary


def test_kubectl_lines_read_their_flags_and_files_and_get_as_far_as_the_server(plan, kubectl):
    """Client-side: a mistyped flag or resource list, or a missing file, fails before connecting."""
    steps = [s for s in plan.steps if s.problem == "kubectl"]
    assert len(steps) >= 4
    env = {**plan.env, "KUBECONFIG": str(kubectl.parent / "config")}
    failed = []
    for step in steps:
        words = shlex.split(step.what.split(" | ")[0])
        if words[1] in ("apply", "delete") or words[1:2] == ["-n"] and "delete" in words:
            words.append("--dry-run=client")
        done = subprocess.run([str(kubectl), "--request-timeout=2s", *words[1:]], cwd=plan.work, env=env,
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        said = done.stdout + done.stderr
        if "connection refused" not in said or re.search(r"unknown (flag|command|shorthand)|does not exist", said):
            failed.append(f"{step.what}: {said[-400:]}")
    assert failed == []


@pytest.mark.parametrize("kubeconfig", ["a closed port", "a missing file"])
def test_k8s_apply_with_no_server_to_reach_says_which_it_tried_not_that_it_refused(
    default_project, installed_default, kubectl, tmp_path, kubeconfig
):
    """kubectl's own failure to connect is no server refusing k8s/: one line naming the server it
    tried (or that it had no kubeconfig) and what to do, and nothing asked of a server."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "kubectl").symlink_to(kubectl)
    config = kubectl.parent / "config" if kubeconfig == "a closed port" else tmp_path / "nowhere"
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{path_with(installed_default)}",
           "PYTHONPATH": str(installed_default), "KUBECONFIG": str(config), "HOME": str(tmp_path)}  # fmt: skip
    (package,) = (p.name for p in (default_project / "src").iterdir() if p.suffix != ".egg-info")
    done = subprocess.run([sys.executable, "-m", f"{package}.k8s.apply"], cwd=default_project, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    point = "point kubectl at your cluster: KUBECONFIG=<its kubeconfig>, or kubectl config use-context <name>"
    tried = (
        "no API server reachable at https://127.0.0.1:1 (connection refused), the server of kubectl's "
        'context "none"; start it, or'
        if kubeconfig == "a closed port"
        else f"no API server: kubectl has no kubeconfig (KUBECONFIG={config} names no file), so it tried "
        "localhost:8080 (connection refused);"
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr == f"make k8s-apply: {tried} {point}; nothing was changed\n"


# ---------------------------------------------------------------- facts the READMEs state


@pytest.fixture(scope="module", params=FLAVORS)
def flavor_project(request, tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp(request.param), k8s_flavor=request.param, num_nodes=2,
                  project=f"two-{request.param}s")  # fmt: skip


def kinds(project: Path) -> set[str]:
    return {doc["kind"] for path in (project / "k8s").glob("*.yaml") for doc in yaml.safe_load_all(path.read_text())}


def test_the_project_readme_names_its_workload_and_deletes_every_kind_it_applies(flavor_project):
    """The intro names the flavor's workload; docs/kubernetes.md's delete command holds every kind
    in k8s/, and it is the one delete the project's docs show."""
    readme = (flavor_project / "README.md").read_text()
    workload = sorted(kinds(flavor_project) - {"Service", "PersistentVolumeClaim", "ServiceAccount"})
    assert len(workload) == 1
    assert f" {workload[0]}\nwhose pods" in readme.split("## Quick start")[0]
    docs = "\n".join(p.read_text() for p in [flavor_project / "README.md", *(flavor_project / "docs").glob("*.md")])
    (delete,) = re.findall(r"^kubectl .* delete (\S+) -l ", docs, re.MULTILINE)
    assert delete in (flavor_project / "docs" / "kubernetes.md").read_text()
    plural = {kind.lower() + ("es" if kind.endswith("s") else "s") for kind in kinds(flavor_project)}
    assert plural <= set(delete.split(",")), delete


def test_the_readmes_say_what_the_image_and_the_manifests_run(flavor_project):
    """`<project> train` as PID 1 and in every manifest; no init container, in the manifests or
    in the text (the check-config container and `check && exec torchrun` are gone)."""
    project = flavor_project.name
    entrypoint = re.search(r"^ENTRYPOINT (.*)$", (flavor_project / "Dockerfile").read_text(), re.MULTILINE)
    assert json.loads(entrypoint.group(1)) == [project, "train"]
    manifests = "\n".join(p.read_text() for p in (flavor_project / "k8s").glob("*.yaml"))
    assert "initContainers" not in manifests and f"{project}\n" in manifests  # the command's word
    template_readme = (TEMPLATE / "README.md").read_text()
    assert 'ENTRYPOINT ["ddp-project", "train"]' in template_readme
    pages = [flavor_project / "README.md", *(flavor_project / "docs").glob("*.md")]
    for text in (template_readme, *(page.read_text() for page in pages)):
        assert "check-config" not in text and "exec torchrun" not in text
        assert 'ENTRYPOINT ["torchrun"]' not in text and "`torchrun` as PID 1" not in text
    assert f"`{project} train` as PID 1" in (flavor_project / "docs" / "kubernetes.md").read_text()


def test_the_printed_cd_works_from_any_directory_even_through_spaces(tmp_path):
    """The hook runs inside the new project; the `cd` it prints is absolute and quoted."""
    where = tmp_path / "a dir"
    (tmp_path / "elsewhere").mkdir()
    done = subprocess.run([sys.executable, str(TEMPLATE / "new-project"), "--no-input", "-o", "a dir",
                           "project=spaced"], cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    cd = done.stdout.split("Next:\n", 1)[1].splitlines()[0].strip()
    went = subprocess.run(["bash", "-c", f"{cd} && pwd"], cwd=tmp_path / "elsewhere", capture_output=True, text=True)
    assert went.stdout.strip() == str(where / "spaced"), went.stderr


def test_k8s_apply_with_a_bad_arg_stops_in_one_line_before_kubectl(default_project, installed_default, tmp_path):
    """`make k8s-apply ARGS=...` renders first, as the README says; a value it refuses ends there."""
    project = tmp_path / default_project.name
    shutil.copytree(default_project, project, ignore=IGNORED)
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "kubectl").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "kubectl.log"}\n')
    (tools / "kubectl").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL"}}
    env |= {"PATH": f"{tools}{os.pathsep}{path_with(installed_default)}", "PYTHONPATH": str(installed_default)}
    bad = subprocess.run(["make", "-s", "k8s-apply", "ARGS=deploy.nodes=0"], cwd=project, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    said = [line for line in bad.stderr.splitlines() if not line.startswith("make")]
    assert bad.returncode != 0 and len(said) == 1 and "deploy.nodes" in said[0], bad.stderr
    assert not (tmp_path / "kubectl.log").exists()
    good = subprocess.run(["make", "-s", "k8s-apply", "ARGS=deploy.nodes=2 deploy.runs_access_mode=ReadWriteMany"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert good.returncode == 0, good.stderr
    assert (project / "k8s" / "service.yaml").is_file()  # what ARGS asked for is what was applied
    calls = (tmp_path / "kubectl.log").read_text().splitlines()
    assert calls[0].startswith("apply --dry-run=server") and calls[-1] == "apply -f k8s/"  # the server first

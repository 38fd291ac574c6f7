"""Hostile or odd answers: each renders exactly as typed in every file it lands in (read back by
the parsers that read those files), or is refused in one line naming the variable, with nothing
left behind."""

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import logging
import re
import subprocess
import sys
import tomllib
from types import SimpleNamespace

import pytest
import yaml
from conftest import BIN, DEFAULTS, TEMPLATE, cookiecutter_cli, env_with_path, install, render
from omegaconf import OmegaConf
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(TEMPLATE / "hooks"))
import pre_gen_project  # noqa: E402  (plain functions: the hook file imports unrendered)

NEW_PROJECT = TEMPLATE / "new-project"

REFUSED = [
    ("project", "My Project", "project 'My Project' is not a Kubernetes name"),
    ("project", "a" * 48, "is not a Kubernetes name of at most 47 characters"),
    ("project", "-leading-dash", "is not a Kubernetes name"),
    ("project", "trailing-", "is not a Kubernetes name"),
    ("project", "../escape", "project '../escape' is not a Kubernetes name"),
    ("project", 'x"; rm -rf ~; "', "is not a Kubernetes name"),
    ("project", "$(touch pwned)", "is not a Kubernetes name"),
    ("project", "a`id`b", "is not a Kubernetes name"),
    ("project", "dots.not.allowed", "is not a Kubernetes name"),
    ("project", "ünïcode", "is not a Kubernetes name"),
    ("project", "1000", "project '1000' is not a Kubernetes name of at most 47 characters"),
    ("project", "0x1f", "project '0x1f' is not a Kubernetes name"),
    ("package", "class", "package 'class' is a Python keyword"),
    ("package", "match", "package 'match' is a Python keyword"),
    ("package", "1st_model", "package '1st_model' is not a Python package name"),
    ("package", "my-package", "is not a Python package name"),
    ("package", "torch", "package 'torch' would shadow the module of that name"),
    ("package", "os", "package 'os' would shadow the module of that name"),
    ("package", "yaml", "package 'yaml' would shadow the module of that name"),
    ("package", "numpy", "package 'numpy' would shadow the module of that name"),
    ("package", "conftest", "package 'conftest' would shadow the module of that name"),
    ("package", "café", "is not a Python package name: use lowercase ASCII letters"),
    ("num_gpus", "0", "num_gpus '0' is not a number of GPUs per node: use a whole number from 1 to 16"),
    ("num_gpus", "17", "use a whole number from 1 to 16"),
    ("num_gpus", "08", "num_gpus '08' is not a number of GPUs per node"),
    ("num_gpus", "2.0", "num_gpus '2.0' is not a number of GPUs per node"),
    ("num_gpus", "+2", "num_gpus '+2' is not a number of GPUs per node"),
    ("num_gpus", "0x2", "num_gpus '0x2' is not a number of GPUs per node"),
    ("num_gpus", "1e1", "num_gpus '1e1' is not a number of GPUs per node"),
    ("num_gpus", "２", "num_gpus '２' is not a number of GPUs per node"),
    ("num_gpus", "two", "use a whole number from 1 to 16"),
    ("num_gpus", "2; reboot", "use a whole number from 1 to 16"),
    ("num_nodes", "0", "num_nodes '0' is not a number of nodes: use a whole number from 1 to 256"),
    ("num_nodes", "010", "num_nodes '010' is not a number of nodes"),
    ("num_nodes", "many", "use a whole number from 1 to 256"),
    ("python_version", "2.7", "python_version '2.7' is not supported: use one of 3.11, 3.12, 3.13"),
    ("python_version", "3.11.0", "python_version '3.11.0' is not supported"),
    ("image", 'evil" && curl x', "is not an image reference"),
    ("image", "ghcr.io/acme/x:$(id)", "is not an image reference"),
    ("image", "ghcr.io/acme/x:tag # comment", "is not an image reference"),
    ("base_image", "pytorch/pytorch:latest\nRUN curl x", "is not an image reference"),
    ("namespace", "Kube-System", "namespace 'Kube-System' is not a Kubernetes DNS-1123 label"),
    ("namespace", "a" * 64, "is not a Kubernetes DNS-1123 label of at most 63 characters"),
    ("description", "line one\nRUN rm -rf /", "description contains U+000A (a control character)"),
    ("description", "tab\there", "description contains U+0009 (a control character)"),
    ("description", "split\u2028line", "description contains U+2028 (LINE SEPARATOR)"),
    ("description", "\ufeffbom", "description contains U+FEFF (ZERO WIDTH NO-BREAK SPACE)"),
    ("author", "{% raw %}{{ cookiecutter.__class__ }}{% endraw %}", "contains template delimiters"),
    ("description", "x" * 201, "description is 201 characters long: use at most 200"),
]
REFUSED_IDS = [f"{k}:{v[:16]!r}" for k, v, _ in REFUSED]


def no_traceback_run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """./new-project, as the README's quick start runs it."""
    return subprocess.run(
        [sys.executable, str(NEW_PROJECT), "--no-input", "-o", str(tmp_path), *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def script_module(path):
    loader = importlib.machinery.SourceFileLoader(path.name.replace("-", "_"), str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


@pytest.fixture
def new_project_main(monkeypatch, capsys):
    """./new-project's main() in this process, for answers it refuses before cookiecutter runs:
    half a second less each than a process (no_traceback_run runs every eighth as a user would)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the template's folders first
    module = script_module(NEW_PROJECT)
    monkeypatch.setattr(logging.getLogger("cookiecutter"), "disabled", False)  # main() turns it off

    def run(tmp_path, *args: str) -> SimpleNamespace:
        monkeypatch.setattr(sys, "argv", [str(NEW_PROJECT), "--no-input", "-o", str(tmp_path), *args])
        returncode = module.main()
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=returncode, stdout=out, stderr=err)

    return run


@pytest.mark.parametrize(("key", "value", "message"), REFUSED, ids=REFUSED_IDS)
def test_new_project_refuses_a_bad_answer_in_exactly_one_line(tmp_path, new_project_main, key, value, message):
    as_typed = REFUSED.index((key, value, message)) % 8 == 0
    done = (no_traceback_run if as_typed else new_project_main)(tmp_path, f"{key}={value}")
    assert done.returncode == 1
    assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: ") and message in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("key", "value", "message"), REFUSED[::4], ids=REFUSED_IDS[::4])
def test_cookiecutter_itself_refuses_the_same_answers_with_our_line_first(tmp_path, key, value, message):
    """`cookiecutter <template>` runs the same hook: our line, then cookiecutter's own report (its
    traceback and "Hook script failed"), as the README says; nothing is left behind."""
    done = cookiecutter_cli(tmp_path, f"{key}={value}")
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(ours) == 1 and message in ours[0], done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["nccl_profile=fastest"], "error: nccl_profile 'fastest' is not an option: use one of auto, "
                                   "nccl_default, pcie_safe, socket, infiniband"),
        (["k8s_flavor=mpijob"], "error: k8s_flavor 'mpijob' is not an option: use one of job,"),
        (["projct=my-run"], "error: no variable 'projct': answer one of project, package,"),
        (["my-run"], "error: 'my-run' is not an answer: use key=value, e.g. project=my-run"),
        (["description={{ 7 * 7 }}"], "error: description '{{ 7 * 7 }}' contains template delimiters"),
    ],
)  # fmt: skip
def test_new_project_refuses_what_cookiecutter_would_crash_on_or_ignore(tmp_path, new_project_main, args, message):
    done = new_project_main(tmp_path, *args)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [done.stderr.strip()] and done.stderr.startswith(message)
    assert list(tmp_path.iterdir()) == []


def test_derived_answers_do_not_repeat_the_first_problem(tmp_path):
    """A bad project name also spoils the derived package and image: report only the cause."""
    done = no_traceback_run(tmp_path, "project=Bad Name")
    assert done.stderr == (
        "error: project 'Bad Name' is not a Kubernetes name of at most 47 characters: use lowercase "
        "letters, digits and '-', starting with a letter and ending with a letter or digit (e.g. "
        "ddp-project)\n"
    )


# Free text as typed: YAML and TOML syntax, quotes, backslashes, Markdown, and Unicode beyond
# Latin-1: astral characters, combining marks, joiners, right-to-left text.
FREE_TEXT = [
    "yes", "no", "on", "off", "null", "~", "true", "1e3", "0x1F", "0o17", ".inf", "-.nan", "012",
    "1_000", "2001-12-14", "<<", "&anchor *alias", "!tag", "%directive", "@at", "`tick`",
    "{flow: map}", "[a, list]", "# not a comment", "key: value", "- a dash", "* a star", "> quote",
    "'single'", '"double"', "back\\slash \\n \\u0041", "O'Brien \"the DDP\" $(id) ${HOME}; rm -rf ~",
    "😀 emoji", "𝔘nicode 𝔐ath", "Zoë Ångström", "深度学习", "שלום עולם", "e\u0301 combining",
    "👨\u200d👩\u200d👧 family", "<b>html</b> &amp; **bold** _it_ [link](x) | pipe",
    "ends with backslash \\", "x" * 200,
]  # fmt: skip


def read_back(project):
    """What each file's own reader gets: pyproject with tomllib, the deploy config with OmegaConf
    (as the project reads it) and PyYAML (as kubectl's tools do), the Job, and the README."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())["project"]
    deploy_file = project / "configs" / "deploy" / "default.yaml"
    job = yaml.safe_load((project / "k8s" / "job.yaml").read_text())
    readme_line = (project / "README.md").read_text().splitlines()[2]
    return {
        "name": meta["name"],
        "description": meta["description"],
        "author": meta["authors"][0]["name"],
        "omegaconf": dict(OmegaConf.load(deploy_file)),
        "pyyaml": yaml.safe_load(deploy_file.read_text()),
        "job": job["metadata"],
        "job_image": job["spec"]["template"]["spec"]["containers"][0]["image"],
        "readme": re.sub(r"\\(.)", r"\1", readme_line),  # Markdown's escapes, as a reader sees them
    }


@pytest.mark.parametrize("text", FREE_TEXT, ids=[repr(t[:14]) for t in FREE_TEXT])
def test_free_text_reads_back_exactly_as_typed(tmp_path, text):
    back = read_back(render(tmp_path, description=text, author=text))
    assert back["description"] == back["author"] == back["readme"] == text


# Names that YAML 1.1 or 1.2 would read as a bool, a number, null or a date. A project name
# starts with a letter (the Service and the TrainJob it names need that); a namespace may not.
NAMES = ["yes", "no", "on", "off", "null", "true", "inf", "nan", "e3", "a" * 47]
NAMESPACES = ["yes", "null", "1e3", "0x1f", "012", "2001-12-14", "0o17", "a" * 63]


@pytest.mark.parametrize(("name", "namespace"), list(zip(NAMES, NAMESPACES * 2, strict=False)), ids=NAMES)
def test_names_that_look_like_yaml_values_stay_text(tmp_path, name, namespace):
    project = render(tmp_path, project=name, package=f"p_{name}", namespace=namespace)
    back = read_back(project)
    image = f"ghcr.io/your-org/{name}:0.1.0"
    assert back["name"] == name
    for deploy in (back["omegaconf"], back["pyyaml"]):
        assert (deploy["name"], deploy["namespace"], deploy["image"]) == (name, namespace, image)
    assert (back["job"]["name"], back["job"]["namespace"], back["job_image"]) == (name, namespace, image)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("num_gpus", "16", 16),
        ("num_gpus", "1", 1),
        ("num_nodes", "256", 256),
        ("num_nodes", "1", 1),
    ],
)
def test_numbers_render_as_the_same_integer_everywhere(tmp_path, key, value, expected):
    project = render(tmp_path, **{key: value})
    deploy_file = project / "configs" / "deploy" / "default.yaml"
    field = "gpus_per_node" if key == "num_gpus" else "nodes"
    assert OmegaConf.load(deploy_file)[field] == yaml.safe_load(deploy_file.read_text())[field] == expected
    job = yaml.safe_load((project / "k8s" / "job.yaml").read_text())
    limits = job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    if key == "num_gpus":
        assert limits["nvidia.com/gpu"] == expected
    else:
        assert job["spec"].get("completions", 1) == expected


def test_image_and_python_version_at_their_limits_render_as_typed(tmp_path):
    image = "registry.local:5000/team/ddp@sha256:" + "a" * 64
    project = render(tmp_path, image=image, base_image=image, python_version="3.13")
    assert read_back(project)["job_image"] == image
    assert (project / "Dockerfile").read_text().count(f"FROM {image}") == 1
    meta = tomllib.loads((project / "pyproject.toml").read_text())
    assert meta["project"]["requires-python"] == ">=3.13"
    settings = subprocess.run(  # ruff.toml names no version: ruff reads it from requires-python
        [BIN / "ruff", "check", "--no-cache", "--show-settings", "tests/conftest.py"],
        cwd=project,
        capture_output=True,
        text=True,
    )
    assert re.search(r"linter\.unresolved_target_version = 3\.13\n", settings.stdout), settings.stdout + settings.stderr


# The hook's name and image rules (pre_gen_project) restate the project's (k8s/checks.py, as the
# post-generation hook runs them): the hook runs from a rendered copy with no path to the template
# under cookiecutter and cruft, so it cannot load the project's module. Both read these strings.
HOSTILE_NAMES = [
    "a", "a0", "a-b", "a--b", "yes", "null", "a" * 47, "a" * 48, "a" * 63, "a" * 64, "", "-a", "a-",
    "0a", "9", "A", "aB", "a_b", "a.b", "a b", " a", "a\n", "\na", "a\t", "é", "ａ", "a\x00", "a/b",
    "a:b", "${a}", "K", "\u212a",
]  # fmt: skip
# Each names a tag or a digest and no :latest: the project's further rules for those (one line
# from the post-generation hook, test_render) are not the hook's.
DIGEST = "@sha256:" + "a" * 64
HOSTILE_IMAGES = [
    "x:1", "ghcr.io/acme/x:0.1.0", "localhost:5000/x:1", "Registry.IO/x:1", f"x{DIGEST}",
    f"x:1{DIGEST}", f"registry.local:5000/team/ddp{DIGEST}", "a__b:1", "a_b:1", "a.b:1", "a---b:1",
    "a___b:1", "a-:1", "-a:1", "_a:1", "A/x:1", "x/A:1", "x:-t", "x:.t", "x:_t", "x:" + "t" * 128,
    "x:" + "t" * 129, "x@sha256:" + "a" * 63, "x@sha256:" + "A" * 64, "x@md5:abc", "x:1 ", " x:1",
    "x:1\n", "x:$(id)", 'x:"1"', "x:1#c", "x//y:1", "x/:1", "/x:1", "host:port/x:1", "é:1",
    "a" * 253 + ":1", "a" * 254 + ":1", "x:1\u0000",
]  # fmt: skip
AGREEMENT = (
    [("project", "name", v) for v in HOSTILE_NAMES]
    + [("namespace", "namespace", v) for v in HOSTILE_NAMES]
    + [("image", "image", v) for v in HOSTILE_IMAGES]
)
PROJECT_ACCEPTS = """
import json, sys
from ddp_project.k8s.render import deploy_errors  # what the post-generation hook runs
deploy, cases = json.load(sys.stdin)
print(json.dumps([not any(e.startswith(f"deploy.{key}=") for e in deploy_errors({**deploy, key: value}))
                  for key, value in cases]))
"""


def test_the_hook_and_the_project_accept_the_same_names_and_images(default_project):
    deploy = yaml.safe_load((default_project / "configs" / "deploy" / "default.yaml").read_text())
    cases = [(field, value) for _, field, value in AGREEMENT]
    done = subprocess.run([sys.executable, "-c", PROJECT_ACCEPTS], input=json.dumps([deploy, cases]),
                          cwd=default_project / "src", capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    project = json.loads(done.stdout)
    hook = [getattr(pre_gen_project, f"check_{key}")(key, value) is None for key, _, value in AGREEMENT]
    assert sum(hook) > 10 and not all(hook)  # the table holds both kinds
    differ = [f"{key}={value!r} (hook: {'ok' if h else 'refused'})"
              for (key, _, value), h, p in zip(AGREEMENT, hook, project, strict=True) if h != p]  # fmt: skip
    assert differ == [], "hook and project disagree on " + ", ".join(differ)


@pytest.mark.timeout(600)
def test_a_name_the_hook_accepts_gives_a_project_whose_check_passes(tmp_path):
    """At the length limit, and names YAML would misread: the project's own config check, with
    its defaults, as the Job's first step runs it."""
    for name in ("a" * 47, "yes", "null"):
        project = render(tmp_path / name[:8], project=name, package=f"p_{name}", namespace=name)
        site = install(project, tmp_path / f"site-{name[:8]}")
        done = subprocess.run([sys.executable, "-m", f"p_{name}.check"], cwd=tmp_path,
                              env=env_with_path(site), capture_output=True, text=True, timeout=120)  # fmt: skip
        assert (done.returncode, done.stdout) == (0, "config ok\n"), done.stderr


def installed_closure(requirements: list[str]) -> tuple[dict, list[str]]:
    """The distributions that `requirements` bring into this environment, through each one's
    requirements, the extras asked for included; and each requirement that holds here (its
    marker true) but is not installed, which would go unchecked."""

    def holding(texts: list[str], extras: set[str]) -> list[Requirement]:
        wanted = [Requirement(text) for text in texts]
        return [r for r in wanted if r.marker is None or any(r.marker.evaluate({"extra": e}) for e in {"", *extras})]

    found: dict[str, importlib.metadata.Distribution] = {}
    absent, asked, todo = [], set(), holding(requirements, set())
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if (name, *sorted(requirement.extras)) in asked:
            continue
        asked.add((name, *sorted(requirement.extras)))
        try:
            found[name] = found.get(name) or importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            absent.append(name)
            continue
        todo += holding(found[name].requires or [], requirement.extras)
    return found, sorted(set(absent))


def test_the_closure_follows_extras_and_markers_and_names_what_is_not_installed():
    found, absent = installed_closure(["pytest", "tomli; python_version < '3.11'"])
    assert absent == [] and {"pluggy", "iniconfig"} <= set(found) and "attrs" not in found
    found, absent = installed_closure(["pytest[dev]", "no-such-distribution>=1"])
    assert "attrs" in found  # installed here, and asked for only by pytest's dev extra
    assert {"hypothesis", "no-such-distribution"} <= set(absent) and "tomli" not in absent


def top_level_modules(distribution: importlib.metadata.Distribution) -> set[str]:
    """What a distribution installs at the top of site-packages: from its RECORD (what was
    installed), else its top_level.txt (setuptools' guess: xxhash's names a _xxhash it lacks)."""
    files = distribution.files or []
    modules = set() if files else set((distribution.read_text("top_level.txt") or "").split())
    for file in files:
        top = file.parts[0]
        if top.endswith((".dist-info", ".data", ".pth")) or top in ("..", "bin"):
            continue  # metadata, a path file, or a script installed outside site-packages
        modules.add(top.removesuffix(".py").split(".")[0])  # a module, a package, or an extension
    return {m for m in modules if m.isidentifier() and not m.startswith("__")}


def test_every_module_the_project_imports_is_a_name_the_hook_refuses(default_project):
    """The generated project's dependencies and extras, and theirs, as installed here: each
    top-level module they provide must be refused as a package name, or the project would
    shadow it. THIRD_PARTY is kept by hand (the hook runs on cookiecutter's Python, without the
    project's dependencies): this is what keeps it whole."""
    project = tomllib.loads((default_project / "pyproject.toml").read_text())["project"]
    found, absent = installed_closure(project["dependencies"] + sum(project["optional-dependencies"].values(), []))
    assert absent == [], "not installed here, so their modules go unchecked: " + ", ".join(absent)
    no_list = sorted(name for name, d in found.items() if not top_level_modules(d))
    assert no_list == [], "no RECORD or top_level.txt to read modules from: " + ", ".join(no_list)
    assert {"torch", "omegaconf", "wandb", "mlflow-skinny", "pytest-xdist", "requests"} <= set(found)
    provided = set().union(*(top_level_modules(d) for d in found.values()))
    missing = sorted(provided - pre_gen_project.SHADOWED)
    assert missing == [], "pre_gen_project.THIRD_PARTY lacks " + ", ".join(missing)


def test_old_cookiecutter_is_refused_with_the_upgrade_command(tmp_path):
    """Run the pre-gen hook as cookiecutter would, but under a stand-in cookiecutter 2.6."""
    fake = tmp_path / "fake" / "cookiecutter"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.6.0"\n')
    answers = {**DEFAULTS, "package": "ddp_project", "image": "ghcr.io/acme/ddp-project:latest"}
    answers["nccl_profile"] = answers["nccl_profile"][0]
    hook = (TEMPLATE / "hooks" / "pre_gen_project.py").read_text()
    script = tmp_path / "hook.py"
    script.write_text(hook.replace("{{ cookiecutter | tojson }}", json.dumps(answers)))
    done = subprocess.run(
        [sys.executable, str(script)], env={"PYTHONPATH": str(fake.parent)}, capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "error: cookiecutter 2.6.0 is too old: this template needs 2.7 or newer (pip install 'cookiecutter>=2.7')"
    )


def test_new_project_renders_what_cookiecutter_renders(tmp_path):
    done = no_traceback_run(tmp_path / "ours", "project=same-name", "num_gpus=4")
    assert done.returncode == 0, done.stderr
    theirs = render(tmp_path / "theirs", project="same-name", num_gpus="4")
    ours = tmp_path / "ours" / "same-name"
    files = sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(ours) for p in ours.rglob("*") if p.is_file())
    assert all((ours / f).read_bytes() == (theirs / f).read_bytes() for f in files)

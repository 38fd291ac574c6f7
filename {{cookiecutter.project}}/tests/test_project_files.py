"""The files around the code agree with it: the pods' env block and launch line, whichever
workload k8s/ holds (deploy.flavor), and the packaged config groups."""

import importlib.util
import io
import re
import tokenize
import tomllib
from pathlib import Path

import yaml
from conftest import deploy_defaults, trainer_container
from omegaconf import OmegaConf

from ddp_project.k8s import render, sync
from ddp_project.k8s.pods import nccl_env
from ddp_project.nccl import decision as nccl

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "ddp_project"
FLAVOR = deploy_defaults()["flavor"]
# What k8s/ holds for 2 nodes, by flavor: a Job needs a headless Service for its pods' names
# (a JobSet and the operators make their own); a TrainJob's pods get a ServiceAccount.
FILES_FOR_TWO_NODES = {
    "job": "job.yaml, runs-pvc.yaml, service.yaml",
    "jobset": "jobset.yaml, runs-pvc.yaml",
    "pytorchjob": "pytorchjob.yaml, runs-pvc.yaml",
    "trainjob": "runs-pvc.yaml, serviceaccount.yaml, trainjob.yaml",
}


def recipe(makefile: str, target: str) -> list[str]:
    """The lines of a Makefile target's recipe (its tab-led lines), as make reads them."""
    after = makefile.split(f"\n{target}:", 1)[1].split("\n")[1:]
    lines = []
    for line in after:
        if not line.startswith("\t"):
            break
        lines.append(line)
    return lines


def workload_container() -> dict:
    workload = yaml.safe_load((ROOT / "k8s" / f"{FLAVOR}.yaml").read_text())
    return trainer_container(FLAVOR, workload)


def test_the_pods_env_block_matches_the_default_nccl_profile(compose_train):
    config = OmegaConf.to_object(compose_train())
    profile_env = nccl.decide(config.nccl, None, inherited={}).env
    pod_env = {
        e["name"]: e["value"] for e in workload_container()["env"] if e["name"].startswith("NCCL_")
    }
    assert pod_env == profile_env


def test_k8s_folder_is_a_fresh_render_of_the_config(compose_train):
    """k8s/ is generated from configs/ (python -m ddp_project.k8s): edit the
    config, regenerate."""
    cfg = compose_train()
    deploy = OmegaConf.to_container(cfg.deploy, enum_to_str=True)
    profile = OmegaConf.to_container(cfg.nccl, enum_to_str=True)
    assert sync.differences(render.manifests(deploy, nccl_env(profile)), ROOT / "k8s") == []


def test_k8s_overrides_are_written_to_configs_and_check_shows_the_difference(tmp_path):
    """`python -m <pkg>.k8s KEY=VALUE` writes the override where the next render (and training)
    reads it, keeping the file as its author wrote it: every comment, the style of each value
    (a block list stays block), quotes where YAML 1.1 needs them. Two at once both land, in
    configs/ and k8s/. A refused override writes nothing. --check prints a unified diff and the
    command, or one line when k8s/ matches."""
    import shutil
    import subprocess
    import sys

    project = tmp_path / "project"
    shutil.copytree(
        ROOT, project, ignore=shutil.ignore_patterns(".venv", "outputs", "*.egg-info", "build")
    )
    deploy_file = project / "configs" / "deploy" / "default.yaml"
    block = (
        "tolerations:            # GPU nodes' taint\n"
        "  - key: nvidia.com/gpu\n"
        "    operator: Exists\n"
    )
    deploy_file.write_text(re.sub(r"(?m)^tolerations: .*\n", block, deploy_file.read_text()))
    configs = {p: p.read_text() for p in (project / "configs").rglob("*.yaml")}
    command = [sys.executable, "-m", f"{PACKAGE}.k8s"]

    def k8s(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*command, *args], cwd=project, capture_output=True, text=True, timeout=120
        )

    other = subprocess.Popen(
        [*command, "deploy.pod_labels.yes=on", "deploy.image_pull_secrets=[ghcr-pull]"],
        cwd=project,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    done = k8s(
        "deploy.nodes=2",
        "deploy.runs_access_mode=ReadWriteMany",
        "deploy.image=ghcr.io/acme/x:2.0",
        "nccl=pcie_safe",
        "deploy.node_selector={pool: gpu}",  # a map whole, or an entry of one: the map is written
        "deploy.pod_labels.team=vision",
        "deploy.tolerations=[{key: foo, operator: Exists}]",
        "deploy.pod_annotations.note='a #b'",
        "nccl.env.NCCL_ALGO=Ring",
    )
    assert done.returncode == 0, done.stderr
    assert other.wait(timeout=120) == 0, other.stderr.read()
    assert f"wrote deploy.nodes=2 -> {deploy_file}" in done.stdout
    notes = done.stdout.splitlines()[-2:]  # after what was written: admission, then the lost node
    assert notes[0].startswith("note: 2 pods and no deploy.queue: nothing admits them together")
    assert notes[1].startswith("note: a pod on a node that stopped answering")
    deploy = yaml.safe_load(deploy_file.read_text())
    assert (deploy["nodes"], deploy["image"]) == (2, "ghcr.io/acme/x:2.0")
    assert (deploy["node_selector"], deploy["pod_annotations"]) == (
        {"pool": "gpu"},
        {"note": "a #b"},
    )
    assert deploy["pod_labels"] == {
        "team": "vision",
        "yes": "on",
    }  # both runs' entries, whichever went first
    assert (deploy["tolerations"], deploy["image_pull_secrets"]) == (
        [{"key": "foo", "operator": "Exists"}],
        ["ghcr-pull"],
    )
    profile = yaml.safe_load((project / "configs" / "nccl" / "pcie_safe.yaml").read_text())
    assert profile["env"] == {"NCCL_ALGO": "Ring"}
    text = deploy_file.read_text()
    assert (
        "tolerations:            # GPU nodes' taint\n  - key: foo\n    operator: Exists\n" in text
    )  # block stays block
    assert re.search(
        r'(?m)^pod_labels: {.*"yes": "on".*} +# on every pod', text
    )  # flow stays flow; yes, on quoted
    comments = [
        line.rpartition("# ")[2] for line in configs[deploy_file].splitlines() if "# " in line
    ]
    assert comments == [line.rpartition("# ")[2] for line in text.splitlines() if "# " in line]
    assert '  - nccl: "pcie_safe"' in (project / "configs" / "train.yaml").read_text()

    matches = k8s("--check")  # no overrides: what configs/ says now, rendered with them
    assert (matches.returncode, matches.stdout) == (
        0,
        f"k8s/ matches configs/ ({FILES_FOR_TWO_NODES[FLAVOR]})\n",
    )

    workload = project / "k8s" / f"{FLAVOR}.yaml"
    workload.write_text(workload.read_text().replace("acme/x:2.0", "acme/x:2.1"))
    differs = k8s("--check")
    assert differs.returncode == 1
    lines = differs.stdout.splitlines()
    assert f"--- {workload.relative_to(project)}" in lines
    assert [line.split()[-1] for line in lines if line[:1] in "-+" and "acme/x" in line] == [
        "ghcr.io/acme/x:2.1",
        "ghcr.io/acme/x:2.0",
    ]
    assert (
        differs.stderr
        == f"k8s/ differs from configs/ (1 file(s)); python -m {PACKAGE}.k8s writes it again\n"
    )
    again = k8s("deploy.pod_annotations.note='c #d'")  # a value with " #" set a second time
    assert again.returncode == 0 and k8s("--check").returncode == 0, again.stderr
    assert yaml.safe_load(deploy_file.read_text())["pod_annotations"] == {"note": "c #d"}

    before = {p: p.read_text() for p in (project / "configs").rglob("*.yaml")}
    for refused in (k8s("deploy.nodes=3", "trainer.max_steps=3"), k8s("--check", "deploy.nodes=3")):
        assert refused.returncode == 2 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert {p: p.read_text() for p in (project / "configs").rglob("*.yaml")} == before
    assert before != configs  # the first command's overrides stay where it wrote them


def test_the_pods_run_the_launcher_over_all_their_gpus():
    from ddp_project.launch import COMMAND

    container = workload_container()
    command = container["command"]
    if command[:2] == ["/bin/sh", "-c"]:  # several nodes: the script picks the rendezvous host
        assert f"; exec {COMMAND} train " in command[2] and command[2].endswith(' "$@"')
    else:
        assert command == [COMMAND, "train"]
    if FLAVOR == "trainjob":  # Trainer passes numProcPerNode to torchrun (PET_NPROC_PER_NODE)
        gpus, nproc = container["resourcesPerNode"]["limits"], container["numProcPerNode"]
    else:
        gpus, args = container["resources"]["limits"], container["args"]
        nproc = args[args.index("--nproc-per-node") + 1]
    assert str(nproc) == str(gpus["nvidia.com/gpu"]) == str(deploy_defaults()["gpus_per_node"])
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"][COMMAND] == (
        f"{PACKAGE}.launch:main"
    )


def test_every_wing_and_config_group_ships_in_the_wheel():
    """The image installs the project with pip install . (not editable): a folder the list lacks
    is missing there, though an editable install finds it."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    folders = [p for p in (ROOT / "configs").rglob("*") if p.is_dir() and p.name != "__pycache__"]
    expected = {
        f"{PACKAGE}.configs." + ".".join(p.relative_to(ROOT / "configs").parts) for p in folders
    }
    source = ROOT / "src"
    expected |= {".".join(p.parent.relative_to(source).parts) for p in source.rglob("__init__.py")}
    missing = expected - set(packages)
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


def test_values_live_in_the_yaml_and_the_schemas_hold_none():
    """One place for each default: configs/. The schemas give types and checks only; NcclConfig's
    None and {} mean "not set", so a profile lists just what it sets."""
    import dataclasses

    from omegaconf import MISSING

    from ddp_project.config import deploy as deploy_config
    from ddp_project.config import options
    from ddp_project.config import schema as config

    schemas = [
        options.MlpConfig,
        options.GptConfig,
        options.PointsConfig,
        options.TokensConfig,
        config.TrainerConfig,
        config.DistConfig,
        deploy_config.DeployConfig,
        config.TrainConfig,
    ]
    for schema in schemas:
        for field in dataclasses.fields(schema):
            assert field.default is MISSING, f"{schema.__name__}.{field.name} has a default"
    unset = {f.name: f.default for f in dataclasses.fields(config.NcclConfig) if f.name != "env"}
    assert set(unset.values()) == {None, False} and unset["auto"] is False


def test_every_yaml_value_says_what_it_is_for():
    """As lightning-hydra-template does: a comment on every key that sets a value, in every
    config file, so that `configs/` reads as the documentation of the knobs."""
    bare = []
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        if "hydra" in path.parts:
            continue  # Hydra's logging config: its keys are Python's logging.config schema
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#", 1)[0]
            sets_a_value = (
                ":" in code
                and not code.rstrip().endswith(":")
                and not code.lstrip().startswith("-")
            )
            if sets_a_value and "#" not in line:
                bare.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert bare == []


def test_the_readmes_layout_names_every_module():
    """docs/layout.md, which the README links, is the package map a newcomer reads first: a
    module it does not name is one they will not find."""
    layout = (ROOT / "docs" / "layout.md").read_text().split("\n```\n", 1)[1].split("\n```", 1)[0]
    package = ROOT / "src" / PACKAGE
    modules = {str(p.relative_to(package)) for p in package.rglob("*.py")}
    modules -= {m for m in modules if m.endswith("__init__.py") or m.startswith("k8s/")}
    named, folder = set(), ""
    for line in layout.splitlines():  # a folder's line ("  run/"), then its modules, indented below
        found = re.match(r"  (\w+)/ ", line + " ")
        if found:
            folder = "" if found[1] == "k8s" else found[1] + "/"
        named |= {
            (folder if line.startswith("    ") else "") + name
            for name in re.findall(r"\b\w+\.py\b", line)
        }
    named -= {name for name in named if name.startswith("k8s/")}
    assert modules - named == set(), "add them to docs/layout.md"
    assert named - modules == set(), "the Layout names modules that are gone"


# Files the prose names that are not the project's, and whose they are.
OTHERS_FILES = {
    "utils.py": "torch's elastic/rendezvous/utils.py (launch.py)",
    "test_render.py": "the template's own tests (docs/extending.md)",
} | {
    f"src/{name}.py": "lightning-hydra-template's (docs/coming-from-lightning.md)"
    for name in ("train", "eval")
}

MODULE_DOT_NAME = re.compile(r"(?<![\w.])([a-z_]\w*)\.([A-Z]\w*)")  # registry.Option, not a.b.C


def importable(name: str) -> bool:
    """A top-level module, or torch's (nn.Module, amp.GradScaler)."""
    return any(importlib.util.find_spec(m) is not None for m in (name, f"torch.{name}"))


def test_the_prose_names_only_modules_that_exist():
    """Docstrings, comments, YAML comments and docs name the modules and docs a reader then
    opens: a name from before a restructure (config.py, deploy_config.DeployConfig), or the
    template's own BENCHMARKS.md, sends them nowhere."""
    package = ROOT / "src" / PACKAGE
    own = ["/" + str(p.relative_to(ROOT)) for p in ROOT.rglob("*.*") if ".venv" not in p.parts]
    modules = {p.stem for p in package.rglob("*.py")} | {p.name for p in package.rglob("*/")}
    prose = [*package.rglob("*.py"), *(ROOT / "configs").rglob("*.yaml"), *ROOT.glob("*.md")]
    gone = []
    for path in [*prose, *(ROOT / "docs").glob("*.md")]:
        text = path.read_text()
        where = path.relative_to(ROOT)
        for ref in re.findall(r"(?<![\w/.-])((?:[\w.-]+/)*\w[\w-]*\.(?:py|md))\b", text):
            beside = (path.parent / ref).exists()  # a link: docs/runs.md's ../README.md
            ours = any(f.endswith(f"/{ref}") for f in own)
            if not (beside or ours or ref in OTHERS_FILES):
                gone.append(f"{where}: {ref}")
        for ref in re.findall(rf"\b{PACKAGE}\.(\w+)", text):
            if ref not in modules:
                gone.append(f"{where}: {PACKAGE}.{ref}")
        if path.suffix == ".py":  # module.Name in a string or comment, where no code binds it
            tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
            bound = {t.string for t in tokens if t.type == tokenize.NAME}
            for token in tokens:
                if token.type not in (tokenize.STRING, tokenize.COMMENT):
                    continue
                for name, attribute in MODULE_DOT_NAME.findall(token.string):
                    if name not in modules | bound and not importable(name):
                        gone.append(f"{where}: {name}.{attribute}")
    assert gone == [], "name the module as it is now"


def test_make_install_leaves_the_loggers_packages_to_make_install_all():
    """wandb and mlflow are 99 packages and 1.4 GB, the sweeper brings optuna and its own: make
    install leaves them out (their tests skip, saying so), make install-all and CI bring them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    names = {
        extra: {re.split(r"[<>=!~ \[]", dep)[0] for dep in deps} for extra, deps in extras.items()
    }
    optional = {"wandb", "mlflow-skinny", "mlflow", "hydra-optuna-sweeper", "optuna"}
    assert not names["dev"] & optional
    assert names["wandb"] == {"wandb"} and names["mlflow"] == {"mlflow-skinny"}
    assert names["sweep"] == {"hydra-optuna-sweeper", "optuna"}
    makefile = (ROOT / "Makefile").read_text()
    assert "\tpython -m pip install -e '.[dev]'" in recipe(makefile, "install")
    assert "\tpython -m pip install -e '.[dev,wandb,mlflow,sweep]'" in recipe(
        makefile, "install-all"
    )
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert "- run: make install-all\n" in workflow and "- run: make test-full\n" in workflow


def test_make_test_is_the_fast_tier_and_every_skip_says_why():
    """make test: every test but those marked slow (failure injection, long end-to-end runs); make
    test-full: all. -ra: each skip's reason in the summary."""
    makefile = (ROOT / "Makefile").read_text()
    assert '\tpython -m pytest -m "not slow"' in recipe(makefile, "test")
    assert "\tpython -m pytest" in recipe(makefile, "test-full")
    pytest_options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"
    ]
    assert "-ra" in pytest_options["addopts"].split()
    assert any(marker.startswith("slow: ") for marker in pytest_options["markers"])


def test_an_nccl_field_with_a_digit_in_its_name_is_written_like_any_other(tmp_path):
    """nccl.p2p_disable was refused as "not the manifests' key": the key pattern had no digits."""
    import shutil
    import subprocess
    import sys

    project = tmp_path / "project"
    shutil.copytree(
        ROOT, project, ignore=shutil.ignore_patterns(".venv", "outputs", "*.egg-info", "build")
    )
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.k8s", "nccl.p2p_disable=true"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote nccl.p2p_disable=true -> "), done.stdout
    (container,) = [
        trainer_container(f, yaml.safe_load(p.read_text()))
        for p in (project / "k8s").glob("*.yaml")
        for f in [p.stem]
        if f in ("job", "jobset", "pytorchjob", "trainjob")
    ]
    assert {"name": "NCCL_P2P_DISABLE", "value": "1"} in container["env"]

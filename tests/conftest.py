"""Render the template the way users do: cookiecutter's API and its real command line."""

import ast
import copy
import importlib.util
import json
import os
import signal
import site
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from cookiecutter.main import cookiecutter
from no_skips import pytest_runtest_makereport  # noqa: F401  (the hook: a skip fails in CI)

# The renders this process imports (test_render's load_module) stay as rendered. Its
# subprocesses write bytecode (the Makefile's environments come without it).
sys.dont_write_bytecode = True

TEMPLATE = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DEFAULTS = json.loads((TEMPLATE / "cookiecutter.json").read_text())
PROFILES = DEFAULTS["nccl_profile"]
FLAVORS = DEFAULTS["k8s_flavor"]
PROJECT_SOURCES = TEMPLATE / "{{cookiecutter.project}}"
PACKAGE_SOURCES = PROJECT_SOURCES / "src" / "{{cookiecutter.package}}"


# The local Kubernetes API server that tests/test_cluster.py starts, and whose kubectl
# test_readme.py runs: a folder holding cluster.sh (up, down, env), bin/kubectl.xz, crds/,
# runtimes/ and reference/, as the project's CI has it beside the checkout (.ci/run sets it).
K8S_VAR = "DDP_TEMPLATE_K8S"


def local_k8s() -> Path:
    """The folder K8S_VAR names; the test skips, saying what to set, where it names none."""
    folder = os.environ.get(K8S_VAR, "")
    if not folder or not (Path(folder) / "cluster.sh").is_file():
        found = f"{K8S_VAR}={folder}: no cluster.sh there" if folder else f"{K8S_VAR} is not set"
        pytest.skip(
            f"{found}; these tests need a local Kubernetes API server: set {K8S_VAR} to a folder "
            "whose cluster.sh starts kube-apiserver and kube-controller-manager with the JobSet, "
            "PyTorchJob and Trainer v2 CRDs (README: Testing the template; CI: bash .ci/run)"
        )
    return Path(folder).resolve()


def literal(source: Path, name: str) -> Any:
    """The literal a Python source assigns to `name` at its top level, read without importing it:
    the template's sources are Python before rendering, so a table the generated tests hold is
    shared with the template's tests, not copied."""
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return ast.literal_eval(node.value)
    raise LookupError(f"{source} assigns no {name}")


# What each NCCL profile puts in the Job's env block: the generated tests' table.
PROFILE_ENV = literal(PROJECT_SOURCES / "tests" / "test_config.py", "PROFILE_ENV")
# (nccl_profile, num_gpus, project, num_nodes, k8s_flavor): every profile, 1 to 16 GPUs (odd counts
# too), 1 to 16 nodes, every flavor on one node and on several; the long name checks that
# formatting does not depend on it.
MATRIX = [(profile, 2, f"demo-{profile.replace('_', '-')}", 1, "job") for profile in PROFILES] + [
    ("auto", 1, "one-gpu", 1, "job"),
    ("pcie_safe", 8, "eight-gpus", 1, "job"),
    ("socket", 16, "a-thirty-one-character-project", 1, "job"),
    ("infiniband", 8, "two-nodes", 2, "job"),
    ("auto", 4, "sixteen-nodes", 16, "job"),
    ("infiniband", 8, "jobset-two-nodes", 2, "jobset"),
    ("auto", 2, "jobset-one-node", 1, "jobset"),
    ("infiniband", 8, "pytorchjob-two-nodes", 2, "pytorchjob"),
    ("auto", 1, "pytorchjob-one-node", 1, "pytorchjob"),
    ("infiniband", 3, "trainjob-two-nodes", 2, "trainjob"),
    ("auto", 1, "trainjob-one-node", 1, "trainjob"),
]
MATRIX_IDS = [f"{p}-{g}gpu-{n}node-{f}" for p, g, _, n, f in MATRIX]


def pytest_configure(config: pytest.Config) -> None:
    """The generated project's heartbeat (its tests/heartbeat.py, plain Python before rendering):
    a line naming the running tests whenever none has ended for 30 s."""
    spec = importlib.util.spec_from_file_location("heartbeat", PROJECT_SOURCES / "tests" / "heartbeat.py")
    heartbeat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heartbeat)
    heartbeat.register(config)


def render(output_dir: Path, **context) -> Path:
    """Render with `context` over the defaults, no prompts; returns the project directory."""
    return Path(cookiecutter(str(TEMPLATE), no_input=True, extra_context=context, output_dir=str(output_dir)))


def cookiecutter_cli(output_dir: Path, *answers: str) -> subprocess.CompletedProcess:
    """`cookiecutter <template> --no-input key=value ...`, as a user would type it."""
    return subprocess.run(
        [str(BIN / "cookiecutter"), str(TEMPLATE), "--no-input", "--output-dir", str(output_dir), *answers],
        capture_output=True,
        text=True,
        timeout=120,
    )


def install(project: Path, target: Path) -> Path:
    """A non-editable `pip install .` into `target`, as the Dockerfile does; returns `target`."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(project)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return target


def env_with_path(site: Path, **extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(site), **extra}


@pytest.fixture(scope="session")
def default_project(tmp_path_factory) -> Path:
    return render(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="session")
def installed_default(default_project, tmp_path_factory) -> Path:
    """The default project installed non-editably; put it on PYTHONPATH to use it."""
    return install(default_project, tmp_path_factory.mktemp("site"))


# The default project's suite, as its README's commands run it: its fast tier (make test) in the
# template's, its full tier (make test-full) in the template's full tier, which includes the fast.
SUITE_TESTS = {
    "test_generated_projects_fast_tier_passes": "test",
    "test_generated_projects_full_tier_passes": "test-full",
}
RENDER_TEST = "test_each_render_passes_the_tests_that_depend_on_it"
# Renders beyond the default, each installed as its image installs it (`pip install .`) and
# checked by its own tests that depend on what it was made with (`pytest -m render`: config,
# check, k8s, the project files, and its manifest's launch line trained on two nodes; the
# generated tests/conftest.py says which). The default project runs its whole suite. One render,
# unlike the default in every answer that shapes the project (flavor, nodes, GPUs per node, NCCL
# profile, package): each render's suite costs about 90 CPU-seconds, and the other flavors,
# profiles and GPU counts are checked by test_render's MATRIX and the API server.
RENDERS = {
    "trainjob-2nodes-1gpu-infiniband": {"k8s_flavor": "trainjob", "num_nodes": "2", "num_gpus": "1",
                                        "nccl_profile": "infiniband", "package": "pretrainer"},
}  # fmt: skip


def files_of(project: Path) -> dict[str, bytes]:
    """The project's files, as a user's checkout holds them: not pip's build output or caches."""
    skip = {"build", "__pycache__", ".pytest_cache"}
    return {
        str(path.relative_to(project)): path.read_bytes()
        for path in project.rglob("*")
        if path.is_file() and not skip & set(path.parts) and ".egg-info" not in str(path)
    }


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests that read the background suites go last, the renders' before the default's:
    the suites start with the session (generated_suite, render_suites), and the template's
    other tests run beside them, not before them. Where both tiers of the default project's suite
    are selected, its full tier runs alone: it holds every test of the fast one."""
    suites = [item for item in items if item.originalname in SUITE_TESTS]
    if len(suites) == 2:
        fast = [item for item in suites if SUITE_TESTS[item.originalname] == "test"]
        config.hook.pytest_deselected(items=fast)
        items[:] = [item for item in items if item not in fast]
    items.sort(key=lambda item: (item.originalname in SUITE_TESTS, item.originalname == RENDER_TEST))


def suite_target(session: pytest.Session) -> str | None:
    """The make target of the default project's suite this session runs: test, test-full, none."""
    targets = [SUITE_TESTS[item.originalname] for item in session.items if item.originalname in SUITE_TESTS]
    return targets[0] if targets else None


def quick_start_venv(folder: Path) -> Path:
    """`python -m venv .venv` that sees this environment's packages, as `make torch` and
    `make install` would have filled it, without the network. --system-site-packages would not
    do: from a venv, it reaches the base interpreter's packages, not the venv's."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    (purelib,) = (folder / "lib").glob("python*/site-packages")
    lines = [f"import site; site.addsitedir({path!r})\n" for path in site.getsitepackages()]
    (purelib / "_template_env.pth").write_text("".join(lines))  # pip too: the venv has none
    return folder


def suite_process(command: list[str], cwd: Path, env: dict, folder: Path, extra: str = "") -> subprocess.Popen:
    """A test suite in the background, its output in folder/output.txt; pytest's options in
    PYTEST_ADDOPTS, so that `make test` gets them as it is: -v for a line per test, and a junit
    report (folder/junit.xml) that says what was skipped and why."""
    options = f"-v -p no:cacheprovider --junitxml={folder / 'junit.xml'} {extra}"
    with (folder / "output.txt").open("w") as output:
        return subprocess.Popen(
            command, cwd=cwd, env={**env, "PYTEST_ADDOPTS": options}, stdout=output,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


def end(process: subprocess.Popen | None) -> None:
    """Nothing a background suite started outlives the session."""
    if process is not None and process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="session", autouse=True)
def generated_suite(request, tmp_path_factory):
    """The default project's own tests, as its Quick start runs them: a fresh render installed
    editable (make install: pip install -e) in a venv, then `make test` (or `make test-full`)
    from the project with that venv's bin first on PATH. Started as the session starts where a
    test of SUITE_TESTS is selected: they keep both cores busy for minutes, and the rest of the
    template's tests (a minute and a half of CPU, a third of it waiting) would otherwise add their
    time to it. Their output goes to a file that the test streams; their report to junit.xml
    beside it."""
    target = suite_target(request.session)
    if target is None:
        yield None
        return
    folder = tmp_path_factory.mktemp("generated-suite")
    project = render(tmp_path_factory.mktemp("quick-start"))  # installed from nowhere else
    venv = quick_start_venv(folder / "venv")
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-deps",
                    "--no-build-isolation", "-e", "."],
                   cwd=project, check=True, capture_output=True, timeout=300)  # fmt: skip
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    env |= {"PATH": f"{venv / 'bin'}:{env['PATH']}", "VIRTUAL_ENV": str(venv)}
    before = files_of(project)
    # Two xdist workers, not the project's four: beside the template's tests and the renders'
    # suites, four put a dozen processes on 2 cores, and the suite took 8% more CPU (786 -> 854
    # CPU-seconds on its own, 2026-12-01) for no less time.
    process = suite_process(["make", target], project, env, folder, extra="-n 2")
    yield SimpleNamespace(process=process, output=folder / "output.txt", report=folder / "junit.xml",
                          project=project, before=before, target=target)  # fmt: skip
    end(process)


class RenderSuites:
    """RENDERS, one after the other in a thread: each rendered (cookiecutter's command line: its
    API changes directory, which a thread must not), installed non-editably into a folder of its
    own, and its `pytest -m render` run from the project on 2 xdist workers, which keeps
    --dist loadgroup's grouping in play."""

    def __init__(self, base: Path, ids: list[str]):
        self.base, self.ids, self.runs = base, ids, {}
        self.started = {id_: threading.Event() for id_ in ids}
        self.stopping, self.process, self.lock = False, None, threading.Lock()
        self.thread = threading.Thread(target=self.run_all, daemon=True)
        self.thread.start()

    def run_all(self) -> None:
        for id_ in self.ids:
            answers = RENDERS[id_]
            folder = self.base / id_
            folder.mkdir()
            run = SimpleNamespace(output=folder / "output.txt", report=folder / "junit.xml",
                                  process=None, project=None, before=None, error=None)  # fmt: skip
            self.runs[id_] = run
            try:
                done = cookiecutter_cli(folder, *(f"{key}={value}" for key, value in answers.items()))
                assert done.returncode == 0, done.stderr
                (run.project,) = [path for path in folder.iterdir() if path.is_dir()]
                site_dir = install(run.project, folder / "site")
                run.before = files_of(run.project)
                env = env_with_path(site_dir, PATH=f"{site_dir / 'bin'}:{os.environ['PATH']}")
                # Niced: the default project's suite is the session's longest path, and these
                # take the CPU that it leaves while it waits (on timeouts, on hung ranks).
                command = ["nice", "-n", "5", sys.executable, "-m", "pytest", "-m", "render", "-n", "2"]
                with self.lock:  # stop() ends what has started, and nothing starts after it
                    if self.stopping:
                        raise RuntimeError("the session ended first")
                    run.process = self.process = suite_process(command, run.project, env, folder)
            except Exception as error:  # the test of this render reports it
                run.error = f"{type(error).__name__}: {error}"
            self.started[id_].set()
            if run.process is not None:
                run.process.wait()

    def run(self, id_: str) -> SimpleNamespace:
        """RENDERS[id_]'s run, once it has started (or failed to)."""
        self.started[id_].wait()
        return self.runs[id_]

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            end(self.process)
        self.thread.join(timeout=10)  # a render or install under way ends on its own


@pytest.fixture(scope="session", autouse=True)
def render_suites(request, tmp_path_factory):
    """The suites of the RENDERS whose RENDER_TEST is selected, started as the session starts,
    beside the default project's (generated_suite)."""
    selected = {item.callspec.params["render_id"] for item in request.session.items
                if item.originalname == RENDER_TEST}  # fmt: skip
    if not selected:
        yield None
        return
    suites = RenderSuites(tmp_path_factory.mktemp("render-suites"), [id_ for id_ in RENDERS if id_ in selected])
    yield suites
    suites.stop()


@pytest.fixture(scope="session")
def matrix(tmp_path_factory) -> dict[str, SimpleNamespace]:
    """Every render of MATRIX, by id, once per session: test_render checks them one at a time,
    test_cluster sends them all to the API server at once."""
    renders = {}
    for id_, (profile, gpus, project, nodes, flavor) in zip(MATRIX_IDS, MATRIX, strict=True):
        path = render(
            tmp_path_factory.mktemp("render"), project=project, nccl_profile=profile,
            num_gpus=str(gpus), num_nodes=str(nodes), k8s_flavor=flavor,
        )  # fmt: skip
        renders[id_] = SimpleNamespace(
            path=path, profile=profile, gpus=gpus, nodes=nodes, flavor=flavor, package=project.replace("-", "_")
        )
    return renders


def manifest_of(rendered) -> dict:
    """k8s/job.yaml, jobset.yaml, pytorchjob.yaml or trainjob.yaml."""
    return yaml.safe_load((rendered.path / "k8s" / f"{rendered.flavor}.yaml").read_text())


def deploy_of(rendered) -> dict:
    return yaml.safe_load((rendered.path / "configs" / "deploy" / "default.yaml").read_text())


def job_of(rendered) -> dict:
    """The batch/v1 Job: k8s/job.yaml, or the one a JobSet's replicated Job makes."""
    if rendered.flavor == "job":
        return manifest_of(rendered)
    jobset = manifest_of(rendered)
    (replicated,) = jobset["spec"]["replicatedJobs"]
    name = f"{jobset['metadata']['name']}-{replicated['name']}-0"  # the JobSet's naming
    metadata = {**replicated["template"]["metadata"], "name": name, "namespace": jobset["metadata"]["namespace"]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": replicated["template"]["spec"]}


# Kubeflow Trainer v2.3's torch plugin (pkg/runtime/framework/plugins/torch/torch.go, in
# ../shared/k8s/reference/) on the trainer container "node": numNodes, numProcPerNode, the
# completion index, and pod 0 of the JobSet's Job "node" on port 29500 (pkg/constants).
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def trainer_pod_template(trainjob: dict) -> dict:
    """The pod template of the JobSet that Trainer makes from a TrainJob: the torch-distributed
    runtime's template (one container, "node", and its ancestor label), the TrainJob's trainer
    (image, command, args, env, resources), the torch plugin's env and port, then the patch."""
    name, spec = trainjob["metadata"]["name"], trainjob["spec"]
    trainer = spec["trainer"]
    (patch,) = spec["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    template = copy.deepcopy(node["template"]["spec"]["template"])
    template["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] = "trainer"
    (container,) = template["spec"].pop("containers")
    torch_env = [
        {"name": "PET_NNODES", "value": str(trainer["numNodes"])},
        {"name": "PET_NPROC_PER_NODE", "value": str(trainer["numProcPerNode"])},
        {"name": "PET_NODE_RANK", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
        {"name": "PET_MASTER_ADDR", "value": f"{name}-node-0-0.{name}"},
        {"name": "PET_MASTER_PORT", "value": "29500"},
    ]
    container |= {
        "image": trainer["image"], "command": trainer["command"], "args": trainer["args"],
        "env": trainer["env"] + torch_env, "resources": trainer["resourcesPerNode"],
        "ports": [{"containerPort": 29500}],
    }  # fmt: skip
    template["spec"]["containers"] = [container]
    return template


def pod_template_in(workload: dict, flavor: str) -> dict:
    """The pod template of every node's pod, as the flavor's controller makes the pods from it."""
    if flavor == "trainjob":
        return trainer_pod_template(workload)
    if flavor == "pytorchjob":
        return workload["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    if flavor == "jobset":
        return workload["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    return workload["spec"]["template"]


def pod_template_of(rendered) -> dict:
    return pod_template_in(manifest_of(rendered), rendered.flavor)


def pod_from(template: dict, name: str, namespace: str, annotations: dict | None = None) -> dict:
    """The Pod a controller makes from `template`, named `name`, with `annotations` added."""
    metadata = {**template["metadata"], "name": name, "namespace": namespace}
    if annotations:
        metadata["annotations"] = metadata.get("annotations", {}) | annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}

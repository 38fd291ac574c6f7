"""Render a matrix of answers and check every file the way its own tools would."""

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import yaml
from conftest import (
    BIN,
    FLAVORS,
    MATRIX,
    MATRIX_IDS,
    PACKAGE_SOURCES,
    PROFILE_ENV,
    PROFILES,
    PROJECT_SOURCES,
    TEMPLATE,
    cookiecutter_cli,
    deploy_of,
    job_of,
    manifest_of,
    pod_from,
    pod_template_of,
)
from cookiecutter.main import cookiecutter

DATA = Path(__file__).parent / "data"
JOBSET_SCHEMA = json.loads((DATA / "jobset.x-k8s.io_v1alpha2.schema.json").read_text())
PYTORCHJOB_SCHEMA = json.loads((DATA / "kubeflow.org_v1_pytorchjob.schema.json").read_text())

EXPECTED_FILES = {
    ".dockerignore",
    ".gitignore",
    "Dockerfile",
    "README.md",
    "docs/checkpoints.md",
    "docs/coming-from-lightning.md",
    "docs/configuration.md",
    "docs/exit-codes.md",
    "docs/kubernetes.md",
    "docs/layout.md",
    "docs/nccl.md",
    "docs/performance.md",
    "docs/runs.md",
    "docs/tooling.md",
    "docs/troubleshooting.md",
    "Makefile",
    "pyproject.toml",
    "ruff.toml",
    ".pre-commit-config.yaml",
    ".yamllint",
    ".github/workflows/ci.yml",
    "k8s/runs-pvc.yaml",
    "configs/__init__.py",
    "configs/train.yaml",
    "configs/data/synthetic.yaml",
    "data/sample.txt",
    "configs/data/tokens.yaml",
    "configs/deploy/default.yaml",
    "configs/dist/default.yaml",
    "configs/experiment/gpt2_small.yaml",
    "configs/experiment/mlp_134m.yaml",
    "configs/experiment/smoke.yaml",
    "configs/local/README.md",
    "configs/logger/csv.yaml",
    "configs/logger/mlflow.yaml",
    "configs/logger/tensorboard.yaml",
    "configs/logger/wandb.yaml",
    "configs/hydra/help/usage.yaml",
    "configs/hydra/job_logging/rank_zero.yaml",
    "configs/model/gpt.yaml",
    "configs/model/mlp.yaml",
    "configs/nccl/auto.yaml",
    "configs/nccl/infiniband.yaml",
    "configs/nccl/nccl_default.yaml",
    "configs/nccl/pcie_safe.yaml",
    "configs/nccl/socket.yaml",
    "configs/trainer/default.yaml",
    "src/{package}/__init__.py",
    "src/{package}/bench.py",
    "src/{package}/check.py",
    "src/{package}/config/__init__.py",
    "src/{package}/config/changeable.py",
    "src/{package}/config/compose.py",
    "src/{package}/config/deploy.py",
    "src/{package}/config/error.py",
    "src/{package}/config/global_batch.py",
    "src/{package}/config/logger_probes.py",
    "src/{package}/config/loggers.py",
    "src/{package}/config/options.py",
    "src/{package}/config/overrides.py",
    "src/{package}/config/registry.py",
    "src/{package}/config/schema.py",
    "src/{package}/config/token_files.py",
    "src/{package}/config/validate.py",
    "src/{package}/core/__init__.py",
    "src/{package}/core/caches.py",
    "src/{package}/core/cli.py",
    "src/{package}/core/exits.py",
    "src/{package}/core/files.py",
    "src/{package}/core/suggest.py",
    "src/{package}/core/world.py",
    "src/{package}/data.py",
    "src/{package}/doctor.py",
    "src/{package}/evaluate.py",
    "src/{package}/k8s/__init__.py",
    "src/{package}/k8s/__main__.py",
    "src/{package}/k8s/apply.py",
    "src/{package}/k8s/checks.py",
    "src/{package}/k8s/cluster.py",
    "src/{package}/k8s/doctor.py",
    "src/{package}/k8s/flavors.py",
    "src/{package}/k8s/meta.py",
    "src/{package}/k8s/persist.py",
    "src/{package}/k8s/pods.py",
    "src/{package}/k8s/render.py",
    "src/{package}/k8s/sync.py",
    "src/{package}/launch.py",
    "src/{package}/launcher/__init__.py",
    "src/{package}/launcher/run_dir_plan.py",
    "src/{package}/launcher/store_liveness.py",
    "src/{package}/launcher/torchrun_args.py",
    "src/{package}/launcher/worker_exits.py",
    "src/{package}/metrics.py",
    "src/{package}/model.py",
    "src/{package}/nccl/__init__.py",
    "src/{package}/nccl/allreduce.py",
    "src/{package}/nccl/decision.py",
    "src/{package}/nccl/failfast.py",
    "src/{package}/nccl/probe.py",
    "src/{package}/nccl/process_group.py",
    "src/{package}/record/__init__.py",
    "src/{package}/record/log_filter.py",
    "src/{package}/record/loggers.py",
    "src/{package}/record/metrics.py",
    "src/{package}/record/perf.py",
    "src/{package}/record/startup.py",
    "src/{package}/run/__init__.py",
    "src/{package}/run/batches.py",
    "src/{package}/run/checkpoint.py",
    "src/{package}/run/checkpoint_dcp.py",
    "src/{package}/run/compilation.py",
    "src/{package}/run/ddp.py",
    "src/{package}/run/layout.py",
    "src/{package}/run/nccl_env.py",
    "src/{package}/run/oom.py",
    "src/{package}/run/rundir.py",
    "src/{package}/run/schedule.py",
    "src/{package}/run/scoring.py",
    "src/{package}/run/stopping.py",
    "src/{package}/run/trainer.py",
    "src/{package}/train.py",
    "docs/extending.md",
    "tests/conftest.py",
    "tests/heartbeat.py",
    "tests/test_admission.py",
    "tests/test_apply.py",
    "tests/test_architecture.py",
    "tests/test_bench.py",
    "tests/test_check.py",
    "tests/test_checkpoint.py",
    "tests/test_checkpoint_dcp.py",
    "tests/test_compilation.py",
    "tests/test_config.py",
    "tests/test_data.py",
    "tests/test_doctor.py",
    "tests/test_evaluate.py",
    "tests/test_extending.py",
    "tests/test_failfast.py",
    "tests/test_files.py",
    "tests/test_launch.py",
    "tests/test_multinode.py",
    "tests/test_gpu.py",
    "tests/test_heartbeat.py",
    "tests/test_help.py",
    "tests/test_k8s.py",
    "tests/test_k8s_doctor.py",
    "tests/test_loggers.py",
    "tests/test_metrics.py",
    "tests/test_nccl.py",
    "tests/test_perf.py",
    "tests/test_probe.py",
    "tests/test_process_group.py",
    "tests/test_registry.py",
    "tests/test_restarts.py",
    "tests/test_resume.py",
    "tests/test_rundir.py",
    "tests/test_schedule.py",
    "tests/test_startup.py",
    "tests/test_stopping.py",
    "tests/test_store_liveness.py",
    "tests/test_project_files.py",
    "tests/test_train.py",
    "tests/test_trainer.py",
    "tests/tolerance.py",
    "configs/experiment/gpt_sample.yaml",
    "configs/hparams_search/optuna.yaml",
    "configs/optimizer/adamw.yaml",
    "configs/optimizer/sgd.yaml",
    "configs/profile/memory.yaml",
    "configs/profile/none.yaml",
    "configs/profile/trace.yaml",
    "docs/sweeps.md",
    "src/{package}/config/optimizer.py",
    "src/{package}/config/profiling.py",
    "src/{package}/export.py",
    "src/{package}/generate.py",
    "src/{package}/prepare.py",
    "src/{package}/run/ema.py",
    "src/{package}/run/fsdp.py",
    "src/{package}/run/optimizer.py",
    "src/{package}/run/patience.py",
    "src/{package}/run/profiling.py",
    "src/{package}/run/sampling.py",
    "src/{package}/run/saved.py",
    "tests/test_data_refusals.py",
    "tests/test_ema.py",
    "tests/test_fsdp.py",
    "tests/test_generate_export.py",
    "tests/test_optimizer.py",
    "tests/test_profile.py",
    "tests/test_sweep.py",
}
# What each profile must put in the Job's env block.


@pytest.fixture(scope="module", params=MATRIX_IDS)
def rendered(request, matrix):
    return matrix[request.param]


def files_of(path):
    return {str(p.relative_to(path)) for p in path.rglob("*") if p.is_file()}


def load_module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def test_exact_file_set(rendered):
    expected = {f.format(package=rendered.package) for f in EXPECTED_FILES}
    expected.add(f"k8s/{rendered.flavor}.yaml")
    if rendered.flavor == "job" and rendered.nodes > 1:
        expected.add("k8s/service.yaml")  # names the pods of the Indexed Job; the controllers do it themselves
    if rendered.flavor == "trainjob":
        expected.add("k8s/serviceaccount.yaml")  # a token-less account: Trainer's patches cannot drop the token
    assert files_of(rendered.path) == expected


def test_no_template_text_left(rendered):
    assert rendered.package != "ddp_project"  # the tests' spelling of the package: none left below
    for name in files_of(rendered.path):
        text = (rendered.path / name).read_text()
        assert "cookiecutter." not in text, name
        assert not re.search(r"(?<!\$)\{\{|\{%", text), name  # ${{ }}: GitHub Actions' own
        assert not re.search(r"\bddp_project\b", text), name


def spelling_default_package(project: Path) -> list[str]:
    return sorted(
        str(path.relative_to(project))
        for path in project.rglob("*")
        if path.is_file() and re.search(r"\bddp_project\b", path.read_text(errors="replace"))
    )


def test_another_package_name_is_spelled_in_every_file_that_names_the_package(tmp_path):
    """The template's tests spell the default package (ddp_project) and the post-generation hook
    renames it: in a test folder or a doc the template may grow too, and in nothing the project
    held before a render over it (git's files, what .gitignore keeps out)."""
    template = tmp_path / "template"
    template.mkdir()
    for name in ("cookiecutter.json", "local_extensions.py", "hooks", "{{cookiecutter.project}}"):
        source, copy = TEMPLATE / name, template / name
        if source.is_dir():
            shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__", ".ruff_cache"))
        else:
            shutil.copy(source, copy)
    grown = {"tests/unit/test_more.py": "from ddp_project.k8s import render\n",
             "docs/usage.md": "Run `python -m ddp_project.k8s` (ddp_project: the package).\n"}  # fmt: skip
    for name, text in grown.items():
        (template / "{{cookiecutter.project}}" / name).parent.mkdir(parents=True, exist_ok=True)
        (template / "{{cookiecutter.project}}" / name).write_text(text)
    answers = {"project": "my-proj", "package": "my_pkg"}
    project = Path(cookiecutter(str(template), no_input=True, extra_context=answers, output_dir=str(tmp_path)))
    assert spelling_default_package(project) == []
    assert (project / "docs/usage.md").read_text() == "Run `python -m my_pkg.k8s` (my_pkg: the package).\n"
    assert "from my_pkg.k8s import render" in (project / "tests/unit/test_more.py").read_text()
    assert 'known-first-party = ["my_pkg"]' in (project / "ruff.toml").read_text()
    theirs = {".git/HEAD": "ref: refs/heads/ddp_project\n", ".venv/ddp_project.pth": "/old/ddp_project\n",
              "outputs/run/config.yaml": "package: ddp_project\n",
              "configs/local/mine.yaml": "p: ddp_project\n"}  # fmt: skip
    for name, text in theirs.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    elsewhere = tmp_path / "notes.md"
    elsewhere.write_text("ddp_project\n")
    (project / "notes.md").symlink_to(elsewhere)
    cookiecutter(str(template), no_input=True, extra_context=answers, output_dir=str(tmp_path),
                 overwrite_if_exists=True)  # fmt: skip
    assert spelling_default_package(project) == sorted([*theirs, "notes.md"])
    assert all((project / name).read_text() == text for name, text in theirs.items())
    assert elsewhere.read_text() == "ddp_project\n"


def test_python_compiles_and_ruff_is_clean(rendered):
    for path in rendered.path.rglob("*.py"):
        compile(path.read_bytes(), str(path), "exec")  # py_compile would leave __pycache__ behind
    for command in (["check"], ["format", "--check"]):
        done = subprocess.run([BIN / "ruff", *command, "."], cwd=rendered.path, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


def test_yaml_and_toml_parse(rendered):
    for path in rendered.path.rglob("*.yaml"):
        assert yaml.safe_load(path.read_text()) is not None, path
    project = tomllib.loads((rendered.path / "pyproject.toml").read_text())["project"]
    assert project["name"] == rendered.path.name
    assert "torch>=2.6" in project["dependencies"]  # torch.nn.utils.get_total_norm


def test_manifests_pass_strict_kubernetes_validation(rendered):
    custom = {"jobset.yaml", "pytorchjob.yaml", "trainjob.yaml"}  # their CRDs: below, and test_cluster.py
    manifests = sorted(str(p) for p in (rendered.path / "k8s").glob("*.yaml") if p.name not in custom)
    if rendered.flavor != "job":  # what the controller makes: a Job, or pods from a pod template
        pods = job_of(rendered) if rendered.flavor == "jobset" else {
            "apiVersion": "v1", "kind": "PodTemplate", "template": pod_template_of(rendered),
            "metadata": {"name": rendered.path.name, "namespace": "default"},
        }  # fmt: skip
        inner = rendered.path.parent / f"{rendered.path.name}-{rendered.flavor}-pods.yaml"
        inner.write_text(yaml.safe_dump(pods))
        manifests.append(str(inner))
    done = subprocess.run(
        [BIN / "kubernetes-validate", "--strict", "--kubernetes-version", "1.33.0", *manifests],
        cwd=rendered.path, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    with_service = rendered.flavor == "job" and rendered.nodes > 1
    with_account = rendered.flavor == "trainjob"
    assert done.stdout.count("passed") == len(manifests) == (3 if with_service or with_account else 2)


def assert_refuses_only_the_broken(schema: dict, valid: dict, *broken: dict) -> None:
    """A shipped CRD schema is not a pass-everything stub: it takes `valid`, refuses each of `broken`."""
    jsonschema.validate(valid, schema)
    for manifest in broken:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(manifest, schema)


def test_jobset_passes_its_crd_schema(rendered):
    if rendered.flavor != "jobset":
        assert not (rendered.path / "k8s" / "jobset.yaml").exists()
        return
    jobset = manifest_of(rendered)
    jsonschema.validate(jobset, JOBSET_SCHEMA)
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1  # restarts every node's pod together
    (rule,) = jobset["spec"]["failurePolicy"]["rules"]  # a config error or the deadline: no restart
    assert rule["action"] == "FailJobSet"
    assert rule["onJobFailureReasons"] == ["PodFailurePolicy", "DeadlineExceeded"]
    assert jobset["spec"]["ttlSecondsAfterFinished"] == 604800
    assert jobset["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True}
    assert job_of(rendered)["spec"]["backoffLimit"] == 0  # a failed pod fails its Job; the JobSet restarts


def test_the_jobset_schema_refuses_what_the_crd_refuses():
    """The shipped schema is not a pass-everything stub."""
    valid = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": {},
             "spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {}}}]}}  # fmt: skip
    assert_refuses_only_the_broken(
        JOBSET_SCHEMA,
        valid,
        {**valid, "spec": {**valid["spec"], "replicas": 2}},  # unknown field
        {**valid, "spec": {"replicatedJobs": [{"name": "node"}]}},  # template is required
        {**valid, "spec": {**valid["spec"], "failurePolicy": {"restartStrategy": "Sometimes"}}},
    )


def test_pytorchjob_passes_its_crd_schema_and_the_operators_rules(rendered):
    if rendered.flavor != "pytorchjob":
        assert not (rendered.path / "k8s" / "pytorchjob.yaml").exists()
        return
    job = manifest_of(rendered)
    jsonschema.validate(job, PYTORCHJOB_SCHEMA)
    spec = job["spec"]
    # The operator's webhook (kubeflow/trainer pkg/webhooks/pytorch/pytorchjob_webhook.go) and
    # pod setup: replica types Master or Worker, a container named pytorch holding the port.
    assert set(spec["pytorchReplicaSpecs"]) == {"Worker"}  # worker 0 hosts the rendezvous
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == rendered.nodes and worker["restartPolicy"] == "OnFailure"
    pod = worker["template"]["spec"]
    assert pod["restartPolicy"] == worker["restartPolicy"]  # else the operator overrides it, warning
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"
    assert container["ports"] == [{"name": "pytorchjob-port", "containerPort": 29500}]
    # torchrun's c10d rendezvous from the operator's PET_* env: a fixed world, restarts in place
    policy = spec["elasticPolicy"]
    assert policy["rdzvBackend"] == "c10d" and policy["rdzvPort"] == 29500
    assert policy["minReplicas"] == policy["maxReplicas"] == rendered.nodes
    assert policy["maxRestarts"] == 3 and spec["nprocPerNode"] == str(rendered.gpus)
    assert spec["runPolicy"] == {
        "backoffLimit": 3 * rendered.nodes, "cleanPodPolicy": "Running", "ttlSecondsAfterFinished": 604800,
    }  # fmt: skip
    args = container["args"]
    # the launcher checks first, in the container: an init container that fails is retried
    # forever under OnFailure, and never counts toward backoffLimit
    assert container["command"] == [rendered.path.name, "train"] and "initContainers" not in pod
    assert args[:2] == ["--nproc-per-node", str(rendered.gpus)]
    assert not {"--nnodes", "--standalone", "--rdzv-endpoint"} & set(args)  # the operator's to set


def test_the_pytorchjob_schema_refuses_what_the_crd_refuses():
    valid = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {},
             "spec": {"pytorchReplicaSpecs": {"Worker": {"replicas": 1, "template": {}}}}}  # fmt: skip
    assert_refuses_only_the_broken(
        PYTORCHJOB_SCHEMA,
        valid,
        {**valid, "spec": {**valid["spec"], "replicas": 2}},  # unknown field
        {**valid, "spec": {"nprocPerNode": "2"}},  # pytorchReplicaSpecs is required
        {**valid, "spec": {**valid["spec"], "nprocPerNode": 2}},  # a string in the CRD
        {**valid, "spec": {**valid["spec"], "runPolicy": {"cleanPodPolicy": "Running", "ttl": 1}}},
    )


def test_job_env_block_carries_the_profile(rendered):
    (container,) = pod_template_of(rendered)["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"] if e["name"].startswith("NCCL_")}
    assert env == PROFILE_ENV[rendered.profile]


def flavor_table() -> list[str]:
    """The names in k8s/flavors.py's FLAVORS, in order: every flavor there is (the deploy schema's
    choices derive from it). Read from the unrendered source, which is Python."""
    tree = ast.parse((PACKAGE_SOURCES / "k8s" / "flavors.py").read_text())
    (table,) = [n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "FLAVORS"]
    return [key.value for key in table.keys]


def test_the_answers_offer_what_the_package_has():
    """cookiecutter.json's lists are the prompt's; the package's tables are what a project can use."""
    assert FLAVORS == flavor_table()
    assert sorted(PROFILE_ENV) == sorted(PROFILES)
    assert sorted(p.stem for p in (PROJECT_SOURCES / "configs" / "nccl").glob("*.yaml")) == sorted(PROFILES)


def test_every_flavor_is_prompted_documented_and_rendered():
    """What cannot import FLAVORS names each flavor in it, and no other: the prompt's help, the
    READMEs (the project's opening line, docs/kubernetes.md's "Which to pick" table, the template's answer
    table), the deploy group's comment, and the renders of this matrix, one and several nodes."""
    table = flavor_table()
    prompts = json.loads((TEMPLATE / "cookiecutter.json").read_text())["__prompts__"]["k8s_flavor"]
    assert [name for name in prompts if name != "__prompt__"] == table
    readme = (PROJECT_SOURCES / "README.md").read_text()
    (opening,) = re.findall(r"\{\{ (\{.*\})\[cookiecutter\.k8s_flavor\] \}\}", readme)
    assert list(ast.literal_eval(opening)) == table
    kubernetes = (PROJECT_SOURCES / "docs" / "kubernetes.md").read_text()
    pick = kubernetes[kubernetes.index("| flavor | needs | pick it when |") :].split("\n\n")[0]
    assert re.findall(r"^\| `([^`]+)` \|", pick, re.MULTILINE) == table
    answers = next(line for line in (TEMPLATE / "README.md").read_text().splitlines()
                   if line.startswith("| `k8s_flavor` |"))  # fmt: skip
    assert re.findall(r"`([a-z0-9]+)`: ", answers) == table
    deploy = (PROJECT_SOURCES / "configs" / "deploy" / "default.yaml").read_text()
    (comment,) = [line.split("#", 1)[1] for line in deploy.splitlines() if line.startswith("flavor:")]
    assert re.findall(r"([a-z0-9]+): ", comment) == table
    rendered = {(flavor, nodes > 1) for _, _, _, nodes, flavor in MATRIX}
    assert rendered == {(flavor, several) for flavor in table for several in (False, True)}


def test_profile_files_and_job_env_agree_through_the_projects_own_rules(rendered):
    """configs/nccl/<profile>.yaml, read through the generated nccl/decision.py, gives the Job's env."""
    nccl = load_module(rendered.path / "src" / rendered.package / "nccl" / "decision.py", f"{rendered.package}_nccl")
    for profile, expected in PROFILE_ENV.items():
        fields = yaml.safe_load((rendered.path / "configs" / "nccl" / f"{profile}.yaml").read_text())
        cfg = SimpleNamespace(**{field: None for field in nccl.FIELD_VARS}, env={}, auto=False)
        vars(cfg).update(fields)
        assert {var: value for var, (value, _) in nccl.config_env(cfg).items()} == expected, profile


def test_train_yaml_defaults_to_the_chosen_profile(rendered):
    defaults = yaml.safe_load((rendered.path / "configs" / "train.yaml").read_text())["defaults"]
    assert {"nccl": rendered.profile} in defaults


def test_pod_shape(rendered):
    pod = pod_template_of(rendered)["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == rendered.gpus
    args = container["args"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    if rendered.flavor == "trainjob":  # torchrun reads Trainer's PET_NPROC_PER_NODE
        assert env["PET_NPROC_PER_NODE"] == str(rendered.gpus) and "--nproc-per-node" not in args
    else:
        assert args[args.index("--nproc-per-node") + 1] == str(rendered.gpus)
    assert "-m" not in args and args[-1] == f"hydra.run.dir=/workspace/runs/{rendered.path.name}"  # the launcher's
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # restarted workers need a fresh store
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    if rendered.flavor in ("pytorchjob", "trainjob"):
        return  # their own tests
    job = job_of(rendered)
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    made_by_jobset = {"job": "", "jobset": "-node-0"}[rendered.flavor]  # <jobset>-<replicated job>-<index>
    assert job["metadata"]["name"] == rendered.path.name + made_by_jobset
    assert job["spec"]["backoffLimit"] >= (1 if rendered.flavor == "job" else 0)
    assert pod["restartPolicy"] == "Never"
    assert args[args.index("--max-restarts") + 1] == "3"
    if rendered.nodes == 1:
        assert container["command"] == [rendered.path.name, "train"] and "--standalone" in args
        assert "completionMode" not in job["spec"]


def test_several_nodes_get_an_indexed_job_and_a_headless_service(rendered):
    if rendered.flavor in ("pytorchjob", "trainjob"):
        # The operator or Trainer names the pods and wires up the rendezvous: no Service or
        # subdomain of ours, and the node count where it reads it.
        assert not (rendered.path / "k8s" / "service.yaml").exists()
        assert "subdomain" not in pod_template_of(rendered)["spec"]
        spec = manifest_of(rendered)["spec"]
        if rendered.flavor == "pytorchjob":
            assert spec["pytorchReplicaSpecs"]["Worker"]["replicas"] == rendered.nodes
        else:
            assert spec["trainer"]["numNodes"] == rendered.nodes
        return
    job = job_of(rendered)
    name = job["metadata"]["name"]
    pod = job["spec"]["template"]["spec"]
    if rendered.nodes == 1:  # one pod: no Service to name it
        assert "subdomain" not in pod and not (rendered.path / "k8s" / "service.yaml").exists()
        return
    (container,) = pod["containers"]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == rendered.nodes
    args = container["args"]
    assert args[args.index("--nnodes") + 1] == str(rendered.nodes) and "--standalone" not in args
    env = {e["name"]: e for e in container["env"]}
    if rendered.flavor == "jobset":  # the JobSet's own DNS: <jobset>-<replicated job>-0-0.<jobset>
        jobset = manifest_of(rendered)["metadata"]["name"]
        assert env["RDZV_HOST"]["value"] == f"{name}-0.{jobset}" and "subdomain" not in pod
    else:
        service = yaml.safe_load((rendered.path / "k8s" / "service.yaml").read_text())
        assert service["kind"] == "Service" and service["metadata"]["name"] == pod["subdomain"]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert service["spec"]["selector"] == {"job-name": name}
        assert env["RDZV_HOST"]["value"] == f"{name}-0.{service['metadata']['name']}"
    index = env["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    launch = container["command"][2]
    assert container["command"][:2] == ["/bin/sh", "-c"] and f"exec {rendered.path.name} train" in launch
    assert "0) host=localhost" in launch  # pod 0's torchrun hosts the c10d rendezvous
    assert '--rdzv-backend c10d --rdzv-endpoint "$host:$RDZV_PORT"' in launch
    assert env["RDZV_PORT"]["value"] == "29500" and args[args.index("--rdzv-id") + 1] == rendered.path.name
    assert '--local-addr "$POD_IP"' in launch
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    if rendered.flavor == "job":
        assert spec["backoffLimit"] == 3 * rendered.nodes  # one failure takes down every node's pod
    claim = yaml.safe_load((rendered.path / "k8s" / "runs-pvc.yaml").read_text())
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every node writes the shared run dir
    assert claim["metadata"]["name"] == f"{rendered.path.name}-runs-rwx"  # not the one-node claim's name


def test_job_survives_preemption_and_fails_fast_on_config_errors(rendered):
    pod = pod_template_of(rendered)["spec"]
    (container,) = pod["containers"]
    if rendered.flavor in ("job", "jobset"):  # the operators have none: see their own tests
        rules = job_of(rendered)["spec"]["podFailurePolicy"]["rules"]
        assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
        (fail,) = [r for r in rules if r["action"] == "FailJob"]
        # the launcher's exits for a config error and a divergence: no retry fixes them
        assert fail["onExitCodes"] == {"containerName": "trainer", "operator": "In", "values": [2, 4]}
    assert "initContainers" not in pod  # the launcher checks in the trainer container
    assert pod["terminationGracePeriodSeconds"] >= 60  # torchrun's own 30 s for workers to checkpoint, and more
    run_dir = next(a for a in container["args"] if a.startswith("hydra.run.dir="))
    (runs,) = [m for m in container["volumeMounts"] if run_dir.split("=", 1)[1].startswith(m["mountPath"])]
    (volume,) = [v for v in pod["volumes"] if v["name"] == runs["name"]]
    pvc = yaml.safe_load((rendered.path / "k8s" / "runs-pvc.yaml").read_text())
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


def test_pod_is_locked_down(rendered):
    pod = pod_template_of(rendered)["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert not {"hostNetwork", "hostIPC", "hostPID"} & pod.keys()
    if rendered.flavor == "trainjob":  # Trainer's patches cannot set the field: a token-less account
        account = yaml.safe_load((rendered.path / "k8s" / "serviceaccount.yaml").read_text())
        assert pod["serviceAccountName"] == account["metadata"]["name"] == rendered.path.name
        assert account["automountServiceAccountToken"] is False
    else:
        assert pod["automountServiceAccountToken"] is False  # nothing in the pod uses the API
    writable = {v["name"]: v for v in pod["volumes"]}
    assert writable["tmp"] == {"name": "tmp", "emptyDir": {}}
    for container in pod["containers"] + pod.get("initContainers", []):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert not context.get("privileged", False)
        # a read-only root: writes go to /tmp (HOME, the caches), /dev/shm and the run dir
        assert context["readOnlyRootFilesystem"] is True
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert {"name": "HOME", "value": "/tmp"} in container["env"]


def test_pods_request_what_the_deploy_config_says(rendered):
    """Requests scaled by the GPUs per node (not BestEffort: evicted first), a memory limit with
    room for the memory-backed /dev/shm, an ephemeral-storage request for /tmp, and a version tag
    that a node may reuse (IfNotPresent; Kubernetes' default too, where a TrainJob cannot say)."""
    deploy = deploy_of(rendered)
    pod = pod_template_of(rendered)["spec"]
    memory = rendered.gpus * 24 + 16  # memory_per_gpu 24Gi, shm_size 16Gi
    for container in pod["containers"] + pod.get("initContainers", []):
        assert container["resources"]["requests"] == {
            "cpu": str(4 * rendered.gpus), "memory": f"{memory}Gi", "ephemeral-storage": "10Gi",
        }  # fmt: skip
        assert container["resources"]["limits"]["memory"] == f"{memory}Gi"
        assert "cpu" not in container["resources"]["limits"]  # throttling would stall NCCL
        assert container["image"] == deploy["image"] == f"ghcr.io/your-org/{rendered.path.name}:0.1.0"
        assert container.get("imagePullPolicy", "IfNotPresent") == "IfNotPresent"
        assert "imagePullPolicy" in container or rendered.flavor == "trainjob"
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"]["sizeLimit"] == deploy["shm_size"] == "16Gi"
    workload = manifest_of(rendered)
    ttl = {
        "job": lambda w: w["spec"]["ttlSecondsAfterFinished"],
        "jobset": lambda w: w["spec"]["ttlSecondsAfterFinished"],
        "pytorchjob": lambda w: w["spec"]["runPolicy"]["ttlSecondsAfterFinished"],
        "trainjob": lambda w: 604800,  # not a TrainJob field: its runtime's (see the file's header)
    }[rendered.flavor]  # fmt: skip
    assert ttl(workload) == deploy["ttl_after_finished_s"] == 604800
    assert "activeDeadlineSeconds" not in json.dumps(workload)  # optional, off by default


def test_trainjob_follows_trainers_rules(rendered):
    """What Kubeflow Trainer v2.3 reads from a TrainJob (../shared/k8s/reference/: the torch
    plugin and pkg/constants): the torch-distributed runtime, the trainer container named node,
    no reserved PET_* env, and a launch line that takes torchrun's rendezvous from Trainer's env."""
    if rendered.flavor != "trainjob":
        assert not (rendered.path / "k8s" / "trainjob.yaml").exists()
        return
    trainjob = manifest_of(rendered)
    spec = trainjob["spec"]
    assert trainjob["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert spec["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": "torch-distributed",
    }  # fmt: skip
    trainer = spec["trainer"]
    assert trainer["numNodes"] == rendered.nodes and trainer["numProcPerNode"] == rendered.gpus
    reserved = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
    assert not reserved & {e["name"] for e in trainer["env"]}  # Trainer's webhook refuses them
    (patch,) = spec["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"  # the runtime's replicated Job, and its container below
    assert [c["name"] for c in node["template"]["spec"]["template"]["spec"]["containers"]] == ["node"]
    launch = trainer["command"][2]
    assert trainer["command"][:2] == ["/bin/sh", "-c"]
    assert f"exec {rendered.path.name} train --rdzv-backend" in launch  # the launcher checks first
    assert 'case "$PET_NODE_RANK" in 0) host=localhost ;; *) host="$PET_MASTER_ADDR" ;; esac;' in launch
    assert '--rdzv-backend c10d --rdzv-endpoint "$host:$PET_MASTER_PORT" --local-addr "$POD_IP"' in launch
    args = trainer["args"]
    assert args[args.index("--rdzv-id") + 1] == rendered.path.name and args[args.index("--max-restarts") + 1] == "3"
    assert not {"--nnodes", "--nproc-per-node", "--standalone"} & set(args)  # Trainer's PET_* say it
    claim = yaml.safe_load((rendered.path / "k8s" / "runs-pvc.yaml").read_text())
    assert claim["spec"]["accessModes"] == ["ReadWriteMany" if rendered.nodes > 1 else "ReadWriteOnce"]


def test_dockerignore_keeps_history_outputs_and_secrets_out_of_the_image(rendered):
    ignored = set((rendered.path / ".dockerignore").read_text().split())
    assert {".git", "outputs", "checkpoints", ".env", ".env.*", "*.pt"} <= ignored


def test_the_image_gets_the_rdma_libraries_by_default_where_the_profile_is_infiniband(rendered, tmp_path):
    """NCCL needs libibverbs and the providers in the image for IB or RoCE, else it uses sockets
    between nodes: the RDMA build argument's step, run by sh with apt-get and rm noted instead."""
    dockerfile = (rendered.path / "Dockerfile").read_text()
    default = re.search(r"^ARG RDMA=(.*)$", dockerfile, re.M)[1]
    assert default == ("1" if rendered.profile == "infiniband" else "0")
    step = re.search(r'^RUN (if \[ "\$RDMA" = 1 \].*?fi)$', dockerfile, re.M | re.S)[1]
    for tool in ("apt-get", "rm"):
        (tmp_path / tool).write_text('#!/bin/sh\necho "${0##*/} $*" >> "$NOTED"\n')
        (tmp_path / tool).chmod(0o755)
    ran = {}
    for rdma in ("0", "1"):
        noted = tmp_path / f"noted-{rdma}"
        noted.touch()
        env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "RDMA": rdma, "NOTED": str(noted)}
        subprocess.run(["sh", "-efc", step], env=env, check=True, timeout=30)  # -f: no globbing
        ran[rdma] = noted.read_text().splitlines()
    install = "apt-get install --yes --no-install-recommends libibverbs1 ibverbs-providers"
    assert ran == {"0": [], "1": ["apt-get update", install, "rm -rf /var/lib/apt/lists/*"]}


def test_dockerfile_passes_hadolint_and_runs_torchrun_as_non_root(rendered):
    done = subprocess.run(
        [BIN / "hadolint", "--failure-threshold", "warning", "Dockerfile"],
        cwd=rendered.path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    dockerfile = (rendered.path / "Dockerfile").read_text()
    # fully qualified: registries' short-name policies refuse "pytorch/pytorch"; a current torch
    assert re.search(r"^FROM docker\.io/pytorch/pytorch:2\.13\.0-cuda13\.0-cudnn9-runtime$", dockerfile, re.M)
    assert re.search(r"^# .*FROM <image>@sha256:<digest>$", dockerfile, re.M)  # pinning, in one line
    assert re.search(r"^USER 10001:10001$", dockerfile, re.M)
    assert f'ENTRYPOINT ["{rendered.path.name}", "train"]' in dockerfile  # the launcher, as PID 1
    assert f'CMD ["--standalone", "--nproc-per-node", "{rendered.gpus}"]' in dockerfile
    assert "pip install --no-cache-dir --no-deps ." in dockerfile  # no torch download


def test_cli_renders_and_prints_next_steps(tmp_path):
    done = cookiecutter_cli(tmp_path, "project=cli-demo", "nccl_profile=socket", "num_gpus=4")
    assert done.returncode == 0, done.stderr
    assert f"Created cli-demo/. Next:\n  cd {tmp_path / 'cli-demo'}\n" in done.stdout  # right from anywhere
    assert "make train: 4 GPU(s)" in done.stdout
    job = yaml.safe_load((tmp_path / "cli-demo" / "k8s" / "job.yaml").read_text())
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_the_default_image_is_tagged_with_the_projects_version(default_project):
    """Not :latest, which a node running IfNotPresent would keep forever: the version a release bumps."""
    version = tomllib.loads((default_project / "pyproject.toml").read_text())["project"]["version"]
    image = yaml.safe_load((default_project / "configs" / "deploy" / "default.yaml").read_text())["image"]
    assert image == f"ghcr.io/your-org/ddp-project:{version}"


def test_a_deploy_value_the_renderer_refuses_fails_the_render_in_one_line(tmp_path):
    """The post-generation hook renders k8s/ through k8s.deploy_errors(): an answer the pre-gen
    hook lets through (a :latest image) is refused there, and cookiecutter removes the project."""
    done = cookiecutter_cli(tmp_path, "image=ghcr.io/acme/x:latest")
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert ours == [
        "error: deploy.image=ghcr.io/acme/x:latest: a node keeps the :latest it pulled first; "
        "use a version tag or a digest (or image_pull_policy=Always)"
    ], done.stderr
    assert list(tmp_path.iterdir()) == []


CHECKOV_SKIPS = yaml.safe_load((DATA / "checkov-skips.yaml").read_text())
CHECKOV = BIN.parent / "checkov" / "bin" / "checkov"  # its own environment: see the Makefile


def test_checkov_finds_nothing_beyond_the_reasoned_skips(matrix, tmp_path):
    """checkov (an outside linter, the admin's view) over every rendered manifest and Dockerfile,
    and every flavor's pods: checkov reads a Job's pod template but not a JobSet's, PyTorchJob's
    or TrainJob's, so those go in as the Pods their controllers make. Each finding is fixed, or
    its rule is in tests/data/checkov-skips.yaml with its reason; a skip that no render needs any
    more fails too, so the list stays true."""
    files = sorted(str(p) for r in matrix.values() for p in [*(r.path / "k8s").glob("*.yaml"), r.path / "Dockerfile"])
    for id_, rendered in matrix.items():
        if rendered.flavor != "job":
            # checkov reads the pod alone
            skip = {
                "checkov.io/skip1": "CKV_K8S_38=A TrainJob's pods cannot say it: their ServiceAccount, "
                "rendered beside the TrainJob, mounts no token (test_cluster checks the pods get none)"
            }
            manifest = pod_from(pod_template_of(rendered), f"{rendered.path.name}-0", "default",
                                skip if rendered.flavor == "trainjob" else None)  # fmt: skip
            pod = tmp_path / f"{id_}-pod.yaml"
            pod.write_text(yaml.safe_dump(manifest))
            files.append(str(pod))
    assert len(files) > len(matrix) * 3
    done = subprocess.run(
        [CHECKOV, "--quiet", "--compact", "--skip-download", "--output", "json",
         "--framework", "kubernetes", "dockerfile", *[arg for f in files for arg in ("--file", f)]],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: findings, judged below
    reports = json.loads(done.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}
    failed = [check for r in reports for check in r["results"]["failed_checks"]]
    unexplained = sorted({f"{c['check_id']} {c['file_path']}: {c['check_name']}" for c in failed
                          if c["check_id"] not in CHECKOV_SKIPS})  # fmt: skip
    assert unexplained == []
    assert all(isinstance(reason, str) and reason.strip() for reason in CHECKOV_SKIPS.values())
    assert sorted(set(CHECKOV_SKIPS) - {c["check_id"] for c in failed}) == []  # no stale skips


# What the targets that need torch and the installed project run first: one line each when not.
READY = (
    'python -c "import torch" 2>/dev/null || {{ echo "torch is missing: run make torch (or use the image, '
    'which has it)" >&2; exit 1; }}\n'
    'command -v {project} >/dev/null || {{ echo "{project} is not installed here: run make install" >&2; exit 1; }}\n'
)
MAKE_TARGETS = {
    "torch": "python -c \"import torch; print('torch', torch.__version__, 'is installed')\" 2>/dev/null \\\n"
    "  || python -m pip install --retries 1 --timeout 20 torch --index-url https://download.pytorch.org/whl/cpu \\\n"
    "  || python -m pip install torch",
    "install": "python -m pip install -e '.[dev]'",
    "install-all": "python -m pip install -e '.[dev,wandb,mlflow,sweep]'",
    "test": READY + 'python -m pytest -m "not slow"',
    "test-full": READY + "python -m pytest",
    "train": READY + "{project} train --standalone --nproc-per-node {gpus}",
    "train-cpu": READY + "{project} train --standalone --nproc-per-node 2 dist.backend=gloo",
    "doctor": READY + "python -m {package}.doctor",
    "bench": READY + "python -m {package}.bench",
    "tensorboard": "tensorboard --logdir outputs",
    "docker-build": "docker build -t ghcr.io/your-org/{project}:0.1.0 .",
    "k8s-render": "python -m {package}.k8s",
    "k8s-apply": "python -m {package}.k8s --check\npython -m {package}.k8s.apply",
    "k8s-doctor": "python -m {package}.k8s.doctor",
}


def make(rendered, *args: str) -> subprocess.CompletedProcess:
    """The project's make, as a user's shell runs it: not as a sub-make of the template's `make test`."""
    env = {k: v for k, v in os.environ.items() if k not in {"MAKEFLAGS", "MFLAGS", "MAKELEVEL"}}
    return subprocess.run(["make", *args], cwd=rendered.path, env=env, capture_output=True, text=True)


def test_makefile_targets_run_the_documented_commands(rendered):
    for target, expected in MAKE_TARGETS.items():
        done = make(rendered, "-n", target)
        assert done.returncode == 0, done.stderr
        command = expected.format(
            gpus=rendered.gpus, package=rendered.package, project=rendered.path.name, flavor=rendered.flavor
        )
        assert "\n".join(line.rstrip() for line in done.stdout.splitlines()) == command, target
    with_args = make(rendered, "-n", "train-cpu", "ARGS=trainer.max_steps=5")
    assert with_args.stdout.strip().endswith("dist.backend=gloo trainer.max_steps=5")
    listed = make(rendered, "help").stdout
    assert {line.split()[0] for line in listed.splitlines()} == {"help", *MAKE_TARGETS}


def test_pre_commit_config_is_valid_and_its_yamllint_passes(rendered):
    done = subprocess.run([BIN / "pre-commit", "validate-config", ".pre-commit-config.yaml"],
                          cwd=rendered.path, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    config = yaml.safe_load((rendered.path / ".pre-commit-config.yaml").read_text())
    hooks = {hook["id"] for repo in config["repos"] for hook in repo["hooks"]}
    assert hooks == {"ruff-check", "ruff-format", "yamllint", "hadolint"}
    linted = subprocess.run([BIN / "yamllint", "--strict", "."], cwd=rendered.path, capture_output=True, text=True)
    assert linted.returncode == 0, linted.stdout  # configs/, k8s/, the workflow, this config


def test_github_workflow_keeps_its_expressions_and_runs_tests_and_a_gloo_run(rendered):
    text = (rendered.path / ".github" / "workflows" / "ci.yml").read_text()
    assert "${{ github.workflow }}-${{ github.ref }}" in text and "${{ always() }}" in text
    job = yaml.safe_load(text)["jobs"]["test"]  # the image's jobs: test_workflow.py
    (setup_python,) = [step for step in job["steps"] if step.get("uses", "").startswith("actions/setup-python@")]
    assert setup_python["with"]["python-version"] == "3.11"
    runs = [step["run"] for step in job["steps"] if "run" in step]
    # the Quick start's lines (make torch: PyTorch's CPU build, not the multi-GB CUDA one), in
    # their full tier: both loggers' packages, and the failure-injection tests
    readme = [line.split("#")[0].strip() for line in quick_start((rendered.path / "README.md").read_text())]
    full_tier = {"make install": "make install-all", "make test": "make test-full"}
    assert runs[1:] == [full_tier.get(line, line) for line in readme[1:]]
    assert readme[0].startswith("python3 -m venv .venv")
    assert "make test-full" in runs and 'make train-cpu ARGS="experiment=smoke"' in runs


def quick_start(readme: str) -> list[str]:
    """The first bash block after '## Quick start'."""
    section = readme.split("## Quick start", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()


def test_one_setup_path_in_the_template_readme_cookiecutters_next_and_the_project_readme(tmp_path):
    """A newcomer meets the steps three times; they must be the same lines, each pasteable."""
    done = cookiecutter_cli(tmp_path, "project=my-run", "num_gpus=2")
    assert done.returncode == 0, done.stderr
    printed = done.stdout.split("Next:\n", 1)[1].splitlines()
    assert printed[0].strip() == f"cd {tmp_path / 'my-run'}"
    next_steps = [line.strip() for line in printed[1:] if line.strip()]
    template_steps = quick_start((TEMPLATE / "README.md").read_text())
    assert template_steps[2] == "cd ../my-run"
    project_steps = quick_start((tmp_path / "my-run" / "README.md").read_text())
    assert next_steps == template_steps[3:] == project_steps
    assert project_steps[0].startswith("python3 -m venv .venv") and project_steps[1].startswith("make torch")


PATH_NAMED = re.compile(
    r"(?<![\w./<{-])((?:\.github|configs|docs|src|tests|k8s|scripts|benchmarks|hooks)/[\w.{}/-]*[\w}])"
)
# Named in the docs on purpose, and absent from a default render: machine-local or per flavor.
MAY_BE_ABSENT = {"configs/local/default.yaml", "k8s/service.yaml", "k8s/jobset.yaml", "k8s/pytorchjob.yaml",
                 "k8s/trainjob.yaml", "k8s/serviceaccount.yaml",
                 # docs/extending.md's examples: what its recipes add (tests/test_extending.py adds them)
                 "configs/model/linear.yaml", "configs/logger/console.yaml", "k8s/appwrapper.yaml"}  # fmt: skip


# This README section names lightning-hydra-template's files, next to ours.
THEIRS = re.compile(r"^#+ Coming from lightning-hydra-template$.*?(?=^## |\Z)", re.MULTILINE | re.DOTALL)


def named_paths(text: str) -> set[str]:
    text = THEIRS.sub("", text)
    return {m.rstrip(".") for m in PATH_NAMED.findall(text) if not {"<", "*", "{"} & set(m)}  # {: an f-string


def test_every_path_the_docs_and_comments_name_exists(default_project):
    """READMEs, the Makefile, the Dockerfile, config comments and docstrings name files: each one
    is in the render (or the template, for the template's README)."""
    kinds = {".md", ".py", ".yaml", ".toml", ""}  # "": Makefile, Dockerfile
    sources = [p for p in default_project.rglob("*") if p.is_file() and p.suffix in kinds]
    missing = set()
    for source in sources:
        if "k8s" in source.parts[len(default_project.parts) :][:1]:
            continue  # generated manifests name no files
        for path in named_paths(source.read_text(errors="replace")):
            if path not in MAY_BE_ABSENT and not (default_project / path).exists():
                missing.add(f"{source.relative_to(default_project)}: {path}")
    for path in named_paths((TEMPLATE / "README.md").read_text().replace("{{cookiecutter.package}}", "ddp_project")):
        if not (TEMPLATE / path).exists() and not (default_project / path).exists() and path not in MAY_BE_ABSENT:
            missing.add(f"README.md (template): {path}")
    assert sorted(missing) == []


LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    text = re.sub(r"^```.*?^```$", "", text, flags=re.MULTILINE | re.DOTALL)
    return {slug(heading) for heading in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


def test_every_link_in_the_readme_and_docs_pages_reaches_a_file_and_heading(default_project):
    """The README is the first hour and links the reference, docs/*.md, which link each other: a
    link that names a missing page, or a heading that moved, is a dead end for a newcomer."""
    pages = [default_project / "README.md", default_project / "configs" / "local" / "README.md",
             *sorted((default_project / "docs").glob("*.md"))]  # fmt: skip
    assert len(pages) >= 12
    dead, checked = [], 0
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"\w+://", target):
                continue  # the web: not checked offline
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            checked += 1
            if not linked.is_file():
                dead.append(f"{page.relative_to(default_project)}: {target}: no such file")
            elif anchor and anchor not in anchors(linked.read_text()):
                dead.append(f"{page.relative_to(default_project)}: {target}: no such heading")
    assert checked > 20 and dead == []

"""The deploy group: each bad value is refused in one line before anything is written, and what
the pods ask of a node, and where they may run, follows from the config."""

import itertools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import PACKAGE, deploy_defaults, trainer_container
from omegaconf import OmegaConf

from ddp_project.config.compose import config_problem
from ddp_project.config.overrides import hydra_overrides
from ddp_project.core.exits import Exit
from ddp_project.k8s import apply, cluster, meta, pods, render, sync
from ddp_project.k8s.flavors import FLAVORS

ROOT = Path(__file__).resolve().parents[1]
BAD = [
    ("deploy.name=3d-run", "deploy.name=3d-run: must be a-z, 0-9 and '-', start with a letter"),
    ("deploy.name=" + "a" * 48, f"deploy.name={'a' * 48}: must be a-z, 0-9 and '-'"),
    ("deploy.namespace=Team_A", "deploy.namespace=Team_A: must be a DNS label"),
    ("deploy.image=ghcr.io/acme/x", "deploy.image=ghcr.io/acme/x: must name a tag or a digest"),
    (
        "deploy.image=ghcr.io/acme/x:latest",
        "deploy.image=ghcr.io/acme/x:latest: a node keeps the :latest",
    ),
    ("deploy.image=ghcr.io/Acme/x:1", "deploy.image=ghcr.io/Acme/x:1: must be an image reference"),
    ("deploy.image_pull_policy=Sometimes", "deploy.image_pull_policy: Invalid value 'Sometimes'"),
    (
        "deploy.flavor=trainjob deploy.image_pull_policy=Always",
        "deploy.image_pull_policy=Always: a TrainJob cannot set it",
    ),
    ("deploy.nodes=0", "deploy.nodes=0: must be 1 to 100000"),
    (
        "deploy.nodes=100001",
        "deploy.nodes=100001: must be 1 to 100000 (an Indexed Job's most completions)",
    ),
    (  # the rendered backoffLimit is backoff_limit x nodes, an int32
        "deploy.nodes=4 deploy.runs_access_mode=ReadWriteMany deploy.backoff_limit=600000000",
        "deploy.backoff_limit=600000000: must be 0 to 536870911",
    ),
    ("deploy.max_restarts=2147483648", "deploy.max_restarts=2147483648: must be 0 to 2147483647"),
    (
        "deploy.ttl_after_finished_s=2147483648",
        "deploy.ttl_after_finished_s=2147483648: must be null (keep) or seconds, 0 to",
    ),
    (
        "deploy.affinity={nodeAfinity:{}}",
        "deploy.affinity.nodeAfinity: no such key; did you mean deploy.affinity.nodeAffinity? "
        "allowed: nodeAffinity, podAffinity",
    ),
    ("deploy.affinity={podAffinity:[]}", "deploy.affinity.podAffinity: must be a mapping"),
    (
        "deploy.one_pod_per_node=true deploy.affinity={podAntiAffinity:{}}",
        "deploy.one_pod_per_node=True: is a podAntiAffinity of its own",
    ),
    ("deploy.image_pull_secrets=[Ghcr]", "deploy.image_pull_secrets: Ghcr: must be a Secret name"),
    (
        "deploy.queue_priority=high",
        "deploy.queue_priority=high: only Kueue reads it: set deploy.queue too",
    ),
    (
        "deploy.queue=q deploy.queue_priority=High",
        "deploy.queue_priority=High: must be null or a Kueue WorkloadPriorityClass",
    ),
    (
        "deploy.queue=q deploy.topology=rack_",
        "deploy.topology=rack_: must be null or a node label key",
    ),
    (
        "deploy.topology=cloud.provider.com/topology-rack",
        "deploy.topology=cloud.provider.com/topology-rack: only Kueue reads it",
    ),
    ("deploy.topology_mode=strict", "deploy.topology_mode: Invalid value 'strict'"),
    (
        "+deploy.pod_annotations.big=" + "x" * 262144,
        "deploy.pod_annotations: 262147 bytes in all; a pod's annotations hold at most 262144",
    ),
    ("deploy.gpus_per_node=17", "deploy.gpus_per_node=17: must be 1 to 16"),
    ("deploy.cpu_per_gpu=0", "deploy.cpu_per_gpu=0: must be a CPU quantity above 0"),
    ("deploy.cpu_per_gpu=0.0001", "deploy.cpu_per_gpu=0.0001: must be a CPU quantity"),
    ("deploy.memory_per_gpu=24GB", "deploy.memory_per_gpu=24GB: must be a size such as 16Gi"),
    ("deploy.shm_size=lots", "deploy.shm_size=lots: must be a size"),
    ("deploy.runs_storage=100m", "deploy.runs_storage=100m: must be a size"),
    ("deploy.rdzv_port=80", "deploy.rdzv_port=80: must be 1024 to 65535"),
    (
        "deploy.flavor=trainjob deploy.rdzv_port=29400",
        "deploy.rdzv_port=29400: a TrainJob's rendezvous port is Trainer's 29500",
    ),
    (
        "deploy.nodes=2 deploy.runs_access_mode=ReadWriteOnce",
        "deploy.runs_access_mode=ReadWriteOnce: several nodes share the run dir: ReadWriteMany",
    ),
    ("deploy.runs_access_mode=RWX", "deploy.runs_access_mode: Invalid value 'RWX'"),
    (
        "deploy.storage_class=Fast_SSD",
        "deploy.storage_class=Fast_SSD: must be null or a StorageClass",
    ),
    ("deploy.runs_claim=-runs", "deploy.runs_claim=-runs: must be null or a PersistentVolumeClaim"),
    (
        "deploy.extra_resources={nvidia.com/gpu:1}",
        "deploy.extra_resources.nvidia.com/gpu: must be an extended resource name (prefix/name",
    ),
    (
        "deploy.extra_resources={rdma/ib:0}",
        "deploy.extra_resources.rdma/ib=0: must be a whole number",
    ),
    (
        "deploy.extra_resources={ib:1}",
        "deploy.extra_resources.ib: must be an extended resource name",
    ),
    (
        "deploy.capabilities=[CAP_IPC_LOCK]",
        "deploy.capabilities: CAP_IPC_LOCK: must be a Linux capability",
    ),
    ("deploy.pod_labels={team:_a}", "deploy.pod_labels.team=_a: must be a label value"),
    (
        "deploy.pod_labels={app.kubernetes.io/name:x}",
        "deploy.pod_labels.app.kubernetes.io/name: is this project's own label",
    ),
    ("deploy.pod_annotations={-x:1}", "deploy.pod_annotations.-x: must be an annotation key"),
    ("deploy.rdzv_timeout_s=9", "deploy.rdzv_timeout_s=9: must be 10 to 86400 seconds (a day)"),
    ("deploy.rdzv_timeout_s=86401", "deploy.rdzv_timeout_s=86401: must be 10 to 86400 seconds"),
    ("deploy.ttl_after_finished_s=-1", "deploy.ttl_after_finished_s=-1: must be null (keep) or"),
    ("deploy.active_deadline_s=0", "deploy.active_deadline_s=0: must be null (no limit) or"),
    (
        "deploy.tolerations=[{key:gpu,operator:Maybe}]",
        "deploy.tolerations[0].operator=Maybe: must be Equal or Exists",
    ),
    ("deploy.tolerations=[{value:x}]", "deploy.tolerations[0].key=None: must be a taint key"),
    (
        "deploy.tolerations=[{key:gpu,tolerationSeconds:60}]",
        "deploy.tolerations[0].tolerationSeconds=60: must be a whole number of seconds",
    ),
    (
        "deploy.tolerations=[{key:gpu,colour:red}]",
        "deploy.tolerations[0].colour: no such key; allowed: key,",
    ),
    (
        "deploy.tolerations=[{key:gpu,effct:NoSchedule}]",
        "deploy.tolerations[0].effct: no such key; did you mean deploy.tolerations[0].effect? "
        "allowed: key,",
    ),
    ("+deploy.node_selector.zone_=a", "deploy.node_selector.zone_: must be a label key"),
    ("+deploy.node_selector={zone:a/b}", "deploy.node_selector.zone=a/b: must be a label value"),
    # A number's text is lost on the way in (1.10 reads as 1.1): the label would say another value.
    (
        "deploy.pod_labels.version=1.10",
        "deploy.pod_labels.version=1.1: read as the number 1.1, which loses what was written",
    ),
    (
        "+deploy.node_selector={tier:1e3}",
        "deploy.node_selector.tier=1000.0: read as the number 1000.0",
    ),
    (
        "+deploy.pod_annotations={rev:2.50}",
        "deploy.pod_annotations.rev=2.5: read as the number 2.5",
    ),
    ("deploy.priority_class=High", "deploy.priority_class=High: must be null or a PriorityClass"),
    (
        "deploy.env={WANDB_API_KEY:abc}",
        "deploy.env.WANDB_API_KEY: looks like a secret, which k8s/ and the logs would hold in the "
        "clear; name it from a Secret instead: deploy.secret_env.WANDB_API_KEY=<secret>/<key>",
    ),
    (
        "deploy.env={NCCL_DEBUG:INFO}",
        "deploy.env.NCCL_DEBUG: an NCCL or gloo variable: set it with nccl.env.NCCL_DEBUG",
    ),
    ("deploy.env={HOME:/root}", "deploy.env.HOME: the launch line sets it"),
    ("deploy.env={PET_NNODES:2}", "deploy.env.PET_NNODES: the launch line sets it"),
    ("deploy.env={1X:a}", "deploy.env.1X: must be a variable name"),
    ("deploy.env={LR:0.10}", "deploy.env.LR=0.1: read as the number 0.1"),
    ("deploy.env={TEAM:[a]}", "deploy.env.TEAM=['a']: must be a string, a number or true/false"),
    (
        "deploy.secret_env={WANDB_API_KEY:wandb}",
        "deploy.secret_env.WANDB_API_KEY=wandb: must be <Secret>/<key>",
    ),
    (
        "deploy.secret_env={WANDB_API_KEY:Wandb/key}",
        "deploy.secret_env.WANDB_API_KEY=Wandb/key: must be <Secret>/<key>",
    ),
    (
        "deploy.env={TEAM:a} deploy.secret_env={TEAM:s/k}",
        "deploy.env.TEAM: also in deploy.secret_env: keep one",
    ),
    (
        "nccl.env.WANDB_API_KEY=x",
        "nccl.env.WANDB_API_KEY: keys must be NCCL_*, TORCH_NCCL_* or GLOO_* variable names "
        "(A-Z, 0-9, _); other variables: deploy.env, or deploy.secret_env for a secret",
    ),
    (
        "deploy.flavor=trainjob deploy.priority_class=high",
        "deploy.priority_class=high: a TrainJob cannot set it",
    ),
    ("deploy.queue=Team.A", "deploy.queue=Team.A: must be null or a Kueue LocalQueue name"),
    (
        "deploy.lost_node_s=-1",
        "deploy.lost_node_s=-1: must be null (the cluster's 300 s) or seconds, 0 to 86400",
    ),
    ("deploy.lost_node_s=86401", "deploy.lost_node_s=86401: must be null"),
    (
        "deploy.lost_node_s=99999999999999999999999",
        "deploy.lost_node_s=99999999999999999999999: must be null",
    ),
    (
        "deploy.lost_node_s=1.5",
        "deploy.lost_node_s: Value '1.5' of type 'float' could not be converted to Integer",
    ),
    (
        "deploy.lost_node_s=''",
        "deploy.lost_node_s: Value '' of type 'str' could not be converted to Integer",
    ),
    (
        "deploy.lost_node_s=true",
        "deploy.lost_node_s: Value 'True' of type 'bool' could not be converted",
    ),
    (
        "deploy.lost_node_s=[]",
        "deploy.lost_node_s: Value '[]' of type 'list' could not be converted",
    ),
    (
        "deploy.tolerations=[{key:node.kubernetes.io/not-ready,operator:Exists,effect:NoExecute,"
        "tolerationSeconds:5}]",
        "deploy.tolerations[0].key=node.kubernetes.io/not-ready: set deploy.lost_node_s instead",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[o[:80] for o, _ in BAD])
def test_each_bad_deploy_value_is_one_line(overrides, message):
    problem = config_problem(overrides.split(" "))
    assert problem is not None and "\n" not in problem
    assert problem.startswith(message), problem


def test_k8s_writes_nothing_for_a_bad_value(tmp_path):
    out = tmp_path / "k8s"
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.k8s", "--force", "--out", str(out), "deploy.nodes=0"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert (
        done.stderr
        == "config error: deploy.nodes=0: must be 1 to 100000 (an Indexed Job's most completions)\n"
    )
    assert not out.exists()


def test_the_hooks_plain_yaml_path_refuses_the_same_way(tmp_path):
    """The template's hook renders k8s/ from the YAML files alone, without OmegaConf."""
    configs = tmp_path / "configs"
    for group in ("deploy", "nccl"):
        (configs / group).mkdir(parents=True)
        for path in (ROOT / "configs" / group).glob("*.yaml"):
            (configs / group / path.name).write_text(path.read_text())
    deploy = yaml.safe_load((configs / "deploy" / "default.yaml").read_text())
    assert render.from_files(configs, "auto")  # the shipped values pass
    deploy["memory_per_gpu"] = "24 Gi"
    (configs / "deploy" / "default.yaml").write_text(yaml.safe_dump(deploy))
    with pytest.raises(ValueError, match=r"^deploy.memory_per_gpu=24 Gi: must be a size"):
        render.from_files(configs, "auto")
    for key, value, allowed in (
        ("extra_resources", None, "must be a mapping"),
        ("capabilities", "IPC_LOCK", "must be a list"),
        ("affinity", [], "must be a mapping"),
        ("image_pull_secrets", "ghcr-pull", "must be a list"),
        ("guaranteed", "yes", "must be true or false"),
        ("one_pod_per_node", 1, "must be true or false"),
        ("lost_node_s", "60", "must be null"),  # YAML without the schema: a quoted number, a bool
        ("lost_node_s", True, "must be null"),
        ("lost_node_s", 1.5, "must be null"),
    ):
        shipped = yaml.safe_load((ROOT / "configs" / "deploy" / "default.yaml").read_text())
        (configs / "deploy" / "default.yaml").write_text(yaml.safe_dump({**shipped, key: value}))
        with pytest.raises(ValueError, match=rf"^deploy.{key}={re.escape(str(value))}: {allowed}"):
            render.from_files(configs, "auto")


def test_out_outside_the_project_is_refused_unless_forced(tmp_path):
    """A stray --out (a home directory, a kubelet's manifest folder) gets nothing written."""
    out = tmp_path / "elsewhere"
    command = [sys.executable, "-m", f"{PACKAGE}.k8s", "--out", str(out)]
    refused = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr == (
        f"error: --out {out}: outside this project ({ROOT}); pass --force to write there\n"
    )
    assert not out.exists()
    forced = subprocess.run([*command, "--force"], cwd=ROOT, capture_output=True, text=True)
    assert forced.returncode == 0, forced.stderr
    assert (out / "runs-pvc.yaml").exists()


def test_k8s_from_a_folder_of_the_project_writes_the_projects_k8s(tmp_path):
    """Run from src/ or tests/, the render reads the project's configs/ and writes k8s/ beside
    them, where make k8s-apply reads it, not a k8s/ in that folder."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "configs", project / "configs")
    shutil.copy(ROOT / "pyproject.toml", project)
    (project / "src").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", f"{PACKAGE}.k8s"],
        cwd=project / "src",
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    wrote = done.stdout.splitlines()[0].removeprefix("wrote ").split(", ")
    assert f"../k8s/{deploy_defaults()['flavor']}.yaml" in wrote, done.stdout
    assert all(path.startswith("../k8s/") for path in wrote), done.stdout
    assert (project / "k8s" / "runs-pvc.yaml").exists() and not (project / "src" / "k8s").exists()


def test_an_override_that_configs_local_shadows_is_refused_in_one_line(tmp_path):
    """configs/local/default.yaml is composed after configs/deploy/ and configs/nccl/: an override
    written there under a key local sets would vanish at the next render. Refused, nothing
    written; a key local leaves alone is written as before."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "configs", project / "configs")
    shutil.copy(ROOT / "pyproject.toml", project)
    local = project / "configs" / "local" / "default.yaml"
    local.write_text(
        "# @package _global_\ndefaults:\n  - override /nccl: socket\ndeploy:\n  gpus_per_node: 2\n"
    )
    configs = {p: p.read_text() for p in (project / "configs").rglob("*.yaml")}
    command = [sys.executable, "-m", f"{PACKAGE}.k8s"]
    deploy_file = project / "configs" / "deploy" / "default.yaml"
    for override, shadow, path in [
        ("deploy.gpus_per_node=4", "deploy.gpus_per_node", deploy_file),
        ("nccl=pcie_safe", "its nccl profile", project / "configs" / "train.yaml"),
    ]:
        done = subprocess.run([*command, override], cwd=project, capture_output=True, text=True)
        assert done.returncode == 2
        assert done.stderr == (
            f"error: {override}: configs/local/default.yaml sets {shadow} too, "
            f"which wins over {path}: change it there; nothing was written\n"
        )
        assert {p: p.read_text() for p in (project / "configs").rglob("*.yaml")} == configs
        assert not (project / "k8s").exists()
    done = subprocess.run(
        [*command, "deploy.rdzv_timeout_s=600"], cwd=project, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(deploy_file.read_text())["rdzv_timeout_s"] == 600


def test_rendering_needs_neither_torch_nor_this_machines_gpus(tmp_path, monkeypatch):
    """k8s/ is rendered on a laptop or in CI for a GPU cluster: no torch import, no GPU check."""
    out = tmp_path / "k8s"
    blocked = "import sys; sys.modules['torch'] = None"  # `import torch` raises from here on
    script = (
        f"{blocked}; from {PACKAGE}.k8s.__main__ import main; "
        f"sys.argv[1:] = ['--force', '--out', {str(out)!r}]; sys.exit(main())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (out / f"{deploy_defaults()['flavor']}.yaml").exists()
    import torch

    from ddp_project.config.compose import compose_and_check
    from ddp_project.config.error import ConfigError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert compose_and_check(["dist.backend=nccl"], this_node=False).dist.backend.value == "nccl"
    with pytest.raises(ConfigError, match="no CUDA device is visible"):
        compose_and_check(["dist.backend=nccl"])  # what train and the launcher check


def deploy_of(compose_train, *overrides: str) -> dict:
    # read and checked as python -m <package>.k8s reads them: a map's entries added with ++
    cfg = OmegaConf.to_object(compose_train(*hydra_overrides(list(overrides))))
    return OmegaConf.to_container(OmegaConf.structured(cfg.deploy), enum_to_str=True)


def objects(compose_train, *overrides: str) -> dict:
    deploy = deploy_of(compose_train, *overrides)
    return {file: yaml.safe_load(text) for file, text in render.manifests(deploy, {}).items()}


def test_requests_and_limits_scale_with_the_gpus(compose_train):
    deploy = deploy_of(
        compose_train,
        "deploy.gpus_per_node=3",
        "deploy.cpu_per_gpu=1500m",
        "deploy.memory_per_gpu=10Gi",
        "deploy.shm_size=1536Mi",
        "deploy.ephemeral_storage=20Gi",
    )
    assert pods.container_resources(deploy) == {
        "requests": {"cpu": "4500m", "memory": "32256Mi", "ephemeral-storage": "20Gi"},
        "limits": {"nvidia.com/gpu": 3, "memory": "32256Mi"},  # 3 x 10Gi + /dev/shm
    }
    assert pods.container_resources(deploy | {"cpu_per_gpu": 2})["requests"]["cpu"] == "6"


def pod_template(workload: dict, flavor: str) -> dict:
    """The pod template (metadata and spec) in `workload`, where each flavor holds it."""
    spec = workload["spec"]
    if flavor == "trainjob":
        (patch,) = spec["runtimePatches"]
        (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        return node["template"]["spec"]["template"]
    if flavor == "pytorchjob":
        return spec["pytorchReplicaSpecs"]["Worker"]["template"]
    if flavor == "jobset":
        spec = spec["replicatedJobs"][0]["template"]["spec"]
    return spec["template"]


def pod_and_workload(found: dict, flavor: str) -> tuple[dict, dict]:
    workload = found[f"{flavor}.yaml"]
    return pod_template(workload, flavor)["spec"], workload


@pytest.mark.parametrize("flavor", FLAVORS)
def test_make_k8s_apply_finds_each_flavors_pods_where_its_controller_reads_them(
    compose_train, flavor
):
    """cluster.pod_template (each flavor's entry says where): the pods it checks as a bare Pod and
    whose claims it reads are the ones this file finds, running the launch line."""
    several = ["deploy.nodes=2", "deploy.runs_access_mode=ReadWriteMany"]
    trainjob = ["deploy.rdzv_port=29500"] if flavor == "trainjob" else []
    workload = objects(compose_train, f"deploy.flavor={flavor}", *several, *trainjob)[
        f"{flavor}.yaml"
    ]
    template = cluster.pod_template(workload)
    assert template["metadata"] == pod_template(workload, flavor)["metadata"]
    (container,) = template["spec"]["containers"]
    launcher = trainer_container(flavor, workload)
    assert [container[key] for key in ("image", "command", "args", "env")] == [
        launcher[key] for key in ("image", "command", "args", "env")
    ]
    assert apply.claims_of(workload) == {f"{deploy_defaults()['name']}-runs-rwx"}
    assert len({f.kind for f in FLAVORS.values()}) == len(FLAVORS)  # apply finds the entry by kind


ZONE_AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {
                    "matchExpressions": [
                        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}
                    ]
                }
            ]
        }
    }
}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_label_and_selector_values_reach_the_manifest_as_written(compose_train, flavor, tmp_path):
    """YAML and Hydra type `true` and `2`; the GPU operator's label is `true`, not Python's 'True'.
    A quoted '1.10' stays text. Both on the command line and in a YAML file the user edits."""
    found = objects(
        compose_train,
        f"deploy.flavor={flavor}",
        "+deploy.node_selector={nvidia.com/gpu.present:true}",
        "deploy.pod_labels={version:'1.10',tier:2,spot:false}",
        "deploy.pod_annotations={rev:3}",
    )
    pod, workload = pod_and_workload(found, flavor)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    metadata = pod_template(workload, flavor)["metadata"]
    assert {k: metadata["labels"][k] for k in ("version", "tier", "spot")} == {
        "version": "1.10",
        "tier": "2",
        "spot": "false",
    }
    assert metadata["annotations"] == {"rev": "3"}
    configs = tmp_path / "configs"
    for group in ("deploy", "nccl"):
        shutil.copytree(ROOT / "configs" / group, configs / group)
    deploy = yaml.safe_load((configs / "deploy" / "default.yaml").read_text())
    deploy["node_selector"] = {"nvidia.com/gpu.present": True}
    (configs / "deploy" / "default.yaml").write_text(yaml.safe_dump(deploy))
    workload_file = f"{deploy['flavor']}.yaml"
    assert "nvidia.com/gpu.present: 'true'" in render.from_files(configs, "auto")[workload_file]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_env_and_secrets_reach_the_trainer_on_every_flavor_and_no_secret_value_is_written(
    compose_train, flavor
):
    """The W&B example: its project in the clear, its key from a Secret by name."""
    trainjob = ("deploy.rdzv_port=29500",) if flavor == "trainjob" else ()
    found = objects(
        compose_train,
        f"deploy.flavor={flavor}",
        *trainjob,
        "deploy.env={WANDB_PROJECT:vision,MLFLOW_TRACKING_URI:'http://mlflow:5000',"
        "WANDB_SILENT:true}",
        "deploy.secret_env={WANDB_API_KEY:wandb/api-key,MLFLOW_TRACKING_TOKEN:mlflow/token}",
    )
    env = trainer_container(flavor, found[f"{flavor}.yaml"])["env"]
    by_name = {e["name"]: e for e in env}
    assert by_name["WANDB_PROJECT"] == {"name": "WANDB_PROJECT", "value": "vision"}
    assert by_name["MLFLOW_TRACKING_URI"]["value"] == "http://mlflow:5000"
    assert by_name["WANDB_SILENT"]["value"] == "true"
    assert by_name["WANDB_API_KEY"] == {
        "name": "WANDB_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}},
    }
    assert by_name["MLFLOW_TRACKING_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "mlflow",
        "key": "token",
    }
    assert len(by_name) == len(env)  # no variable twice


@pytest.mark.parametrize("flavor", FLAVORS)
def test_scheduling_values_land_where_each_controller_reads_them(compose_train, flavor):
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    found = objects(
        compose_train,
        f"deploy.flavor={flavor}",
        "deploy.nodes=2",
        "deploy.runs_access_mode=ReadWriteMany",
        "deploy.queue=team-a",
        "deploy.tolerations=[{key:nvidia.com/gpu,operator:Exists,effect:NoSchedule}]",
        "+deploy.node_selector={nvidia.com/gpu.product:H100}",
        "deploy.active_deadline_s=3600",
        "deploy.affinity.nodeAffinity={requiredDuringSchedulingIgnoredDuringExecution: "
        "{nodeSelectorTerms: [{matchExpressions: "
        "[{key: topology.kubernetes.io/zone, operator: In, values: [a]}]}]}}",
        "deploy.one_pod_per_node=true",
        "deploy.image_pull_secrets=[ghcr-pull]",
        "deploy.guaranteed=true",
        "deploy.queue_priority=high",
        "deploy.topology=cloud.provider.com/topology-rack",
        *([] if flavor == "trainjob" else ["deploy.priority_class=training"]),
    )
    pod, workload = pod_and_workload(found, flavor)
    assert workload["metadata"]["labels"][meta.QUEUE_LABEL] == "team-a"
    assert workload["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    assert pod_template(workload, flavor)["metadata"]["annotations"] == {
        "kueue.x-k8s.io/podset-required-topology": "cloud.provider.com/topology-rack"
    }
    assert pod["tolerations"] == [*lost_node_tolerations(60), toleration]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H100"}
    name = workload["metadata"]["name"]
    assert pod["affinity"] == ZONE_AFFINITY | {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/name": name}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
    assert pod["imagePullSecrets"] == [{"name": "ghcr-pull"}]
    resources = (
        workload["spec"]["trainer"]["resourcesPerNode"]
        if flavor == "trainjob"
        else pod["containers"][0]["resources"]
    )
    assert {k: resources["limits"][k] for k in ("cpu", "memory")} == {
        k: resources["requests"][k] for k in ("cpu", "memory")
    }
    if flavor == "trainjob":  # no priorityClassName or token setting in Trainer's patches
        assert pod["serviceAccountName"] == workload["metadata"]["name"]
        assert found["serviceaccount.yaml"]["automountServiceAccountToken"] is False
        assert workload["spec"]["activeDeadlineSeconds"] == 3600
        return
    assert pod["priorityClassName"] == "training"
    assert pod["automountServiceAccountToken"] is False
    deadline = {
        "job": lambda w: w["spec"]["activeDeadlineSeconds"],
        "jobset": lambda w: w["spec"]["replicatedJobs"][0]["template"]["spec"][
            "activeDeadlineSeconds"
        ],
        "pytorchjob": lambda w: w["spec"]["runPolicy"]["activeDeadlineSeconds"],
    }[flavor]
    assert deadline(workload) == 3600


def test_no_scheduling_values_by_default(compose_train):
    pod, workload = pod_and_workload(objects(compose_train, "deploy.flavor=job"), "job")
    assert not {"nodeSelector", "priorityClassName", "affinity", "imagePullSecrets"} & pod.keys()
    assert pod["tolerations"] == lost_node_tolerations(60)  # configs/deploy/default.yaml's
    assert meta.QUEUE_LABEL not in workload["metadata"]["labels"]
    assert "annotations" not in workload["spec"]["template"]["metadata"]
    assert "cpu" not in pod["containers"][0]["resources"]["limits"]  # Burstable: no CPU throttling
    assert "activeDeadlineSeconds" not in workload["spec"]
    assert workload["spec"]["ttlSecondsAfterFinished"] == 604800


def lost_node_tolerations(seconds: int) -> list[dict]:
    """A pod's tolerations of the taints the node lifecycle controller puts on a node that stops
    answering (k8s.io/api/core/v1: TaintNodeUnreachable, TaintNodeNotReady), NoExecute."""
    return [
        {
            "key": f"node.kubernetes.io/{taint}",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": seconds,
        }
        for taint in ("unreachable", "not-ready")
    ]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_lost_node_evicts_every_flavors_pods_after_deploy_lost_node_s(compose_train, flavor):
    """deploy.lost_node_s reaches every flavor's pods (a TrainJob's through its runtime patch);
    null leaves them to the DefaultTolerationSeconds admission plugin, which adds 300 s only
    where a pod names neither taint (test_cluster reads what the server stores)."""
    several = (f"deploy.flavor={flavor}", "deploy.nodes=2", "deploy.runs_access_mode=ReadWriteMany")
    pod, _ = pod_and_workload(objects(compose_train, *several, "deploy.lost_node_s=15"), flavor)
    assert pod["tolerations"] == lost_node_tolerations(15)
    pod, _ = pod_and_workload(objects(compose_train, *several, "deploy.lost_node_s=null"), flavor)
    assert "tolerations" not in pod
    # First: the taint eviction controller takes the first toleration that matches a taint
    # (k8s.io/api/core/v1 helper GetMatchingTolerations), and a wildcard matches every taint.
    wildcard = (
        "deploy.tolerations=[{operator:Exists},"
        "{key:node.kubernetes.io/unreachable,operator:Exists,effect:NoSchedule}]",
    )
    pod, _ = pod_and_workload(
        objects(compose_train, *several, "deploy.lost_node_s=15", *wildcard), flavor
    )
    assert pod["tolerations"][:2] == lost_node_tolerations(15) and len(pod["tolerations"]) == 4


@pytest.mark.parametrize("flavor", FLAVORS)
def test_the_render_says_what_a_lost_node_needs_from_the_operator(compose_train, flavor):
    """A pod evicted from a node that stopped answering stays Terminating until PodGC fails it
    (pkg/controller/podgc: a node tainted out-of-service, or deleted): each flavor's note says
    so, and what its controller does meanwhile."""
    (note,) = [
        n
        for n in render.notes(deploy_of(compose_train, f"deploy.flavor={flavor}"))
        if "stopped answering" in n
    ]
    assert "\n" not in note and "evicted after deploy.lost_node_s=60 s" in note
    assert "node.kubernetes.io/out-of-service=nodeshutdown:NoExecute or delete its Node" in note
    expected = {
        "job": "podReplacementPolicy Failed",
        "jobset": "podReplacementPolicy Failed",
        "pytorchjob": "only once the old pod is gone",
        "trainjob": "podReplacementPolicy TerminatingOrFailed",
    }[flavor]
    assert expected in note
    null = render.notes(
        deploy_of(compose_train, f"deploy.flavor={flavor}", "deploy.lost_node_s=null")
    )
    assert any("after the cluster's 300 s (deploy.lost_node_s=null)" in n for n in null)


# The comment above each file of k8s/ beyond its first line and the shape (2 nodes of 2 GPUs), by
# flavor: what its controller needs and cannot set, what follows the logs, what a companion is.
FOLLOW = "#   make k8s-apply && kubectl logs -f -l app.kubernetes.io/name=demo"
HEADERS = {
    "job": {
        "job.yaml": ["#   make k8s-apply && kubectl logs -f job/demo"],
        "service.yaml": [
            "# The headless Service that names each pod of the Indexed Job: demo-<index>.demo"
        ],
    },
    "jobset": {"jobset.yaml": ["# Needs the JobSet controller (jobset.x-k8s.io).", FOLLOW]},
    "pytorchjob": {
        "pytorchjob.yaml": ["# Needs the Kubeflow training operator (kubeflow.org/v1).", FOLLOW]
    },
    "trainjob": {
        "trainjob.yaml": [
            "# Needs Kubeflow Trainer v2 (trainer.kubeflow.org) and its torch-distributed "
            "ClusterTrainingRuntime.",
            "# The runtime decides the retries and keeps finished jobs (deploy.backoff_limit and "
            "deploy.ttl_after_finished_s do not apply).",
            FOLLOW,
        ],
        "serviceaccount.yaml": [
            "# The pods' ServiceAccount, without an API token: a TrainJob cannot set "
            "automountServiceAccountToken on its pods."
        ],
    },
}


@pytest.mark.parametrize("flavor", FLAVORS)
def test_each_file_says_what_it_holds_and_what_its_controller_needs(compose_train, flavor):
    deploy = deploy_of(
        compose_train,
        f"deploy.flavor={flavor}",
        "deploy.name=demo",
        "deploy.nodes=2",
        "deploy.gpus_per_node=2",
        "deploy.runs_access_mode=ReadWriteMany",
        *(["deploy.rdzv_port=29500"] if flavor == "trainjob" else []),
    )
    generated = (
        f"# Generated by `python -m {PACKAGE}.k8s` from configs/ (deploy, nccl): "
        "edit those, regenerate."
    )
    shape = "# 2 pods, one per node, each with 2 GPUs and one torchrun; 4 processes in all."
    claim = "# Storage for run dirs (logs, metrics, checkpoints) that outlives any one pod."
    expected = {"runs-pvc.yaml": [claim]}
    expected |= {
        file: [shape, *lines] if file == f"{flavor}.yaml" else lines
        for file, lines in HEADERS[flavor].items()
    }
    found = {
        file: list(itertools.takewhile(lambda line: line.startswith("#"), text.splitlines()))
        for file, text in render.manifests(deploy, {}).items()
    }
    assert found == {file: [generated, *lines] for file, lines in sorted(expected.items())}


def test_the_claim_is_named_by_its_access_mode_and_kept_when_the_nodes_change(compose_train):
    """A claim's spec is immutable: another access mode is another claim, while deploy.nodes
    keeps the claim, and the checkpoints in it, from 1 node to 4 and back."""
    many = [
        objects(compose_train, "deploy.runs_access_mode=ReadWriteMany", f"deploy.nodes={n}")
        for n in (1, 4)
    ]
    assert many[0]["runs-pvc.yaml"] == many[1]["runs-pvc.yaml"]
    assert many[0]["runs-pvc.yaml"]["spec"]["accessModes"] == ["ReadWriteMany"]
    name = deploy_defaults()["name"]
    assert many[0]["runs-pvc.yaml"]["metadata"]["name"] == f"{name}-runs-rwx"
    one = objects(compose_train, "deploy.runs_access_mode=ReadWriteOnce", "deploy.nodes=1")
    assert one["runs-pvc.yaml"]["metadata"]["name"] == f"{name}-runs-rwo"
    assert "storageClassName" not in one["runs-pvc.yaml"]["spec"]  # the cluster's default


def test_the_runs_volume_comes_from_the_storage_class_or_the_claim_given(compose_train):
    found = objects(
        compose_train, "deploy.storage_class=cephfs", "deploy.runs_access_mode=ReadWriteMany"
    )
    assert found["runs-pvc.yaml"]["spec"]["storageClassName"] == "cephfs"
    for flavor in FLAVORS:
        found = objects(
            compose_train,
            f"deploy.flavor={flavor}",
            "deploy.nodes=2",
            "deploy.runs_claim=team-runs",
        )
        assert "runs-pvc.yaml" not in found  # the team's claim, applied and kept by them
        pod, _ = pod_and_workload(found, flavor)
        (runs,) = [volume for volume in pod["volumes"] if volume["name"] == "runs"]
        assert runs["persistentVolumeClaim"] == {"claimName": "team-runs"}
        # a large volume is not chowned file by file at every start
        assert pod["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"


def test_a_trainjob_sets_none_of_the_env_trainer_reserves(compose_train):
    """Trainer's webhook refuses a TrainJob whose trainer env holds PET_NNODES, PET_NPROC_PER_NODE,
    PET_NODE_RANK, PET_MASTER_ADDR or PET_MASTER_PORT (constants.TorchRunReservedEnvNames)."""
    trainer = objects(compose_train, "deploy.flavor=trainjob")["trainjob.yaml"]["spec"]["trainer"]
    assert not [e["name"] for e in trainer["env"] if e["name"].startswith("PET_")]
    assert trainer["numProcPerNode"] == trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]


@pytest.mark.parametrize("flavor", FLAVORS)
def test_the_rendezvous_timeout_reaches_each_flavors_torchrun(compose_train, flavor):
    """deploy.rdzv_timeout_s, at least 10 minutes by default, becomes torchrun's --rdzv-conf in
    each flavor's launch line; a PyTorchJob's operator passes elasticPolicy.rdzvConf to torchrun
    as PET_RDZV_CONF. tests/test_multinode.py shows that torchrun keeps to it."""
    seconds = deploy_defaults()["rdzv_timeout_s"]
    assert seconds >= 600
    pod, workload = pod_and_workload(
        objects(
            compose_train,
            f"deploy.flavor={flavor}",
            "deploy.nodes=2",
            "deploy.runs_access_mode=ReadWriteMany",
        ),
        flavor,
    )
    expected = f"join_timeout={seconds},read_timeout={seconds}"
    if flavor == "pytorchjob":
        conf = workload["spec"]["elasticPolicy"]["rdzvConf"]
        assert ",".join(f"{pair['key']}={pair['value']}" for pair in conf) == expected
        return
    args = (
        workload["spec"]["trainer"]["args"]
        if flavor == "trainjob"
        else pod["containers"][0]["args"]
    )
    assert args[args.index("--rdzv-conf") + 1] == expected


def test_a_queue_or_one_node_needs_no_admission_note(compose_train):
    """Without deploy.queue, pods that start hold their GPUs while one stays Pending: k8s says
    so for several nodes (tests/test_project_files.py), not for one, nor with a queue."""
    several = ("deploy.flavor=job", "deploy.nodes=2", "deploy.runs_access_mode=ReadWriteMany")
    assert render.admission_note(deploy_of(compose_train, *several)).startswith("note: 2 pods")
    assert (
        render.admission_note(deploy_of(compose_train, "deploy.flavor=job", "deploy.nodes=1"))
        is None
    )
    assert render.admission_note(deploy_of(compose_train, *several, "deploy.queue=team-a")) is None


@pytest.mark.parametrize("flavor", FLAVORS)
def test_a_queue_label_kueue_may_not_read_is_named(compose_train, flavor):
    """Kueue's default configuration leaves the PyTorchJob and TrainJob integrations for the
    platform to enable: without them the queue label does nothing, and the pods start at once."""
    opt_in = {
        "pytorchjob": "kubeflow.org/pytorchjob",
        "trainjob": "trainer.kubeflow.org/trainjob",
    }.get(flavor)
    trainjob = ("deploy.rdzv_port=29500",) if flavor == "trainjob" else ()
    queued = deploy_of(compose_train, f"deploy.flavor={flavor}", "deploy.queue=team-a", *trainjob)
    note = render.admission_note(queued)
    assert note == (
        None
        if opt_in is None
        else (
            f"note: deploy.queue=team-a: Kueue manages a {FLAVORS[flavor].kind} only where the "
            f"platform enabled its {opt_in} integration (Kueue's Configuration, "
            "integrations.frameworks); elsewhere the queue label does nothing and the pods "
            "start unadmitted"
        )
    )
    several = deploy_of(
        compose_train,
        f"deploy.flavor={flavor}",
        "deploy.nodes=2",
        "deploy.runs_access_mode=ReadWriteMany",
        *trainjob,
    )
    assert (opt_in is not None) == (f"its {opt_in} integration" in render.admission_note(several))


def test_apply_without_kubectl_or_manifests_is_one_line(tmp_path, monkeypatch, capsys):
    """make k8s-apply's last step, which the template's own tests run on an API server."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no kubectl here
    assert apply.main(tmp_path) == 1
    assert capsys.readouterr().err == "make k8s-apply: kubectl is not on PATH\n"
    (tmp_path / "kubectl").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "kubectl").chmod(0o755)
    assert apply.main(tmp_path / "k8s") == 1
    assert capsys.readouterr().err == (
        f"make k8s-apply: {tmp_path / 'k8s'}/ holds no manifests: "
        f"python -m {PACKAGE}.k8s writes them\n"
    )


# kubectl's errors (v1.32) when it reached no API server, and when one answered.
REFUSED_AT = (
    'error: error validating "STDIN": error validating data: failed to download openapi: Get '
    '"{server}/openapi/v2?timeout=32s": dial tcp {address}: connect: connection refused; if you '
    "choose to ignore these errors, turn validation off with --validate=false"
)
MEMCACHE = (
    'E1202 15:02:00.835153   20032 memcache.go:265] "Unhandled Error" err="couldn\'t get current '
    'server API group list: Get \\"{server}/api?timeout=32s\\": dial tcp {address}: connect: '
    'connection refused"\nThe connection to the server {address} was refused - did you specify '
    "the right host or port?"
)
NO_HOST = (
    'error: error validating "STDIN": error validating data: failed to download openapi: Get '
    '"https://gpu.example.invalid:6443/openapi/v2?timeout=32s": dial tcp: lookup '
    "gpu.example.invalid on 10.0.0.53:53: no such host; if you choose to ignore these errors, "
    "turn validation off with --validate=false"
)
POINT_IT = (
    "point kubectl at your cluster: KUBECONFIG=<its kubeconfig>, "
    "or kubectl config use-context <name>"
)
REACHED_NONE = [
    (
        REFUSED_AT.format(server="https://127.0.0.1:1", address="127.0.0.1:1"),
        "no API server reachable at https://127.0.0.1:1 (connection refused), the server of "
        f'kubectl\'s context "lab"; start it, or {POINT_IT}',
    ),
    (
        MEMCACHE.format(server="https://10.1.2.3:6443", address="10.1.2.3:6443"),
        "no API server reachable at https://10.1.2.3:6443 (connection refused), the server of "
        f'kubectl\'s context "lab"; start it, or {POINT_IT}',
    ),
    (
        NO_HOST,
        "no API server reachable at https://gpu.example.invalid:6443 (no such host), the server of "
        f'kubectl\'s context "lab"; start it, or {POINT_IT}',
    ),
    (
        "Unable to connect to the server: dial tcp 10.9.9.9:443: i/o timeout",
        "no API server reachable at 10.9.9.9:443 (i/o timeout), the server of kubectl's context "
        f'"lab"; start it, or {POINT_IT}',
    ),
    (
        "error: Error in configuration: context was not found for specified context: nope",
        f"kubectl's kubeconfig is unusable (Error in configuration: context was not found for "
        f"specified context: nope); {POINT_IT}",
    ),
]
ANSWERED = [
    'Error from server (NotFound): error when creating "STDIN": namespaces "team-b" not found',
    'Error from server (InternalError): error when creating "STDIN": Internal error occurred: '
    'failed calling webhook "validate.kueue.x-k8s.io": failed to call webhook: Post '
    '"https://kueue-webhook-service.kueue-system.svc:443/validate?timeout=10s": dial tcp '
    "10.96.4.2:443: connect: connection refused",  # the server answered: its webhook is down
    'The Job "ddp-project" is invalid: spec.parallelism: Invalid value: -1',
]


@pytest.mark.parametrize("said", [s for s, _ in REACHED_NONE] + ANSWERED)
def test_kubectl_reaching_no_server_is_told_from_a_server_refusing(said, monkeypatch):
    """make k8s-apply says "the server refuses k8s/" only when a server answered; kubectl's
    own failure to reach one names the server it tried and what to do."""
    monkeypatch.setattr(cluster, "current_context", lambda: "lab")
    expected = dict(REACHED_NONE).get(said)
    assert cluster.no_server_reached(said) == expected


@pytest.mark.parametrize("kubeconfig", [None, "missing"])
def test_kubectl_without_a_kubeconfig_is_told_so(kubeconfig, tmp_path, monkeypatch):
    """With no kubeconfig (none at all, or KUBECONFIG naming no file) kubectl tries
    localhost:8080 without a word: the line says that is why."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBECONFIG", raising=False)
    if kubeconfig:
        monkeypatch.setenv("KUBECONFIG", str(tmp_path / kubeconfig))
    said = REFUSED_AT.format(server="http://localhost:8080", address="127.0.0.1:8080")
    why = (
        f"KUBECONFIG={tmp_path / kubeconfig} names no file"
        if kubeconfig
        else ("KUBECONFIG is unset and ~/.kube/config does not exist")
    )
    assert cluster.no_server_reached(said) == (
        f"no API server: kubectl has no kubeconfig ({why}), so it tried localhost:8080 "
        f"(connection refused); {POINT_IT}"
    )
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_text("apiVersion: v1\n")
    (tmp_path / "missing").write_text("apiVersion: v1\n")  # a kubeconfig whose server is 8080
    monkeypatch.setattr(cluster, "current_context", lambda: None)
    assert cluster.no_server_reached(said) == (
        "no API server reachable at http://localhost:8080 (connection refused); "
        f"start it, or {POINT_IT}"
    )


def test_apply_with_no_server_reachable_says_so_in_one_line_and_changes_nothing(
    tmp_path, monkeypatch, capsys
):
    said = REFUSED_AT.format(server="https://127.0.0.1:1", address="127.0.0.1:1")
    kubectl = tmp_path / "kubectl"
    log = tmp_path / "calls"
    kubectl.write_text(
        f'#!/bin/sh\necho "$@" >> {log}\n[ "$1" = config ] && echo lab && exit 0\n'
        f"cat >/dev/null; echo '{said}' >&2; exit 1\n"
    )
    kubectl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    folder = tmp_path / "k8s"
    folder.mkdir()
    metadata = {"name": "p", "namespace": "ns", "labels": meta.labels("p")}
    (folder / "job.yaml").write_text(yaml.safe_dump({"kind": "Job", "metadata": metadata}))
    assert apply.main(folder) == 1
    assert capsys.readouterr().err == (
        "make k8s-apply: no API server reachable at https://127.0.0.1:1 (connection refused), the "
        f'server of kubectl\'s context "lab"; start it, or {POINT_IT}; nothing was changed\n'
    )
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["apply", "config"]

    def interrupted(*args, stdin=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cluster, "kubectl", interrupted)
    assert apply.main(folder) == 130
    assert capsys.readouterr().err == (
        "make k8s-apply: stopped by SIGINT during the server's dry run; nothing was changed\n"
    )


@pytest.mark.parametrize("flavor", FLAVORS)
def test_rdma_and_platform_settings_reach_each_flavors_pods(compose_train, flavor):
    """What InfiniBand pods need, set from the command line as maps and lists: the RDMA device
    plugin's resource (requested and limited, as extended resources must be), IPC_LOCK, and a
    Multus network annotation; with a label for cost tracking."""
    found = objects(
        compose_train,
        f"deploy.flavor={flavor}",
        "deploy.extra_resources={rdma/rdma_shared_device_a:1}",
        "deploy.capabilities=[IPC_LOCK]",
        "deploy.pod_annotations={k8s.v1.cni.cncf.io/networks:ib-net}",
        "deploy.pod_labels.team=vision",
    )
    pod, workload = pod_and_workload(found, flavor)
    resources = (
        workload["spec"]["trainer"]["resourcesPerNode"]
        if flavor == "trainjob"
        else pod["containers"][0]["resources"]
    )
    assert (
        resources["requests"]["rdma/rdma_shared_device_a"]
        == resources["limits"]["rdma/rdma_shared_device_a"]
        == 1
    )
    (container,) = pod["containers"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    metadata = pod_template(workload, flavor)["metadata"]
    assert metadata["annotations"] == {"k8s.v1.cni.cncf.io/networks": "ib-net"}
    assert metadata["labels"]["team"] == "vision" and metadata["labels"]["app.kubernetes.io/name"]
    deploy = deploy_of(compose_train, "deploy.capabilities=[IPC_LOCK,NET_BIND_SERVICE]")
    assert render.capabilities_note(deploy).startswith(
        "note: deploy.capabilities IPC_LOCK: a namespace"
    )
    assert (
        render.capabilities_note(deploy_of(compose_train, "deploy.capabilities=[NET_BIND_SERVICE]"))
        is None
    )


def test_gloo_variables_reach_the_pods_env_as_nccl_ones_do(compose_train):
    """The gloo backend (CPU runs, torch's CPU-side groups) picks its interface from
    GLOO_SOCKET_IFNAME: on a pod with several networks it is set beside NCCL_SOCKET_IFNAME."""
    deploy = deploy_of(compose_train)
    profile = OmegaConf.to_container(
        compose_train("nccl=socket", "+nccl.env.GLOO_SOCKET_IFNAME=eth1").nccl, enum_to_str=True
    )
    workload = yaml.safe_load(
        render.manifests(deploy, pods.nccl_env(profile))[f"{deploy['flavor']}.yaml"]
    )
    env = {e["name"]: e.get("value") for e in trainer_container(deploy["flavor"], workload)["env"]}
    assert env["GLOO_SOCKET_IFNAME"] == "eth1"


def test_a_write_that_fails_halfway_leaves_every_file_as_it_was(tmp_path, monkeypatch):
    """configs/ and k8s/ are replaced all together or not at all: a full disk on the second file
    leaves the first as it was too, and no staged file behind."""
    first, second = tmp_path / "default.yaml", tmp_path / "train.yaml"
    first.write_text("nodes: 1\n")
    second.write_text("defaults: []\n")
    stage = sync.stage

    def disk_full(path, text, *args, **kwargs):
        if path == second:
            raise OSError(28, "No space left on device")
        return stage(path, text, *args, **kwargs)

    monkeypatch.setattr(sync, "stage", disk_full)
    with pytest.raises(OSError, match="No space left on device"):
        sync.replace_all({first: "nodes: 2\n", second: "defaults: [x]\n"})
    assert (first.read_text(), second.read_text()) == ("nodes: 1\n", "defaults: []\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["default.yaml", "train.yaml"]


def test_ctrl_c_while_rendering_is_one_line(monkeypatch, capsys):
    from ddp_project.config import compose as check
    from ddp_project.k8s import __main__ as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(check, "compose_and_check", interrupted)
    monkeypatch.setattr(sys, "argv", ["k8s", "--check"])
    assert cli.run() == 130
    assert capsys.readouterr().err == (
        f"python -m {PACKAGE}.k8s: stopped by SIGINT; python -m {PACKAGE}.k8s --check says "
        "whether k8s/ matches configs/\n"
    )


def test_apply_stopped_after_the_dry_run_says_that_k8s_is_not_applied(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C, or a kubectl call that fails, once the old job may be gone: one line, what to do."""
    (tmp_path / "kubectl").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    folder = tmp_path / "k8s"
    folder.mkdir()
    metadata = {"name": "p", "namespace": "ns", "labels": meta.labels("p")}
    (folder / "job.yaml").write_text(yaml.safe_dump({"kind": "Job", "metadata": metadata}))
    calls = []

    def interrupted(*args, stdin=None):
        calls.append(args[0])
        if args[0] == "api-resources":
            raise KeyboardInterrupt
        return ""

    monkeypatch.setattr(cluster, "kubectl", interrupted)
    assert apply.main(folder) == 130
    assert calls == ["apply", "api-resources"]  # the server's dry run came first
    assert capsys.readouterr().err == "make k8s-apply: stopped by SIGINT; nothing was changed\n"

    def refusing(*args, stdin=None):
        if args[0] == "apply" and "--dry-run=server" not in args:
            raise cluster.Refused("kubectl apply: Unauthorized")
        return ""

    monkeypatch.setattr(cluster, "kubectl", refusing)
    assert apply.main(folder) == 1
    assert capsys.readouterr().err == (
        f"make k8s-apply: kubectl apply: Unauthorized; {folder}/ may be partly applied: "
        "run make k8s-apply again\n"
    )


def test_every_exit_code_is_in_the_readme_and_a_job_fails_at_once_on_exactly_the_fatal_ones(
    compose_train,
):
    """exits.Exit is the one table of codes: docs/exit-codes.md's rows and the Job's
    podFailurePolicy are read against it, each code run through the policy as the Job controller
    runs it."""
    from test_multinode import pod_failure_verdict

    readme = (Path(__file__).resolve().parents[1] / "docs" / "exit-codes.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \| ([^|]+) \| ([^|]+) \|$", readme, re.MULTILINE)
    assert [(int(code), name, meaning.strip()) for code, name, meaning, _ in rows] == [
        (int(code), code.name, code.meaning) for code in Exit
    ]
    for flavor in ("job", "jobset"):
        manifest = objects(compose_train, f"deploy.flavor={flavor}")[f"{flavor}.yaml"]
        job = manifest if flavor == "job" else manifest["spec"]["replicatedJobs"][0]["template"]
        for (code, _, _, action), member in zip(rows, Exit, strict=True):
            verdict = pod_failure_verdict(job, int(code), disrupted=False)
            assert verdict == ("FailJob" if member.fails_job else "Count"), (flavor, member)
            assert (verdict == "FailJob") == action.strip().startswith("fails at once")
        assert pod_failure_verdict(job, Exit.PREEMPTED, disrupted=True) == "Ignore"

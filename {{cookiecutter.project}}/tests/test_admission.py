"""Admission rules of the controllers whose webhooks the test API server (../shared/k8s) cannot
run, encoded from their source, and every flavor x node count checked against them: the
renderer refuses in one line what a controller's webhook would refuse on CREATE.

The rules read the rendered manifest, not the renderer's own tables, so that a wrong table
fails here rather than on a cluster."""

import re

import pytest
import yaml
from conftest import deploy_defaults

from ddp_project.k8s import render
from ddp_project.k8s.checks import deploy_errors
from ddp_project.k8s.flavors import FLAVORS

# k8s.io/apimachinery/pkg/util/validation/validation.go
DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
HTTP_PATH = re.compile(r"[A-Za-z0-9/\-._~%!$&'()*+,;=:]+")
LONGEST_NAME = "a" * 47  # deploy.name's most


def dns1035_label(value: str) -> bool:
    return len(value) <= 63 and DNS1035_LABEL.fullmatch(value) is not None


def domain_prefixed_path(value: str) -> bool:
    """IsDomainPrefixedPath: <DNS-1123 subdomain>/<a URL path>, as in acme.io/foo."""
    domain, slash, path = value.partition("/")
    return (
        bool(slash and domain and path)
        and len(domain) <= 253
        and DNS1123_SUBDOMAIN.fullmatch(domain) is not None
        and HTTP_PATH.fullmatch(path) is not None
    )


def test_the_rule_itself_refuses_what_trainer_refused():
    assert domain_prefixed_path("acme.io/manager")  # Trainer's own test's value
    assert domain_prefixed_path("kueue.x-k8s.io/manager")
    assert not domain_prefixed_path("my_run.k8s")  # what the TrainJob said before: refused
    assert not domain_prefixed_path("acme.io/") and not domain_prefixed_path("Acme.io/x")


def longest_pod_names(workload: dict) -> list[str]:
    """The longest pod name each controller would make for `workload`, from its own rule:
    batch/v1 Job: <job>-<index>-<5 random> (indexed) or <job>-<5 random>; JobSet v0.12 webhook
    (pkg/webhooks/jobset_webhook.go): <jobset>-<replicated job>-<job index>-<pod index>-abcde;
    Trainer v2.3: a JobSet of the TrainJob's name with the runtime's replicated Job "node";
    training-operator v1.9 (pkg/common/util GenGeneralName): <job>-worker-<index>."""
    name, spec = workload["metadata"]["name"], workload["spec"]
    if workload["kind"] == "Job":
        completions = spec.get("completions", 1)
        return [f"{name}-{completions - 1}-abcde" if completions > 1 else f"{name}-abcde"]
    if workload["kind"] == "JobSet":
        return [
            f"{name}-{r['name']}-{r['replicas'] - 1}-"
            f"{r['template']['spec'].get('completions', 1) - 1}-abcde"
            for r in spec["replicatedJobs"]
        ]
    if workload["kind"] == "TrainJob":
        return [f"{name}-node-0-{spec['trainer']['numNodes'] - 1}-abcde"]
    replicas = spec["pytorchReplicaSpecs"]["Worker"]["replicas"]
    return [f"{name}-worker-{replicas - 1}"]


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("nodes", [1, 2, 10, 11, 100, 101, 1001, 100_000])
def test_every_flavor_and_node_count_renders_pods_their_controller_admits_or_one_line(
    flavor, nodes
):
    deploy = deploy_defaults() | {
        "name": LONGEST_NAME,
        "flavor": flavor,
        "nodes": nodes,
        "runs_access_mode": "ReadWriteMany",
    }
    if flavor == "trainjob":
        deploy |= {"rdzv_port": 29500, "image_pull_policy": "IfNotPresent", "priority_class": None}
    errors = deploy_errors(deploy)
    if errors:
        (error,) = errors
        assert error.startswith(
            f"deploy.name={LONGEST_NAME}: a {FLAVORS[flavor].kind} of {nodes} nodes names a pod "
        )
        shorter = int(error.rsplit("at most ", 1)[1].split()[0])
        assert shorter < len(LONGEST_NAME)
        deploy["name"] = LONGEST_NAME[:shorter]  # the length the line offers is admitted
        assert deploy_errors(deploy) == []
    workload = yaml.safe_load(render.manifests(deploy, {})[f"{flavor}.yaml"])
    for pod_name in longest_pod_names(workload):
        assert dns1035_label(pod_name), pod_name
    if flavor == "trainjob":
        (patch,) = workload["spec"]["runtimePatches"]
        assert domain_prefixed_path(patch["manager"]), patch["manager"]
    # only JobSets (and a TrainJob's) reach the limit, past 100 nodes
    assert bool(errors) == (flavor in ("jobset", "trainjob") and nodes > 100)

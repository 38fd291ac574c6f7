"""`make k8s-doctor`: the doctor on the nodes training will get, before a long run is queued.

    python -m {{ cookiecutter.package }}.k8s.doctor                  # apply, wait, print pod 0's table; exit: its verdict
    python -m {{ cookiecutter.package }}.k8s.doctor --print          # the manifests only (kubectl apply -f - them yourself)
    python -m {{ cookiecutter.package }}.k8s.doctor nccl=socket      # Hydra overrides for this run only: configs/ is not written

Its pods are the training pods (pods.py: image, resources, env with the NCCL profile,
nodeSelector, tolerations, affinity, deploy.nodes of them); only the command and args differ, and
the runs claim is left out (the doctor writes nothing, runs before the first make k8s-apply, and
a ReadWriteOnce claim held by a running job would keep it Pending). They run as the Indexed Job
<name>-doctor, with a headless Service of that name for several nodes, labelled
app.kubernetes.io/component=doctor: make k8s-apply lists and deletes only component=training, and
this deletes only the doctor's Job.

Exit status: pod 0's, the doctor's verdict
(python -m {{ cookiecutter.package }}.doctor --help): 0 training's profile works across the
nodes, 1 it does not (pod 0's table names the profile that does) or the doctor did not finish;
2 a bad config or argument; 130 Ctrl-C (the Job keeps running to its end).
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .. import PACKAGE
from ..core.cli import WEEK_S, Parser, seconds_up_to
from ..core.exits import Exit
from .cluster import Refused, TimedOut, Unreachable, kubectl, server_check
from .meta import DOCTOR, NAME_LABEL, identity, manifest
from .pods import Launch, nccl_env, pod_metadata, pod_spec, torchrun_launch, trainer_container
from .render import Dumper, deploy_and_profile
from .sync import project_root

PROFILE_TIMEOUT_S = 90  # the doctor's own default: past it a profile "hangs"
PROFILES_ACROSS_NODES = (
    5  # doctor.NODES_PROFILES: auto, nccl_default, pcie_safe, socket, infiniband
)
# Scheduling and an image pull, within the Job's deadline: a doctor that never started says so.
START_SLACK_S = 600
# How long a finished doctor's pods and logs are kept, for kubectl logs; the next make k8s-doctor
# replaces them.
KEPT_S = 3600
POLL_S = 5
SAY_EVERY_S = 30
# Node 0's doctor is at localhost to itself (it may not resolve its own DNS name yet), at
# RDZV_HOST to the others; the completion index is the node rank. Static rendezvous (the doctor's
# torchruns): every profile needs every node, so nothing elastic is wanted.
NODES_LAUNCH = (
    'case "$JOB_COMPLETION_INDEX" in 0) host=localhost ;; *) host="$RDZV_HOST" ;; esac; '
    f'exec python -m {PACKAGE}.doctor --node-rank "$JOB_COMPLETION_INDEX" --master-addr "$host" '
    '--master-port "$RDZV_PORT" "$@"'
)


def doctor_name(deploy: Mapping[str, Any]) -> str:
    return f"{deploy['name']}-doctor"


def deadline_s(deploy: Mapping[str, Any]) -> int:
    """The Job's activeDeadlineSeconds: the nodes' wait for each other, each profile's time
    (plus its torchrun's start), and START_SLACK_S."""
    return (
        deploy["rdzv_timeout_s"] + PROFILES_ACROSS_NODES * (PROFILE_TIMEOUT_S + 60) + START_SLACK_S
    )


def doctor_launch(deploy: Mapping[str, Any], profile: str, training_vars: list[str]) -> Launch:
    """The doctor's command and args; the env is the training launch's own (completion index,
    pod IP, rendezvous host and port), so that only the command and args differ."""
    name, nodes = doctor_name(deploy), deploy["nodes"]
    env = torchrun_launch(deploy, rendezvous_host=f"{name}-0.{name}").env
    args = [
        "--nnodes",
        str(nodes),
        "--nproc",
        str(deploy["gpus_per_node"]),
        "--timeout-s",
        str(PROFILE_TIMEOUT_S),
        "--join-timeout-s",
        str(deploy["rdzv_timeout_s"]),
        "--training-profile",
        profile,
        "--training-vars",
        *training_vars,
    ]
    if nodes == 1:
        where = ["--master-addr", "localhost", "--master-port", str(deploy["rdzv_port"])]
        return Launch(["python", "-m", f"{PACKAGE}.doctor"], [*where, *args], env)
    return Launch(["/bin/sh", "-c", NODES_LAUNCH, "doctor"], args, env)


def doctor_job(deploy: Mapping[str, Any], env: Mapping[str, str], profile: str) -> dict:
    """Always a batch/v1 Job, whatever deploy.flavor: it runs on every cluster without an
    operator, the doctor needs none of a controller's restarts or rendezvous, and its pods are
    the flavor's pods all the same (every flavor builds them with pods.pod_spec)."""
    name, nodes = doctor_name(deploy), deploy["nodes"]
    container = trainer_container(deploy, env, doctor_launch(deploy, profile, sorted(env)))
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "runs"]
    pod = pod_spec(deploy, container)
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "runs"]
    spec: dict[str, Any] = {
        "backoffLimit": 0,  # a verdict, not a run: a retry would only hide a failure
        "activeDeadlineSeconds": deadline_s(deploy),
        "ttlSecondsAfterFinished": KEPT_S,
    }
    if nodes > 1:
        spec |= {"completionMode": "Indexed", "completions": nodes, "parallelism": nodes}
        pod["subdomain"] = name  # pods are <name>-<index>.<name>: the headless Service
    spec["template"] = {"metadata": pod_metadata(deploy, DOCTOR), "spec": pod}
    return manifest(
        "batch/v1", "Job", deploy, spec, suffix="-doctor", queued=True, component=DOCTOR
    )


def doctor_service(deploy: Mapping[str, Any]) -> dict:
    """The headless Service that names the doctor's pods <name>-doctor-<index>.<name>-doctor."""
    spec = {
        "clusterIP": "None",
        "publishNotReadyAddresses": True,  # the names resolve before any pod is ready
        "selector": {"job-name": doctor_name(deploy)},
        "ports": [{"name": "doctor", "port": deploy["rdzv_port"]}],
    }
    return manifest("v1", "Service", deploy, spec, suffix="-doctor", component=DOCTOR)


def objects(deploy: Mapping[str, Any], profile: Mapping[str, Any]) -> list[dict]:
    """The doctor's objects from the same deploy group and NCCL profile as k8s/."""
    job = doctor_job(deploy, nccl_env(profile), str(profile["profile"]))
    return [job, doctor_service(deploy)] if deploy["nodes"] > 1 else [job]


def as_yaml(found: list[dict]) -> str:
    return "---\n".join(yaml.dump(o, Dumper=Dumper, sort_keys=False, width=100) for o in found)


def pods_of(namespace: str, name: str) -> list[dict]:
    listed = kubectl("get", "pods", "-n", namespace, "-l", f"job-name={name}", "-o", "json")
    return json.loads(listed)["items"] if listed.strip() else []


def finished(namespace: str, name: str) -> str | None:
    """Complete or Failed (with the Job's reason), once the Job has ended; else None."""
    job = json.loads(kubectl("get", "job", name, "-n", namespace, "-o", "json"))
    for condition in job.get("status", {}).get("conditions") or []:
        if condition["type"] in ("Complete", "Failed") and condition["status"] == "True":
            return condition["type"] + (
                f" ({condition['reason']})" if condition.get("reason") else ""
            )
    return None


def phases(pods: list[dict]) -> str:
    counts: dict[str, int] = {}
    for pod in pods:
        counts[pod["status"].get("phase", "Unknown")] = (
            counts.get(pod["status"].get("phase", "Unknown"), 0) + 1
        )
    return ", ".join(f"{phase} {n}" for phase, n in sorted(counts.items())) or "none made yet"


def pod_zero(pods: list[dict]) -> dict | None:
    index = "batch.kubernetes.io/job-completion-index"
    for pod in pods:
        if (pod["metadata"].get("annotations") or {}).get(index, "0") == "0":
            return pod
    return None


def exit_code(pod: dict) -> int | None:
    for status in pod["status"].get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated")
        if terminated is not None:
            return int(terminated["exitCode"])
    return None


def run(found: list[dict], wait_s: float) -> int:
    """Apply the doctor's objects (after the server's dry run), wait for its Job, print pod 0's
    log; the doctor's exit code."""
    job = found[0]
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    project = job["metadata"]["labels"][NAME_LABEL]
    server_check([(f"{o['kind'].lower()}/{o['metadata']['name']}", o) for o in found])
    # Only the doctor's Job: its pod template cannot change in place; the training's
    # are never listed.
    selector = ",".join(f"{k}={v}" for k, v in identity(project, DOCTOR).items())
    kubectl(
        "delete",
        "jobs.batch",
        "-n",
        namespace,
        "-l",
        selector,
        "--cascade=foreground",
        "--wait",
        "--ignore-not-found",
        "--timeout=120s",
    )
    print(kubectl("apply", "-f", "-", stdin=as_yaml(found)), end="")
    print(
        f"waiting for job/{name} to end (at most {wait_s:g} s; its pods' log follows)...",
        flush=True,
    )
    started = time.monotonic()
    said = started
    while (ended := finished(namespace, name)) is None:
        waited = time.monotonic() - started
        if waited > wait_s:
            raise Refused(
                f"job/{name} has not finished after {wait_s:g} s (pods: "
                f"{phases(pods_of(namespace, name))}); it keeps running until its "
                f"activeDeadlineSeconds: kubectl describe -n {namespace} job/{name} says why"
            )
        if time.monotonic() - said >= SAY_EVERY_S:
            print(
                f"waiting for job/{name}: {waited:.0f} s, pods: {phases(pods_of(namespace, name))}",
                flush=True,
            )
            said = time.monotonic()
        time.sleep(POLL_S)
    first = pod_zero(pods_of(namespace, name))
    code = exit_code(first) if first else None
    if first is not None:
        print(kubectl("logs", "-n", namespace, f"pod/{first['metadata']['name']}"), end="")
    if code is None:
        raise Refused(
            f"job/{name} ended {ended} before pod 0's doctor gave a verdict: "
            f"kubectl describe -n {namespace} job/{name} says why; do not start training"
        )
    return code


def main() -> int:
    from ..config import compose as check

    parser = Parser(
        prog=f"python -m {PACKAGE}.k8s.doctor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--print", action="store_true", help="print the manifests; apply nothing")
    parser.add_argument(
        "--wait-s",
        type=seconds_up_to(WEEK_S, "a week"),
        help="how long to wait for the doctor (default: its Job's deadline and a minute)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, for this run only")
    args = parser.parse_args()

    def fail(line: str, code: int = Exit.FAILED) -> int:
        print(f"make k8s-doctor: {line}", file=sys.stderr)
        return code

    source = project_root(Path.cwd()) / "configs"
    folder = source if (source / "train.yaml").is_file() else None
    try:
        cfg = check.compose_and_check(args.overrides, folder, this_node=False)
    except check.CONFIG_ERRORS as err:
        return check.refused(err)
    deploy, profile = deploy_and_profile(cfg)
    found = objects(deploy, profile)
    if args.print:
        print(as_yaml(found), end="")
        return Exit.OK
    if shutil.which("kubectl") is None:
        return fail(
            f"kubectl is not on PATH; python -m {PACKAGE}.k8s.doctor --print writes the manifests"
        )
    job = f"job/{doctor_name(deploy)}"
    try:
        return run(found, args.wait_s or deadline_s(deploy) + 60)
    except Unreachable as unreachable:
        return fail(f"{unreachable}; nothing was changed")
    except (Refused, TimedOut) as refused:
        return fail(f"{refused}")
    except KeyboardInterrupt:
        return fail(
            f"stopped by SIGINT; {job} may be running: kubectl delete -n {deploy['namespace']} "
            f"{job} stops it",
            Exit.INTERRUPTED,
        )


if __name__ == "__main__":
    sys.exit(main())

"""`make k8s-apply`: k8s/ onto the cluster, never leaving the user with nothing running.

After `python -m {{ cookiecutter.package }}.k8s --check`, as make k8s-apply runs it:

    python -m {{ cookiecutter.package }}.k8s.apply

1. The API server checks every object of k8s/ first (a server-side dry run of kubectl apply, as
   the real step sends it): the job under another name of the same length, since a job's pods
   cannot change in place and the running one is replaced, not updated; and one of its pods as
   a bare Pod, which PodSecurity judges (it only warns on a Job, and reads no JobSet, PyTorchJob
   or TrainJob). Until the server accepts the replacement, nothing is deleted. A workload the
   cluster runs exactly as k8s/ holds it (kubectl apply's last-applied record) keeps running.
2. This project's jobs, of any flavor, are deleted (their pods get their grace period to
   checkpoint), and so are its Services and ServiceAccounts that k8s/ no longer holds: a JobSet
   takes over a Service of its name, and a stale one would select the old Job's pods. Claims are
   never deleted: they hold the runs.
3. k8s/ is applied.

What belongs to the project is what carries both its labels, app.kubernetes.io/name=<deploy.name>
and app.kubernetes.io/component=training; k8s/ must hold only what the renderer writes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from .. import PACKAGE, PROJECT
from ..core.exits import Exit
from . import cluster
from .cluster import WORKLOADS, Refused, TimedOut, Unreachable, pod_template, server_check
from .meta import COMPONENT_LABEL, NAME_LABEL, PART_OF_LABEL, TRAINING, identity

REPLACED_IF_STALE = {"Service": "services", "ServiceAccount": "serviceaccounts"}
DURING_DRY_RUN = "during the server's dry run; "
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"  # what kubectl apply last sent


# A workload's pods get their grace period to checkpoint, then this long to be gone.
DELETE_SLACK_S = 60


class Foreign(Exception):
    """k8s/ holds files the renderer did not write; the message names them."""


def load(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) of each manifest kubectl apply -f would read; Foreign names every file
    that is not one object of one project in one namespace, as the renderer writes them."""
    found, odd = [], []
    for path in sorted(p for p in folder.iterdir() if p.suffix in {".yaml", ".yml", ".json"}):
        try:
            documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as error:
            odd.append(f"{path.name} (not YAML: {str(error).splitlines()[0]})")
            continue
        if len(documents) != 1:
            odd.append(f"{path.name} ({len(documents) or 'no'} objects, not one)")
            continue
        (manifest,) = documents
        metadata = manifest.get("metadata") if isinstance(manifest, dict) else None
        if not isinstance(metadata, dict) or not isinstance(metadata.get("labels"), dict):
            odd.append(f"{path.name} (no metadata.labels)")
            continue
        found.append((path.name, manifest))
    workloads = [m for _, m in found if m.get("kind") in WORKLOADS]
    if len(workloads) == 1:
        name = workloads[0]["metadata"]["labels"].get(NAME_LABEL)
        namespace = workloads[0]["metadata"].get("namespace")
        for file, manifest in found:
            metadata = manifest["metadata"]
            if not identity(str(name)).items() <= metadata["labels"].items():
                odd.append(f"{file} (not labelled {NAME_LABEL}={name},{COMPONENT_LABEL}=training)")
            elif metadata.get("namespace") != namespace:
                odd.append(f"{file} (namespace {metadata.get('namespace')}, not {namespace})")
    elif found:
        kinds = ", ".join(
            f"{file} ({m.get('kind')})" for file, m in found if m.get("kind") in WORKLOADS
        )
        odd.append(
            f"{len(workloads)} workloads, not one: {kinds or 'none of ' + ', '.join(WORKLOADS)}"
        )
    if odd:
        raise Foreign("; ".join(odd))
    return found


def claims_of(workload: dict[str, Any]) -> set[str]:
    template = pod_template(workload)
    volumes = (template["spec"].get("volumes") or []) if template else []
    return {
        v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v
    }


def on_cluster(namespace: str, known: set[str]) -> list[dict[str, Any]]:
    """The objects of the kinds this project renders that carry its component label, any name."""
    found = []
    for resource in [*WORKLOADS.values(), *REPLACED_IF_STALE.values()]:
        if resource not in known:
            continue  # a CRD this cluster does not have: nothing of that kind to delete
        listed = cluster.kubectl(
            "get", resource, "-n", namespace, "-l", f"{COMPONENT_LABEL}=training", "-o", "json"
        )
        found += (json.loads(listed) if listed.strip() else {}).get("items", [])
    return found


def earlier_jobs(workload: dict[str, Any], known: set[str]) -> tuple[list[dict[str, Any]], bool]:
    """This project's training workloads under another deploy.name or deploy.namespace: a new job
    replaces none of them, and each keeps running with its GPUs. Looked for in every namespace
    where the user may list them, else in the job's own; True when every namespace was seen."""
    name, namespace = workload["metadata"]["name"], workload["metadata"]["namespace"]
    wanted = {PART_OF_LABEL: PROJECT, COMPONENT_LABEL: TRAINING}
    selector = ",".join(f"{key}={value}" for key, value in wanted.items())
    found, everywhere = [], True
    for resource in WORKLOADS.values():
        if resource not in known:
            continue
        try:
            listed = cluster.kubectl("get", resource, "-A", "-l", selector, "-o", "json")
        except Unreachable:
            raise
        except Refused:  # not allowed to list every namespace (RBAC): the job's own
            everywhere = False
            listed = cluster.kubectl("get", resource, "-n", namespace, "-l", selector, "-o", "json")
        found += (json.loads(listed) if listed.strip() else {}).get("items", [])
    return [
        item
        for item in found
        if wanted.items() <= (item["metadata"].get("labels") or {}).items()
        and (item["metadata"]["namespace"], item["metadata"]["name"]) != (namespace, name)
        and "deletionTimestamp" not in item["metadata"]
    ], everywhere


def to_delete(objects: list[dict[str, Any]], there: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The project's objects on the cluster that the apply replaces or leaves stale: those that
    carry all its labels (a user's <name>-eval Job with the name label alone is not its)."""
    (workload,) = [m for m in objects if m["kind"] in WORKLOADS]
    mine = identity(workload["metadata"]["labels"][NAME_LABEL]).items()
    rendered = {(m["kind"], m["metadata"]["name"]) for m in objects}
    return [
        item
        for item in there
        if mine <= (item["metadata"].get("labels") or {}).items()
        and (item["kind"] in WORKLOADS or (item["kind"], item["metadata"]["name"]) not in rendered)
    ]


def unchanged(workload: dict[str, Any], there: list[dict[str, Any]]) -> bool:
    """Whether the cluster runs exactly this workload: kubectl apply's record of
    what it last sent."""
    for item in there:
        metadata = item["metadata"]
        if (item["kind"], metadata["name"]) == (workload["kind"], workload["metadata"]["name"]):
            sent = (metadata.get("annotations") or {}).get(LAST_APPLIED)
            if sent is None or "deletionTimestamp" in metadata:
                return False
            try:
                return as_sent(json.loads(sent)) == as_sent(json.loads(json.dumps(workload)))
            except ValueError:
                return False
    return False


def as_sent(manifest: dict[str, Any]) -> dict[str, Any]:
    """kubectl apply records the object with an empty metadata.annotations where it had none."""
    metadata = {
        k: v for k, v in manifest.get("metadata", {}).items() if not (k == "annotations" and not v)
    }
    return manifest | {"metadata": metadata}


def notes(
    workload: dict[str, Any],
    there: list[dict[str, Any]],
    earlier: list[dict[str, Any]] = (),
    everywhere: bool = False,
) -> list[str]:
    """What a user must know about the runs: a new claim starts empty, and a job under another
    name or in another namespace keeps running (`earlier`, everywhere the user may look)."""
    name, namespace = workload["metadata"]["name"], workload["metadata"]["namespace"]
    claims = claims_of(workload)
    said = []
    old = [
        i
        for i in there
        if i["kind"] in WORKLOADS and i["metadata"].get("labels", {}).get(NAME_LABEL) == name
    ]
    before = set().union(*(claims_of(i) for i in old)) - claims if old else set()
    for claim in sorted(before):
        (new,) = sorted(claims) or ["none"]
        said.append(
            f"note: the runs claim changes from {claim} to {new}: the new run starts from step 0 "
            f"on the empty {new}; {claim} is kept with the old checkpoints: copy them over with a "
            f"pod that mounts both, or set deploy.runs_claim={claim} if its access mode suits"
        )
    for job in earlier:
        kind, other, where = job["kind"], job["metadata"]["name"], job["metadata"]["namespace"]
        runs = ", ".join(sorted(claims_of(job))) or "no claim"
        said.append(
            f"note: {kind}/{other} in {where} is this project's training job too, under an earlier "
            "deploy.name or deploy.namespace, and keeps running with its GPUs "
            f"(its checkpoints: {runs}): kubectl delete -n {where} {kind.lower()}/{other} stops it"
        )
    mentioned = {(j["metadata"]["namespace"], j["metadata"]["name"]) for j in earlier}
    others = [
        i
        for i in there
        if i["kind"] in WORKLOADS
        and i not in old
        and claims_of(i) & claims
        and (i["metadata"]["namespace"], i["metadata"]["name"]) not in mentioned
    ]
    for other in others:
        said.append(
            f"note: {other['kind']}/{other['metadata']['name']} in {namespace} mounts "
            f"{', '.join(sorted(claims_of(other) & claims))} too and keeps running (an earlier "
            f"deploy.name?): kubectl delete -n {namespace} "
            f"{other['kind'].lower()}/{other['metadata']['name']} stops it"
        )
    if not old and not others and not earlier and not everywhere:
        said.append(
            f"note: nothing of {name} ran in {namespace}, and other namespaces could not be "
            "listed; a job of an earlier deploy.namespace keeps running: "
            f"kubectl get {','.join(WORKLOADS.values())} -A "
            f"-l {PART_OF_LABEL}={PROJECT},{COMPONENT_LABEL}={TRAINING} lists them"
        )
    return said


def grace_s(item: dict[str, Any]) -> int:
    if item["kind"] not in WORKLOADS:
        return 0
    try:
        return int((pod_template(item) or {})["spec"].get("terminationGracePeriodSeconds", 30))
    except (KeyError, TypeError, ValueError):
        return 30


def main(folder: Path = Path("k8s")) -> int:
    def fail(line: str, code: int = Exit.FAILED) -> int:
        print(f"make k8s-apply: {line}", file=sys.stderr)
        return code

    if shutil.which("kubectl") is None:
        return fail("kubectl is not on PATH")
    state = "nothing was changed"
    try:
        try:
            files = load(folder) if folder.is_dir() else []
        except Foreign as foreign:
            return fail(
                f"{folder}/ holds what python -m {PACKAGE}.k8s does not write: {foreign}; "
                "move those files out of it (kubectl apply -f them yourself); nothing was changed"
            )
        if not files:
            return fail(f"{folder}/ holds no manifests: python -m {PACKAGE}.k8s writes them")
        objects = [manifest for _, manifest in files]
        (workload,) = [m for m in objects if m["kind"] in WORKLOADS]
        namespace = workload["metadata"]["namespace"]
        state = DURING_DRY_RUN + "nothing was changed"
        try:
            server_check(files)
        except Unreachable as unreachable:
            return fail(f"{unreachable}; nothing was changed")
        except Refused as refused:
            return fail(f"the server refuses k8s/, so the running job is left as it is: {refused}")
        state = "nothing was changed"
        try:
            known = set(cluster.kubectl("api-resources", "-o", "name").split())
            there = on_cluster(namespace, known)
            earlier, everywhere = earlier_jobs(workload, known)
        except Refused as refused:
            return fail(f"{refused}; nothing was changed")
        kind_and_name = f"{workload['kind'].lower()}/{workload['metadata']['name']}"
        if unchanged(workload, there):
            state = (
                f"{folder}/ may be partly applied ({kind_and_name} keeps running): "
                "run make k8s-apply again"
            )
            # The other objects, in place; the workload is as sent.
            cluster.kubectl("apply", "-f", f"{folder}/")
            print(f"k8s/ is unchanged: {kind_and_name} keeps running")
            return Exit.OK
        for line in notes(workload, there, earlier, everywhere):
            print(line)
        state = f"{folder}/ is not applied: run make k8s-apply again"
        for item in to_delete(objects, there):
            old = f"{item['kind'].lower()}/{item['metadata']['name']}"
            grace = grace_s(item)
            if grace:
                print(
                    f"waiting for {old}'s pods to stop (their grace period is {grace} s)...",
                    flush=True,
                )
            limit = grace + DELETE_SLACK_S
            try:
                cluster.kubectl(
                    "delete",
                    "-n",
                    namespace,
                    old,
                    "--cascade=foreground",
                    "--wait",
                    "--ignore-not-found",
                    f"--timeout={limit}s",
                )
            except Unreachable:
                raise
            except Refused as refused:
                if "timed out" not in str(refused) and not isinstance(refused, TimedOut):
                    raise
                return fail(
                    f"{old} is still there after {limit} s ({refused}): kubectl get pods "
                    f"-n {namespace} -l {NAME_LABEL}={workload['metadata']['labels'][NAME_LABEL]} "
                    "shows what is left; a pod stuck Terminating on a lost node needs "
                    "kubectl delete pod --force; "
                    f"{folder}/ is not applied: run make k8s-apply again"
                )
            print(f"deleted {old}")
        state = f"{folder}/ may be partly applied: run make k8s-apply again"
        print(cluster.kubectl("apply", "-f", f"{folder}/"), end="")
    except Refused as refused:
        return fail(f"{refused}; {state.removeprefix(DURING_DRY_RUN)}")
    except KeyboardInterrupt:  # at any phase: one line saying what is left to do
        return fail(
            f"stopped by SIGINT{'' if state.startswith(DURING_DRY_RUN) else ';'} {state}",
            Exit.INTERRUPTED,
        )
    return Exit.OK


def cli() -> int:
    argparse.ArgumentParser(
        prog=f"python -m {PACKAGE}.k8s.apply",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args()  # it takes none: --help, or argparse refuses what it is given
    return main()


if __name__ == "__main__":
    sys.exit(cli())

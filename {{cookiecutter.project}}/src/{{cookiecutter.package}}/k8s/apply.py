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
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from .. import PACKAGE, PROJECT
from ..core.exits import Exit
from .flavors import FLAVORS
from .meta import COMPONENT_LABEL, NAME_LABEL, PART_OF_LABEL, TRAINING, identity

# The kinds this project renders that a new render may leave behind, as kubectl names them.
WORKLOADS = {flavor.kind: flavor.resource for flavor in FLAVORS.values()}
REPLACED_IF_STALE = {"Service": "services", "ServiceAccount": "serviceaccounts"}
DURING_DRY_RUN = "during the server's dry run; "
LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"  # what kubectl apply last sent


class Refused(Exception):
    """A kubectl call that failed; the message is the one line to print."""


class Unreachable(Refused):
    """A kubectl call that reached no API server: its message names the one kubectl tried."""


# kubectl's own words when it got no answer from an API server; "Error from server" is an answer
# (a webhook's "dial tcp ... connection refused" is the server's, so it comes with those words).
NO_ANSWER = re.compile(
    r"connection refused|no such host|i/o timeout|network is unreachable|no route to host|"
    r"TLS handshake timeout"
)
NOT_CONNECTED = re.compile(r"Unable to connect to the server|dial tcp")  # and the reason after it
NO_CONFIG = re.compile(r"Error in configuration|invalid configuration", re.IGNORECASE)
SERVER_TRIED = (  # where kubectl's error names the server: a URL, else its other phrasings
    re.compile(r'"(https?://[^/"?\\]+)'),
    re.compile(r"the server (\S+) was refused"),
    re.compile(r"dial tcp ([^\s:]+:\d+)"),
)
DEFAULT_SERVER = "localhost:8080"  # what kubectl tries with no kubeconfig at all
POINT_IT = (
    "point kubectl at your cluster: KUBECONFIG=<its kubeconfig>, "
    "or kubectl config use-context <name>"
)


class TimedOut(Refused):
    """A kubectl call that got no answer in its time."""


CALL_TIMEOUT_S = 120  # a kubectl call that takes longer is stuck, not slow
# A workload's pods get their grace period to checkpoint, then this long to be gone.
DELETE_SLACK_S = 60
# The server took the object but says its pods would be refused (PodSecurity warns on a Job).
WOULD_BE_REFUSED = re.compile(r"^Warning: (would violate PodSecurity.*)$", re.MULTILINE)
# The server's own reason; kubectl may print a dump of the object after it.
SERVER_CAUSE = re.compile(
    r'^(?:error: )?(Error from server.*|The \S+ "[^"]*" is invalid:.*)$', re.MULTILINE
)


def kubectl(*args: str, stdin: str | None = None) -> str:
    timeout = CALL_TIMEOUT_S + waits_for(args)
    try:
        done = subprocess.run(
            ["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        raise TimedOut(f"kubectl {args[0]} got no answer in {timeout} s") from None
    if done.returncode != 0:
        no_server = no_server_reached(done.stderr)
        if no_server:
            raise Unreachable(no_server)
        raise Refused(f"kubectl {args[0]}: {cause(done.stderr, done.returncode)}")
    warned = WOULD_BE_REFUSED.search(done.stderr)
    if warned and "--dry-run=server" in args:
        raise Refused(f"kubectl {args[0]}: the server would refuse its pods: {warned.group(1)}")
    return done.stdout


def waits_for(args: tuple[str, ...]) -> int:
    """The seconds a call's own --timeout lets it wait, beyond an answer's time."""
    given = [a.removeprefix("--timeout=") for a in args if a.startswith("--timeout=")]
    return int(given[0].removesuffix("s")) if given else 0


def cause(stderr: str, returncode: int) -> str:
    """The server's reason in kubectl's stderr, else kubectl's last line."""
    found = SERVER_CAUSE.search(stderr)
    if found:
        return found.group(1).strip()
    return (stderr.strip().splitlines() or [f"exit {returncode}"])[-1].strip()


def no_server_reached(stderr: str) -> str | None:
    """What to say when kubectl's error is that it reached no API server, naming the one it
    tried and what to do; None when a server answered (and refused)."""
    last = (stderr.strip().splitlines() or [""])[-1].removeprefix("error: ")
    if "Error from server" in stderr:
        return None
    if NO_CONFIG.search(stderr):
        return f"kubectl's kubeconfig is unusable ({last}); {POINT_IT}"
    reason = NO_ANSWER.search(stderr)
    if reason is None and not NOT_CONNECTED.search(stderr):
        return None
    why = reason.group(0) if reason else last
    tried = next((m.group(1) for m in (p.search(stderr) for p in SERVER_TRIED) if m), None)
    if tried and tried.removeprefix("http://") == DEFAULT_SERVER:
        missing = missing_kubeconfig()
        if missing:
            return (
                f"no API server: kubectl has no kubeconfig ({missing}), so it tried "
                f"{DEFAULT_SERVER} ({why}); {POINT_IT}"
            )
    context = current_context()
    of = f', the server of kubectl\'s context "{context}"' if context else ""
    return (
        f"no API server reachable at {tried or 'the server kubectl tried'} ({why}){of}; start it, "
        f"or {POINT_IT}"
    )


def missing_kubeconfig() -> str | None:
    """Why kubectl found no kubeconfig to read (it then tries localhost:8080), or None."""
    named = os.environ.get("KUBECONFIG")
    if named:
        if not any(Path(part).is_file() for part in named.split(os.pathsep) if part):
            return f"KUBECONFIG={named} names no file"
        return None
    if not (Path.home() / ".kube" / "config").is_file():
        return "KUBECONFIG is unset and ~/.kube/config does not exist"
    return None


def current_context() -> str | None:
    """kubectl's current context, from its kubeconfig (no server asked); None if it has none."""
    try:
        done = subprocess.run(
            ["kubectl", "config", "current-context"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def same_length_name(name: str) -> str:
    """Not `name`, as long as it: pod names derive from a job's and must fit 63 characters."""
    return name[:-1] + ("0" if name[-1] != "0" else "1")


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


def pod_template(workload: dict[str, Any]) -> dict[str, Any] | None:
    """The template of the workload's pods, as its controller makes them (its flavor's
    pod_template: for a TrainJob, the runtime patch's pod with the trainer's container fields; the
    runtime's own part is not in it); None where the workload is of no flavor's kind or has no such
    template (the server's dry run says what is wrong)."""
    try:
        return template_in(workload)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        return None


def template_in(workload: dict[str, Any]) -> dict[str, Any]:
    (flavor,) = [f for f in FLAVORS.values() if f.kind == workload["kind"]]
    return flavor.pod_template(workload)


def claims_of(workload: dict[str, Any]) -> set[str]:
    template = pod_template(workload)
    volumes = (template["spec"].get("volumes") or []) if template else []
    return {
        v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v
    }


def server_check(objects: list[tuple[str, dict[str, Any]]]) -> None:
    """Raises Refused unless the server would take every object (admission, validation, webhooks)
    and the workload's pods (PodSecurity judges Pods only). The dry run is the real apply's:
    kubectl apply, with the last-applied-configuration annotation it adds."""
    for file, manifest in objects:
        if manifest["kind"] in WORKLOADS:
            renamed = {**manifest, "metadata": {**manifest["metadata"]}}
            renamed["metadata"]["name"] = same_length_name(manifest["metadata"]["name"])
            dry_run(file, renamed)
            template = pod_template(manifest)
            if template is None:
                continue
            metadata = {
                "name": renamed["metadata"]["name"],
                "namespace": manifest["metadata"]["namespace"],
                "labels": template.get("metadata", {}).get("labels", {}),
            }
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": metadata,
                "spec": template["spec"],
            }
            dry_run(file, pod, "create", f"its {manifest['kind']}'s pods would be refused: ")
        else:
            # Applied in place: an existing claim must accept the change (its spec is mostly fixed).
            dry_run(file, manifest)


def dry_run(file: str, manifest: dict[str, Any], verb: str = "apply", why: str = "") -> None:
    """The server's answer to `kubectl <verb>` of `manifest`, changing nothing: apply for what
    make k8s-apply applies, create for a workload's pods as a bare Pod. Refused: one line,
    `file: <why><the server's cause>`."""
    try:
        kubectl(verb, "--dry-run=server", "-o", "name", "-f", "-", stdin=yaml.safe_dump(manifest))
    except Unreachable:
        raise
    except Refused as refused:
        raise Refused(f"{file}: {why}{refused}") from None


def on_cluster(namespace: str, known: set[str]) -> list[dict[str, Any]]:
    """The objects of the kinds this project renders that carry its component label, any name."""
    found = []
    for resource in [*WORKLOADS.values(), *REPLACED_IF_STALE.values()]:
        if resource not in known:
            continue  # a CRD this cluster does not have: nothing of that kind to delete
        listed = kubectl(
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
            listed = kubectl("get", resource, "-A", "-l", selector, "-o", "json")
        except Unreachable:
            raise
        except Refused:  # not allowed to list every namespace (RBAC): the job's own
            everywhere = False
            listed = kubectl("get", resource, "-n", namespace, "-l", selector, "-o", "json")
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
            known = set(kubectl("api-resources", "-o", "name").split())
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
            kubectl("apply", "-f", f"{folder}/")
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
                kubectl(
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
        print(kubectl("apply", "-f", f"{folder}/"), end="")
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

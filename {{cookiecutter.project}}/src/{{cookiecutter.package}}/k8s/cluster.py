"""The cluster as kubectl reaches it: each call bounded in time, its failure one line (a server
that refused, or none reached, named with what to do), and the server's dry run of what
make k8s-apply would send. apply.py (make k8s-apply) and doctor.py (make k8s-doctor) use it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from .flavors import FLAVORS

# The kinds this project renders that a new render may leave behind, as kubectl names them.
WORKLOADS = {flavor.kind: flavor.resource for flavor in FLAVORS.values()}


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

"""`make k8s-apply`: k8s/ onto the cluster, never leaving the user with nothing running.

    python -m {{ cookiecutter.package }}.k8s.apply      # after python -m {{ cookiecutter.package }}.k8s --check, as make k8s-apply runs it

1. The API server checks every object of k8s/ first (a server-side dry run): the job under
   another name of the same length, since a job's pods cannot change in place and the running
   one is replaced, not updated. Until the server accepts the replacement, nothing is deleted.
2. This project's jobs, of any flavor, are deleted (their pods get their grace period to
   checkpoint), and so are its Services and ServiceAccounts that k8s/ no longer holds: a JobSet
   takes over a Service of its name, and a stale one would select the old Job's pods. Claims are
   never deleted: they hold the runs.
3. k8s/ is applied.

What belongs to the project is what carries its label, app.kubernetes.io/name=<deploy.name>.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from ..exits import Exit
from .flavors import FLAVORS
from .meta import NAME_LABEL

# The kinds this project renders that a new render may leave behind, as kubectl names them.
WORKLOADS = {flavor.kind: flavor.resource for flavor in FLAVORS.values()}
REPLACED_IF_STALE = {"Service": "services", "ServiceAccount": "serviceaccounts"}


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
POINT_IT = "point kubectl at your cluster: KUBECONFIG=<its kubeconfig>, or kubectl config use-context <name>"


def kubectl(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        said = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        no_server = no_server_reached(done.stderr)
        if no_server:
            raise Unreachable(no_server)
        raise Refused(f"kubectl {args[0]}: {said[-1]}")
    return done.stdout


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
    """kubectl's current context, read from its kubeconfig (no server asked); None if it has none."""
    try:
        done = subprocess.run(["kubectl", "config", "current-context"], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def same_length_name(name: str) -> str:
    """Not `name`, as long as it: pod names derive from a job's and must fit 63 characters."""
    return name[:-1] + ("0" if name[-1] != "0" else "1")


def server_check(objects: list[dict[str, Any]]) -> None:
    """Raises Refused unless the server would take every object (admission, validation, webhooks)."""
    for manifest in objects:
        if manifest["kind"] in WORKLOADS:
            renamed = {**manifest, "metadata": {**manifest["metadata"]}}
            renamed["metadata"]["name"] = same_length_name(manifest["metadata"]["name"])
            kubectl(
                "create", "--dry-run=server", "-o", "name", "-f", "-", stdin=yaml.safe_dump(renamed)
            )
        else:  # applied in place: an existing claim must accept the change (most of its spec is fixed)
            kubectl(
                "apply", "--dry-run=server", "-o", "name", "-f", "-", stdin=yaml.safe_dump(manifest)
            )


def to_delete(objects: list[dict[str, Any]], namespace: str, known: set[str]) -> list[str]:
    """kind/name of the project's objects on the cluster that the apply replaces or leaves stale."""
    (name,) = {manifest["metadata"]["labels"][NAME_LABEL] for manifest in objects}
    rendered = {(REPLACED_IF_STALE.get(m["kind"]), m["metadata"]["name"]) for m in objects}
    found = []
    for resource in [*WORKLOADS.values(), *REPLACED_IF_STALE.values()]:
        if resource not in known:
            continue  # a CRD this cluster does not have: nothing of that kind to delete
        names = kubectl(
            "get", resource, "-n", namespace, "-l", f"{NAME_LABEL}={name}", "-o", "name"
        ).split()
        for kind_and_name in names:
            if (
                resource in WORKLOADS.values()
                or (resource, kind_and_name.split("/", 1)[1]) not in rendered
            ):
                found.append(kind_and_name)
    return found


def main(folder: Path = Path("k8s")) -> int:
    if shutil.which("kubectl") is None:
        print("make k8s-apply: kubectl is not on PATH", file=sys.stderr)
        return Exit.FAILED
    objects = [yaml.safe_load(path.read_text()) for path in sorted(folder.glob("*.yaml"))]
    if not objects:
        print(f"make k8s-apply: {folder}/ holds no manifests: python -m {__package__} writes them",
              file=sys.stderr)  # fmt: skip
        return Exit.FAILED
    (namespace,) = {manifest["metadata"]["namespace"] for manifest in objects}
    try:
        server_check(objects)
    except Unreachable as unreachable:
        print(f"make k8s-apply: {unreachable}; nothing was changed", file=sys.stderr)
        return Exit.FAILED
    except KeyboardInterrupt:
        print("make k8s-apply: stopped by SIGINT during the server's dry run; nothing was changed",
              file=sys.stderr)  # fmt: skip
        return Exit.INTERRUPTED
    except Refused as refused:
        print(f"make k8s-apply: the server refuses k8s/, so the running job is left as it is: {refused}",
              file=sys.stderr)  # fmt: skip
        return Exit.FAILED
    try:
        known = set(kubectl("api-resources", "-o", "name").split())
        for kind_and_name in to_delete(objects, namespace, known):
            cascade = ("--cascade=foreground", "--wait", "--ignore-not-found")
            kubectl("delete", "-n", namespace, kind_and_name, *cascade)
            print(f"deleted {kind_and_name}")
        print(kubectl("apply", "-f", f"{folder}/"), end="")
    except Refused as refused:
        print(f"make k8s-apply: {refused}; {folder}/ is not applied: run make k8s-apply again",
              file=sys.stderr)  # fmt: skip
        return Exit.FAILED
    except KeyboardInterrupt:  # the old job may be gone already: say what is left to do
        print(f"make k8s-apply: stopped by SIGINT; {folder}/ is not applied: run make k8s-apply again",
              file=sys.stderr)  # fmt: skip
        return Exit.INTERRUPTED
    return Exit.OK


def cli() -> int:
    argparse.ArgumentParser(
        prog=f"python -m {__package__}.apply",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args()  # it takes none: --help, or argparse refuses what it is given
    return main()


if __name__ == "__main__":
    sys.exit(cli())

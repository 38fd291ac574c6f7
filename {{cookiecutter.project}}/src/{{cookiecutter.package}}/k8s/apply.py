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


def kubectl(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        said = done.stderr.strip().splitlines() or [f"exit {done.returncode}"]
        raise Refused(f"kubectl {args[0]}: {said[-1]}")
    return done.stdout


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


if __name__ == "__main__":
    sys.exit(main())

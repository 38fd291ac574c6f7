"""make k8s-apply's last step against a fake kubectl: what it sends, what it deletes, and the one
line it says at each phase. The template's own tests run it on a real API server."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import PACKAGE

from ddp_project import PROJECT
from ddp_project.k8s import apply, cluster, meta

NAME, NAMESPACE = "p", "ns"


def job(name: str = NAME, labels: dict | None = None, **metadata) -> dict:
    pod = {
        "terminationGracePeriodSeconds": 90,
        "containers": [{"name": "trainer", "image": "i:1"}],
        "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": f"{name}-runs-rwo"}}],
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels or meta.labels(name)}
        | metadata,
        "spec": {"template": {"metadata": {"labels": meta.labels(name)}, "spec": pod}},
    }


@pytest.fixture
def folder(tmp_path, monkeypatch) -> Path:
    """k8s/ with one Job, and a kubectl on PATH (which main asks for; the calls are faked)."""
    (tmp_path / "kubectl").write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    k8s = tmp_path / "k8s"
    k8s.mkdir()
    (k8s / "job.yaml").write_text("# a comment\n" + yaml.safe_dump(job()))
    return k8s


class Fake:
    """kubectl's calls, answered from `there` (the cluster's objects); `on` raises at a verb."""

    def __init__(
        self, there: list[dict] | None = None, on: dict | None = None, forbid_all: bool = False
    ):
        self.there, self.on, self.calls = there or [], on or {}, []
        self.forbid_all = forbid_all  # RBAC: no right to list every namespace

    def __call__(self, *args: str, stdin: str | None = None) -> str:
        self.calls.append(args)
        if args[0] in self.on:
            raise self.on[args[0]]
        if args[0] == "api-resources":
            return (
                "\n".join(cluster.WORKLOADS.values())
                + "\n"
                + "\n".join(apply.REPLACED_IF_STALE.values())
            )
        if args[0] == "get":
            kind = {r: k for k, r in {**cluster.WORKLOADS, **apply.REPLACED_IF_STALE}.items()}[
                args[1]
            ]
            if "-A" in args and self.forbid_all:
                raise cluster.Refused(
                    'Error from server (Forbidden): jobs.batch is forbidden: User "u" '
                    'cannot list resource "jobs" in API group "batch" at the cluster scope'
                )
            namespace = args[args.index("-n") + 1] if "-n" in args else None
            return json.dumps(
                {
                    "items": [
                        i
                        for i in self.there
                        if i["kind"] == kind
                        and namespace in (None, i["metadata"].get("namespace", NAMESPACE))
                    ]
                }
            )
        return ""

    def verbs(self) -> list[str]:
        return [
            " ".join(a for a in call if not a.startswith("-")).split(" ")[0] for call in self.calls
        ]


def test_the_dry_run_is_the_real_applys_and_each_workloads_pods_are_checked_as_a_pod(
    folder, monkeypatch
):
    fake = Fake()
    monkeypatch.setattr(cluster, "kubectl", fake)
    assert apply.main(folder) == 0
    dry = [call for call in fake.calls if "--dry-run=server" in call]
    assert [call[0] for call in dry] == [
        "apply",
        "create",
    ]  # kubectl apply, as the real step sends it
    # The trainjob's pod: the runtime patch's spec with the trainer's fields, without its account.
    trainjob = {
        "kind": "TrainJob",
        "spec": {
            "trainer": {
                "image": "i:2",
                "command": ["c"],
                "args": ["a"],
                "env": [],
                "resourcesPerNode": {"limits": {}},
            },
            "runtimePatches": [
                {
                    "trainingRuntimeSpec": {
                        "template": {
                            "spec": {
                                "replicatedJobs": [
                                    {
                                        "template": {
                                            "spec": {
                                                "template": {
                                                    "metadata": {"labels": {"x": "y"}},
                                                    "spec": {
                                                        "serviceAccountName": NAME,
                                                        "containers": [
                                                            {"name": "node", "securityContext": {}}
                                                        ],
                                                    },
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        }
                    }
                }
            ],
        },
    }
    template = cluster.pod_template(trainjob)
    assert template["metadata"] == {"labels": {"x": "y"}}
    assert template["spec"] == {
        "containers": [
            {
                "name": "node",
                "securityContext": {},
                "image": "i:2",
                "command": ["c"],
                "args": ["a"],
                "env": [],
                "resources": {"limits": {}},
            }
        ]
    }


def test_a_workload_and_its_pods_go_through_the_one_dry_run_each_with_its_verb_and_line(
    monkeypatch,
):
    sent = []
    monkeypatch.setattr(
        cluster,
        "dry_run",
        lambda file, obj, verb="apply", why="": sent.append((file, obj["kind"], verb)),
    )
    cluster.server_check([("job.yaml", job())])
    assert sent == [("job.yaml", "Job", "apply"), ("job.yaml", "Pod", "create")]
    monkeypatch.undo()
    monkeypatch.setattr(
        cluster, "kubectl", Fake(on={"create": cluster.Refused("forbidden: violates PodSecurity")})
    )
    with pytest.raises(cluster.Refused) as refused:
        cluster.server_check([("job.yaml", job())])
    assert (
        str(refused.value)
        == "job.yaml: its Job's pods would be refused: forbidden: violates PodSecurity"
    )


def test_a_podsecurity_warning_on_the_dry_run_refuses_and_deletes_nothing(folder, tmp_path, capsys):
    log = tmp_path / "calls"
    (tmp_path / "kubectl").write_text(
        f'#!/bin/sh\necho "$@" >> {log}\ncat >/dev/null\n'
        'echo \'Warning: would violate PodSecurity "restricted:latest": '
        "unrestricted capabilities' >&2\n"
    )
    assert apply.main(folder) == 1
    assert capsys.readouterr().err == (
        "make k8s-apply: the server refuses k8s/, so the running job is left as it is: job.yaml: "
        "kubectl apply: the server would refuse its pods: would violate PodSecurity "
        '"restricted:latest": unrestricted capabilities\n'
    )
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["apply"]


def test_the_error_line_is_the_servers_cause_not_kubectls_dump_after_it():
    stderr = (
        'The PersistentVolumeClaim "p-runs-rwo" is invalid: spec: Forbidden: spec is immutable '
        "after creation\n"
        "  core.PersistentVolumeClaimSpec{\n"
        '        "DataSourceRef": null,\n'
        "  }\n"
    )
    assert cluster.cause(stderr, 1).startswith(
        'The PersistentVolumeClaim "p-runs-rwo" is invalid: spec: Forbidden'
    )
    said = (
        'Error from server (Forbidden): error when creating "STDIN": pods "p" is forbidden: '
        "violates\n  }\n"
    )
    assert (
        cluster.cause(said, 1)
        == 'Error from server (Forbidden): error when creating "STDIN": pods "p" is forbidden: '
        "violates"
    )
    assert cluster.cause("error: unknown flag\n", 1) == "error: unknown flag"


def test_only_what_carries_all_the_projects_labels_is_deleted(folder, monkeypatch, capsys):
    only_name = {meta.NAME_LABEL: NAME}
    theirs = [
        job(f"{NAME}-eval", labels=only_name | {meta.COMPONENT_LABEL: "eval"}),
        {
            "kind": "Service",
            "metadata": {
                "name": f"{NAME}-tensorboard",
                "labels": only_name
                | {meta.COMPONENT_LABEL: "training"}
                | {meta.NAME_LABEL: "other"},
            },
        },
    ]
    mine = [job(), {"kind": "Service", "metadata": {"name": NAME, "labels": meta.labels(NAME)}}]
    fake = Fake(theirs + mine)
    monkeypatch.setattr(cluster, "kubectl", fake)
    assert apply.main(folder) == 0
    deleted = [call[3] for call in fake.calls if call[0] == "delete"]
    assert deleted == [f"job/{NAME}", f"service/{NAME}"]
    out = capsys.readouterr().out
    assert (
        f"waiting for job/{NAME}'s pods to stop (their grace period is 90 s)...\n"
        f"deleted job/{NAME}\n" in out
    )
    assert all(
        f"--timeout={90 + apply.DELETE_SLACK_S}s" in call
        for call in fake.calls
        if call[0] == "delete" and "job/" in call[3]
    )


def test_this_projects_job_under_an_earlier_name_or_namespace_is_named_and_kept(
    folder, monkeypatch, capsys
):
    """A new deploy.name or deploy.namespace replaces nothing: the job left under the old one is
    named, with the delete that stops it; another project's job (its own part-of) is not."""
    renamed, moved = (
        job("old"),
        job() | {"metadata": job()["metadata"] | {"namespace": "elsewhere"}},
    )
    theirs = job("q", labels=meta.labels("q") | {meta.PART_OF_LABEL: "another-project"})
    fake = Fake([job(), renamed, moved, theirs])
    monkeypatch.setattr(cluster, "kubectl", fake)
    assert apply.main(folder) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "is this project's training job too" in line]
    assert notes == [
        f"note: Job/old in {NAMESPACE} is this project's training job too, under an earlier "
        "deploy.name or deploy.namespace, and keeps running with its GPUs (its checkpoints: "
        f"old-runs-rwo): kubectl delete -n {NAMESPACE} job/old stops it",
        f"note: Job/{NAME} in elsewhere is this project's training job too, under an earlier "
        "deploy.name or deploy.namespace, and keeps running with its GPUs (its checkpoints: "
        f"{NAME}-runs-rwo): kubectl delete -n elsewhere job/{NAME} stops it",
    ], out
    assert "could not be listed" not in out
    assert [call[1:4] for call in fake.calls if call[0] == "delete"] == [
        ("-n", NAMESPACE, f"job/{NAME}")
    ]


def test_where_every_namespace_cannot_be_listed_the_jobs_own_is_and_the_note_says_how_to_look(
    folder, monkeypatch, capsys
):
    fake = Fake([job("old")], forbid_all=True)
    monkeypatch.setattr(cluster, "kubectl", fake)
    assert apply.main(folder) == 0
    out = capsys.readouterr().out
    assert f"note: Job/old in {NAMESPACE} is this project's training job too" in out
    monkeypatch.setattr(
        cluster, "kubectl", Fake([])
    )  # every namespace seen, nothing there: no note
    assert apply.main(folder) == 0
    assert "note:" not in capsys.readouterr().out
    monkeypatch.setattr(cluster, "kubectl", Fake([], forbid_all=True))
    assert apply.main(folder) == 0
    out = capsys.readouterr().out
    assert (
        "other namespaces could not be listed; a job of an earlier deploy.namespace keeps "
        "running: kubectl get jobs.batch,jobsets.jobset.x-k8s.io,pytorchjobs.kubeflow.org,"
        "trainjobs.trainer.kubeflow.org "
        f"-A -l {meta.PART_OF_LABEL}={PROJECT},{meta.COMPONENT_LABEL}=training lists them"
    ) in out, out


def test_an_unchanged_k8s_restarts_nothing(folder, monkeypatch, capsys):
    sent = yaml.safe_load((folder / "job.yaml").read_text())
    sent["metadata"]["annotations"] = {}  # as kubectl apply records it
    running = job(annotations={apply.LAST_APPLIED: json.dumps(sent)})
    fake = Fake([running])
    monkeypatch.setattr(cluster, "kubectl", fake)
    assert apply.main(folder) == 0
    assert "delete" not in fake.verbs()
    assert capsys.readouterr().out == f"k8s/ is unchanged: job/{NAME} keeps running\n"
    changed = job(annotations={apply.LAST_APPLIED: json.dumps(sent | {"spec": {}})})
    monkeypatch.setattr(cluster, "kubectl", fake := Fake([changed]))
    assert apply.main(folder) == 0
    assert "delete" in fake.verbs()


def test_a_new_claim_is_named_in_a_note(folder, monkeypatch, capsys):
    old = job()
    old["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = (
        f"{NAME}-runs-rwx"
    )
    monkeypatch.setattr(cluster, "kubectl", Fake([old]))
    assert apply.main(folder) == 0
    out = capsys.readouterr().out
    assert (
        f"note: the runs claim changes from {NAME}-runs-rwx to {NAME}-runs-rwo: "
        "the new run starts from step 0" in out
    )
    assert f"deploy.runs_claim={NAME}-runs-rwx" in out


@pytest.mark.parametrize(
    ("file", "text", "said"),
    [
        ("empty.yaml", "# nothing\n", "empty.yaml (no objects, not one)"),
        ("two.yaml", "kind: A\n---\nkind: B\n", "two.yaml (2 objects, not one)"),
        ("bad.yml", "a: [\n", "bad.yml (not YAML: "),
        (
            "cm.yaml",
            yaml.safe_dump({"kind": "ConfigMap", "metadata": {"name": "x", "labels": {}}}),
            f"cm.yaml (not labelled {meta.NAME_LABEL}={NAME},{meta.COMPONENT_LABEL}=training)",
        ),
        (
            "other.json",
            json.dumps(job(f"{NAME}-x", labels=meta.labels(NAME)) | {"kind": "Service"}),
            None,
        ),
        ("list.json", json.dumps([1, 2]), "list.json (no metadata.labels)"),
    ],
)
def test_files_the_renderer_did_not_write_are_named_in_one_line(
    folder, monkeypatch, capsys, file, text, said
):
    if said is None:  # the project's labels, another namespace
        text = json.dumps(
            json.loads(text)
            | {"metadata": {"name": "x", "namespace": "elsewhere", "labels": meta.labels(NAME)}}
        )
        said = f"{file} (namespace elsewhere, not {NAMESPACE})"
    (folder / file).write_text(text)
    (folder / "notes.txt").write_text("kubectl apply -f reads no .txt\n")
    fake = Fake()
    monkeypatch.setattr(cluster, "kubectl", fake)
    assert apply.main(folder) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and err.endswith("nothing was changed\n"), err
    assert err.startswith(
        f"make k8s-apply: {folder}/ holds what python -m {PACKAGE}.k8s does not write: "
    )
    assert fake.calls == []


@pytest.mark.parametrize(
    ("verb", "said"),
    [
        ("create", "stopped by SIGINT during the server's dry run; nothing was changed"),
        ("api-resources", "stopped by SIGINT; nothing was changed"),
        ("get", "stopped by SIGINT; nothing was changed"),
        ("delete", "stopped by SIGINT; {folder}/ is not applied: run make k8s-apply again"),
    ],
)
def test_ctrl_c_is_one_line_at_every_phase(folder, monkeypatch, capsys, verb, said):
    monkeypatch.setattr(cluster, "kubectl", Fake([job()], on={verb: KeyboardInterrupt()}))
    assert apply.main(folder) == 130
    assert capsys.readouterr().err == f"make k8s-apply: {said.format(folder=folder)}\n"


def test_a_delete_that_does_not_end_says_what_is_left_and_what_to_do(folder, monkeypatch, capsys):
    stuck = cluster.Refused("kubectl delete: error: timed out waiting for the condition on jobs/p")
    monkeypatch.setattr(cluster, "kubectl", Fake([job()], on={"delete": stuck}))
    assert apply.main(folder) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"make k8s-apply: job/{NAME} is still there after 150 s "
    )
    assert f"kubectl get pods -n {NAMESPACE} -l {meta.NAME_LABEL}={NAME} shows what is left" in err


def test_a_kubectl_call_that_hangs_is_ended(tmp_path, monkeypatch):
    (tmp_path / "kubectl").write_text("#!/bin/sh\nexec sleep 30\n")
    (tmp_path / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(cluster, "CALL_TIMEOUT_S", 1)
    with pytest.raises(cluster.TimedOut, match="kubectl get got no answer in 1 s"):
        cluster.kubectl("get", "jobs")
    assert shutil.which("kubectl") and subprocess  # the fake, first on PATH

"""The doctor on a machine without GPUs: it says so, and checks gloo instead. On one GPU (faked
here): nothing between GPUs to test. A failed launch is named by its root cause."""

import contextlib
import io
import json
import os
import socket
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from conftest import PACKAGE

from ddp_project import doctor
from ddp_project.launcher import worker_exits
from ddp_project.nccl import allreduce, probe


@pytest.fixture(scope="module")
def doctor_run() -> tuple[int, str]:
    """The doctor on this machine, for real, once, in this process (its all-reduces are a
    torchrun launch): main's exit code and what it printed with --json. Its text report is the
    same report, rendered: see below."""
    saved, argv, printed = dict(os.environ), sys.argv, io.StringIO()
    sys.argv = ["doctor", "--json"]
    try:
        with contextlib.redirect_stdout(printed):
            code = doctor.main()
    finally:  # the environment as it was: its torchrun launches ran in this process
        sys.argv = argv
        os.environ.clear()
        os.environ.update(saved)
    return code, printed.getvalue()


@pytest.mark.skipif(
    torch.cuda.device_count() > 0, reason="GPUs present: tests/test_gpu.py covers them"
)
def test_doctor_without_gpus_checks_gloo_and_says_so(doctor_run):
    code, out = doctor_run
    assert code == 0, out[-2000:]
    report = json.loads(out)
    assert "no CUDA device is visible" in report["note"]
    (gloo,) = report["profiles"]
    assert gloo["result"] == "works" and gloo["busbw_gbps"]["64MiB"] > 0
    assert report["dev_shm_bytes"] > 0 and "lo" in report["interfaces"]


def test_doctor_text_report_names_the_checks(doctor_run, monkeypatch, capsys):
    """Without --json, main prints the report of the real run above as text."""
    assert doctor_run[0] == 0, doctor_run[1][-2000:]
    report = json.loads(doctor_run[1])
    monkeypatch.setattr(doctor, "diagnose", lambda names, nproc, timeout_s: report)
    code, out, err = doctor_main(monkeypatch, capsys)
    assert code == 0, err[-2000:]
    for heading in ("torch ", "InfiniBand:", "/dev/shm:", "Interfaces:", "profile", "(bus GB/s)"):
        assert heading in out


# Real torchrun output, frames inside torch cut: on CPU (torch 2.13, gloo, 2 processes: rank 1
# fails, rank 0 fails as a consequence) and on one H200 (torch 2.11, NCCL 2.28.9: two processes on
# one GPU; one process with NCCL_SOCKET_IFNAME=nope). torchrun's summary names no cause. Its lines
# are kept as long as torchrun wrote them (noqa: E501).
TORCHRUN_FAILURES = {
    "gloo_init": (
        r"""
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed.
*****************************************
Traceback (most recent call last):
  File "/site/pkg/allreduce.py", line 85, in <module>
  File "/site/pkg/allreduce.py", line 65, in main
RuntimeError: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84] ifa != nullptr. Unable to find address for: nope
Traceback (most recent call last):
  File "/site/pkg/allreduce.py", line 85, in <module>
  File "/site/pkg/allreduce.py", line 65, in main
RuntimeError: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84] ifa != nullptr. Unable to find address for: nope
W1201 05:23:11.768000 7771 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 7850 closing signal SIGTERM
E1201 05:23:11.804000 7771 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 7851) of binary: /work/main/.venv/bin/python
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
ddp_project.nccl.allreduce FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_05:23:11
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 7850)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 7850
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_05:23:11
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 7851)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
""",  # noqa: E501
        "rank 1: RuntimeError: [enforce fail at "
        "/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/device.cc:84] ifa != nullptr. "
        "Unable to find address for: nope",
    ),
    "exception": (
        r"""
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed.
*****************************************
[rank1]: Traceback (most recent call last):
[rank1]:   File "/work/w.py", line 13, in <module>
[rank1]: RuntimeError: inconsistent tensor size, expected tensor [2] and src [3] to have the same number of elements, but got 2 and 3 elements respectively
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/w.py", line 14, in <module>
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:38806. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️
W1201 05:23:52.746000 8355 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 8368 closing signal SIGTERM
E1201 05:23:52.782000 8355 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 8369) of binary: /work/main/.venv/bin/python
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
w.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_05:23:52
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8368)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8368
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_05:23:52
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 8369)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
""",  # noqa: E501
        "rank 1: RuntimeError: inconsistent tensor size, expected tensor [2] and src [3] to have "
        "the same number of elements, but got 2 and 3 elements respectively",
    ),
    "system_exit": (
        r"""
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed.
*****************************************
all-reduce returned wrong values: data corruption
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/w.py", line 14, in <module>
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:62680. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️
W1201 05:23:30.726000 8043 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 8062 closing signal SIGTERM
E1201 05:23:30.759000 8043 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 8063) of binary: /work/main/.venv/bin/python
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
w.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_05:23:30
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8062)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8062
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_05:23:30
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 8063)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
""",  # noqa: E501
        "rank 1 exited with 1: all-reduce returned wrong values: data corruption",
    ),
    "sigkill": (
        r"""
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed.
*****************************************
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/w.py", line 14, in <module>
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:2443: Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. Check the logs of the remote worker before reporting an error. GLHF! 🏖️
W1201 05:23:42.189000 8149 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 8204 closing signal SIGTERM
E1201 05:23:42.221000 8149 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 8205) of binary: /work/main/.venv/bin/python
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
w.py FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_05:23:42
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8204)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8204
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_05:23:42
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 8205)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 8205
======================================================
""",  # noqa: E501
        "rank 1 was killed by SIGKILL",
    ),
    "cuda_two_ranks_on_one_gpu": (
        r"""
*****************************************
Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for optimal performance in your application as needed.
*****************************************
Traceback (most recent call last):
  File "/tmp/p/pkg/allreduce.py", line 85, in <module>
  File "/tmp/p/pkg/allreduce.py", line 63, in main
torch.AcceleratorError: CUDA error: invalid device ordinal
GPU device may be out of range, do you have enough GPUs?
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.

W1201 05:42:45.248000 560 torch/distributed/elastic/multiprocessing/api.py:1012] Sending process 587 closing signal SIGTERM
E1201 05:42:45.281000 560 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 1) local_rank: 1 (pid: 588) of binary: /opt/torch/.venv/bin/python3
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
pkg.allreduce FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_05:42:45
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 587)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 587
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_05:42:45
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 588)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
""",  # noqa: E501
        "rank 1: torch.AcceleratorError: CUDA error: invalid device ordinal",
    ),
    "nccl_init": (
        r"""Traceback (most recent call last):
  File "/tmp/p/pkg/allreduce.py", line 85, in <module>
  File "/tmp/p/pkg/allreduce.py", line 65, in main
torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3135, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.28.9
ncclInvalidUsage: This usually reflects invalid usage of NCCL library.
Last error:
Bootstrap : no socket interface found
[W1201 05:43:06.490629756 ProcessGroupNCCL.cpp:1575] Warning: WARNING: destroy_process_group() was not called before program exit, which can leak resources. For more info, please see https://pytorch.org/docs/stable/distributed.html#shutdown (function operator())
E1201 05:43:07.189000 643 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 1) local_rank: 0 (pid: 670) of binary: /opt/torch/.venv/bin/python3
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
pkg.allreduce FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_05:43:07
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 670)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
""",  # noqa: E501
        "rank 0: torch.distributed.DistBackendError: NCCL error in: "
        "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3135, invalid usage "
        "(run with NCCL_DEBUG=WARN for d ... Last error: Bootstrap : no socket interface found",
    ),
}


@pytest.mark.parametrize("case", sorted(TORCHRUN_FAILURES))
def test_a_failed_launch_is_named_by_its_root_cause_not_by_torchruns_summary(case):
    output, cause = TORCHRUN_FAILURES[case]
    assert worker_exits.root_cause(output) == cause


def test_the_blamed_ranks_own_exception_wins_over_an_unlabelled_one():
    # An exception line without a [rankN]: label (a subprocess of another rank, say) comes first.
    output, cause = TORCHRUN_FAILURES["exception"]
    stray = "ValueError: a line that any process could have printed\n"
    assert worker_exits.root_cause(stray + output) == cause


def test_a_failed_profile_row_names_the_root_cause(monkeypatch):
    output, cause = TORCHRUN_FAILURES["exception"]
    monkeypatch.setattr(
        doctor.probe,
        "run_with_hard_timeout",
        lambda *args, **kwargs: probe.Outcome("failed", output),
    )
    result = doctor.run_profile("auto", {}, 2, [1], 10)
    assert (result.result, result.error) == ("fails", cause)


@pytest.fixture
def fake_node(monkeypatch):
    """fake_node(gpus, outcome) -> a node with `gpus` GPUs, as the doctor sees it: each profile's
    run gives outcome(name, env), and the node's .calls records what run_profile was asked."""

    def make(gpus: int, outcome) -> SimpleNamespace:
        node = SimpleNamespace(calls=[])

        def run_profile(name, env, nproc, sizes, timeout_s):
            node.calls.append((name, nproc, sizes))
            return outcome(name, env)

        monkeypatch.setattr(doctor.probe, "gpu_count", lambda: gpus)
        monkeypatch.setattr(
            doctor.probe, "peer_copy_tests", lambda pairs: dict.fromkeys(pairs, "ok")
        )
        monkeypatch.setattr(doctor, "run_profile", run_profile)
        return node

    return make


@pytest.fixture
def one_gpu(fake_node):
    """A node with one GPU whose NCCL init works, or with .init_fails, fails."""

    def outcome(name, env):
        if node.init_fails:
            return doctor.ProfileResult(name, env, "fails", error="rank 0: DistBackendError: …")
        return doctor.ProfileResult(name, env, "works", init_s=0.4)

    node = fake_node(1, outcome)
    node.init_fails = False
    return node


def doctor_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["doctor", *args])
    try:
        code = doctor.main()
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_one_gpu_has_nothing_between_gpus_to_test_and_says_what_it_checked(
    one_gpu, monkeypatch, capsys
):
    code, out, err = doctor_main(monkeypatch, capsys)
    assert code == 0, out + err
    assert one_gpu.calls == [(name, 1, []) for name in doctor.PROFILES]  # one process, no sizes
    assert "GPUs: 1, links from none; testing with 1 process\n" in out
    assert (
        "One GPU: nothing between GPUs to test (NCCL needs a GPU per process); checked the "
        "node's facts above and one process's NCCL init under each profile"
    ) in out
    assert out.rstrip().endswith(
        "Nothing between GPUs to test here. One process's NCCL init works under auto, "
        "nccl_default, pcie_safe, socket; training on one GPU needs no profile choice."
    )
    assert "No profile works" not in out and "Recommended" not in out
    code, out, _ = doctor_main(monkeypatch, capsys, "--json")
    report = json.loads(out)
    assert code == 0 and report["between_gpus"] is False and report["recommended"] is None
    assert report["sizes"] == [] and {r["result"] for r in report["profiles"]} == {"works"}


def test_one_gpu_whose_nccl_init_fails_says_so(one_gpu, monkeypatch, capsys):
    one_gpu.init_fails = True
    code, out, _ = doctor_main(monkeypatch, capsys, "--profiles", "auto")
    assert code == 1
    assert "auto          fails         -   rank 0: DistBackendError: …" in out
    assert out.rstrip().endswith(
        "One process's NCCL init fails under every profile: read the "
        "errors above; NCCL_DEBUG=INFO shows more."
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--nproc", "2"],
            "--nproc 2: 1 GPU(s) visible here, and NCCL needs a GPU per process; use at most 1",
        ),
        (["--nproc", "0"], "argument --nproc: must be a whole number, at least 1; got '0'"),
        (["--nproc", "abc"], "argument --nproc: must be a whole number, at least 1; got 'abc'"),
        (
            ["--timeout-s", "-1"],
            "argument --timeout-s: must be a number of seconds above 0; got '-1'",
        ),
    ],
)
def test_a_bad_doctor_argument_is_one_line(one_gpu, monkeypatch, capsys, args, message):
    code, out, err = doctor_main(monkeypatch, capsys, *args)
    assert (code, out, err) == (2, "", f"{PACKAGE}.doctor: {message}\n")
    assert one_gpu.calls == []


def test_one_process_all_reduce_reports_its_init_and_no_bandwidth(monkeypatch, capsys):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["allreduce", "--sizes-mib", "1"])  # one process: moot
    allreduce.main()
    (line,) = capsys.readouterr().out.splitlines()
    measured = json.loads(line.removeprefix("ALLREDUCE "))
    assert measured["world_size"] == 1 and measured["busbw_gbps"] == {}
    assert measured["init_s"] > 0


@pytest.mark.parametrize(
    ("nbytes", "seconds", "world", "gbps"),
    [(10**9, 1.0, 2, 1.0), (10**9, 1.0, 8, 1.75), (10**9, 0.5, 4, 3.0), (10**9, 1.0, 1, 0.0)],
)
def test_bus_bandwidth_is_nccl_tests_formula(nbytes, seconds, world, gbps):
    # nccl-tests' all_reduce_perf: busbw = algbw * 2 (n - 1) / n
    assert allreduce.bus_bandwidth_gbps(nbytes, seconds, world) == pytest.approx(gbps)


def test_two_gpus_recommend_the_fastest_working_profile_and_rate_auto_against_it(
    fake_node, monkeypatch, capsys
):
    measured = {
        "auto": doctor.ProfileResult(
            "auto", {}, "works", 1.0, {"1MiB": 20.0, "64MiB": 300.0, "1024MiB": 400.0}
        ),
        "nccl_default": doctor.ProfileResult(
            "nccl_default", {}, "works", 1.0, {"1MiB": 30.0, "64MiB": 200.0, "1024MiB": 450.0}
        ),
        "pcie_safe": doctor.ProfileResult(
            "pcie_safe", {}, "fails", error="rank 1: RuntimeError: boom"
        ),
        "socket": doctor.ProfileResult("socket", {}, "hangs", error="no result within 90 s"),
    }
    node = fake_node(2, lambda name, env: measured[name])
    code, out, _ = doctor_main(monkeypatch, capsys)
    assert code == 0
    assert node.calls == [(name, 2, doctor.GPU_SIZES_MIB) for name in doctor.PROFILES]
    rows = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] == ["pcie_safe"]}
    assert rows["pcie_safe"].split()[1] == "fails"
    assert rows["pcie_safe"].endswith("   rank 1: RuntimeError: boom")
    assert "Recommended: nccl=nccl_default, the fastest profile that works here. Pin it:" in out
    assert "(nccl=auto, the default, reaches 89% of it at 1024MiB)" in out  # 400 / 450
    measured["nccl_default"] = replace(measured["nccl_default"], result="fails")
    code, out, _ = doctor_main(monkeypatch, capsys, "--json")
    assert (code, json.loads(out)["recommended"]) == (0, "auto")
    for name in ("auto", "nccl_default"):
        measured[name] = replace(measured[name], result="fails")
    code, out, _ = doctor_main(monkeypatch, capsys)
    assert code == 1 and "No profile works." in out

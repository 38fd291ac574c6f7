"""The launcher's bound on its connections to the rendezvous host (store_liveness.py), on real
sockets: a host whose link goes silent is given up by the kernel within the bound, and said while
it is waited for; pod 0's own connections and other ports are left alone."""

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
from contextlib import nullcontext

import pytest

from ddp_project import launch
from ddp_project.launcher.store_liveness import (
    KEEPALIVE_EVERY_S,
    StoreLiveness,
    bound,
    rendezvous_connections,
    unanswered_s,
)


def test_bound_sets_the_kernels_timeouts_on_the_socket():
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        socket.create_connection(server.getsockname()) as client,
    ):
        bound(client.fileno(), 7.5)
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 7500
        assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_EVERY_S
        assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 2  # ceil(7.5 / 5)
        assert unanswered_s(client.fileno()) == 0.0  # nothing sent, nothing waited for


def own_address() -> str:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))
        return probe.getsockname()[0]


# (where the server listens, the address the client connects to)
OWN = {
    "at localhost": (("127.0.0.1", 0), "127.0.0.1"),
    "at another loopback address": (("127.0.0.2", 0), "127.0.0.2"),
    "at its own IP": ((own_address(), 0), own_address()),
    "over a dual-stack socket": (("::", 0), "::ffff:127.0.0.2"),  # as torch's store client connects
}


@pytest.mark.parametrize("where", OWN)
def test_pod_0s_own_connections_to_its_store_are_not_the_ones_bounded(where):
    """Pod 0 reaches its own store at localhost or at its own pod IP: never lost, never bounded."""
    listen, connect = OWN[where]
    family = socket.AF_INET6 if ":" in listen[0] else socket.AF_INET
    with socket.create_server(
        listen, family=family, dualstack_ipv6=family == socket.AF_INET6
    ) as server:
        port = server.getsockname()[1]
        with socket.create_connection((connect, port)) as client:
            assert client.getpeername()[0] == connect
            assert rendezvous_connections(port) == []


def parsed(*options: str) -> argparse.Namespace:
    return torch_parser().parse_args([*options, "-m", "x"])


def torch_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def test_a_c10d_launch_of_several_nodes_bounds_its_connections_at_half_the_read_timeout():
    """Every manifest's launch line uses the c10d rendezvous; one node has no remote host."""
    several = parsed(
        "--nnodes",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "pod-0.svc:1234",
        "--rdzv-conf",
        "read_timeout=40",
    )
    liveness = launch.store_liveness(several, False, print)
    assert isinstance(liveness, StoreLiveness) and (liveness.port, liveness.give_up_s) == (1234, 20)
    default = parsed("--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "pod-0.svc")
    liveness = launch.store_liveness(default, False, print)
    assert (liveness.port, liveness.give_up_s) == (29400, 30)  # c10d's port and read_timeout
    assert isinstance(launch.store_liveness(parsed("--standalone"), True, print), nullcontext)


# A client of a request-response server on another host, as torch's store client is: it asks
# every 0.1 s and waits for each answer, its connection bounded by StoreLiveness. Its own guard
# (a 30 s timeout) says if the read was left waiting.
CLIENT = """
import socket, sys, time
from ddp_project.launcher.store_liveness import StoreLiveness
host, port = sys.argv[1], int(sys.argv[2])
sock = socket.create_connection((host, port), timeout=30)
other = socket.create_connection((host, port + 1))  # another service of that host: not bounded
with StoreLiveness(
    port, give_up_s=4, say=lambda line: print(line, flush=True), interval_s=0.2, line_every_s=1
):
    print("connected", flush=True)
    while True:
        try:
            sock.sendall(b"?")
            if not sock.recv(1):
                print("closed by the host", flush=True)
                break
        except OSError as err:  # the kernel's error; Python's own timeout has no errno
            print(
                f"given up: {err.strerror}" if err.errno else "still waiting after 30 s", flush=True
            )
            break
        time.sleep(0.1)
print(
    "another port's connection bounded at",
    other.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
    "ms",
)
"""
SERVER = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
with socket.create_server((host, port)) as server, socket.create_server((host, port + 1)) as other:
    print("listening", flush=True)
    conn, _ = server.accept()
    while conn.recv(1):
        conn.sendall(b"!")
"""


@pytest.fixture
def two_namespaces():
    names = [f"sl{os.getpid()}n{i}" for i in range(2)]
    if (
        not shutil.which("ip")
        or subprocess.run(["ip", "netns", "add", names[0]], capture_output=True).returncode
    ):
        pytest.skip("needs network namespaces (root)")
    devices = [f"sl{os.getpid() % 100000}v{i}" for i in range(2)]
    try:
        subprocess.run(["ip", "netns", "add", names[1]], check=True)
        subprocess.run(
            [
                "ip",
                "link",
                "add",
                devices[0],
                "netns",
                names[0],
                "type",
                "veth",
                "peer",
                "name",
                devices[1],
                "netns",
                names[1],
            ],
            check=True,
        )
        for i, ns in enumerate(names):
            for step in (
                ["addr", "add", f"10.232.9.{i + 1}/24", "dev", devices[i]],
                ["link", "set", devices[i], "up"],
            ):
                subprocess.run(["ip", "-n", ns, *step], check=True)
        yield names, devices
    finally:
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_host_gone_silent_is_given_up_by_the_bound_and_said_while_waited_for(two_namespaces):
    """The host's link goes down: no reset, no answer. Unbounded, the client's read would wait
    for the kernel's retransmissions (about 16 minutes); bounded at 4 s, the connection fails
    with the kernel's error, after a line each second it waited."""
    (host_ns, client_ns), (host_dev, _) = two_namespaces
    port = 29400
    host = subprocess.Popen(
        ["ip", "netns", "exec", host_ns, sys.executable, "-c", SERVER, "10.232.9.1", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout.readline() == "listening\n"
        client = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                client_ns,
                sys.executable,
                "-c",
                CLIENT,
                "10.232.9.1",
                str(port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert client.stdout.readline() == "connected\n"
        subprocess.run(["ip", "-n", host_ns, "link", "set", host_dev, "down"], check=True)
        said = client.communicate(timeout=120)[0]
    finally:
        host.kill()
    waited = re.findall(
        r"the rendezvous host 10\.232\.9\.1:29400 \(pod 0\) has not answered for (\d) s; "
        r"this node gives it up at 4 s",
        said,
    )
    assert waited == ["1", "2", "3"], said
    assert said.splitlines()[-1] == "another port's connection bounded at 0 ms", said
    assert said.splitlines()[-2] in (
        "given up: Connection timed out",
        "given up: No route to host",
    ), said

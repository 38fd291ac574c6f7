"""A rendezvous host lost without a word is given up within deploy.rdzv_timeout_s, not 15 minutes.

The c10d store lives in pod 0's launcher. Every other node's launcher talks to it over TCP
connections that torch opens with no timeout of their own, and polls it several times a second
while its workers train. A host that goes away cleanly (its process exits or is killed, its kernel
still up) resets those connections: the next read fails, and the launcher joins the replacement's
rendezvous. A host lost silently (its node powered off, its link cut, its IP given up) answers
nothing: the read waits until the kernel stops retransmitting (net.ipv4.tcp_retries2, about 16
minutes), while the replacement pod times out waiting for this node. That sysctl is not among
the safe ones restricted PodSecurity allows.

So the launcher bounds the connections itself, in the kernel, on its own sockets: every
`interval_s` it finds its TCP connections to the rendezvous port of another host (pod 0's own
are local) and sets TCP_USER_TIMEOUT (data sent and not acknowledged) and keepalive probes (an
idle connection) to `give_up_s`. A connection unanswered that long is closed with ETIMEDOUT, the
read fails, and torch raises RendezvousConnectionError, as for a clean loss. While one goes
unanswered it says so every LINE_EVERY_S seconds.
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

LINE_EVERY_S = 10
# struct tcp_info (linux/tcp.h): 8 bytes of u8 fields, then u32s. The offsets are the kernel's ABI.
TCP_INFO_PROBES = 3  # u8 tcpi_probes: keepalive probes sent, unanswered
TCP_INFO_UNACKED = 24  # u32 tcpi_unacked: segments sent, not acknowledged
TCP_INFO_LAST_ACK_RECV = 56  # u32 tcpi_last_ack_recv: ms since the peer last acknowledged
TCP_INFO_SIZE = 60
KEEPALIVE_EVERY_S = 5  # an idle connection's first probe, and the gap between probes


@dataclass(frozen=True)
class Connection:
    fd: int
    inode: str  # the socket's own identity: an fd number closed and reused names another
    peer: tuple[str, int]


def address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4 peer of a dual-stack socket reads as ::ffff:a.b.c.d: as a.b.c.d here."""
    found = ipaddress.ip_address(host.partition("%")[0])
    return getattr(found, "ipv4_mapped", None) or found


def rendezvous_connections(port: int) -> list[Connection]:
    """This process's TCP connections to `port` on another host."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            inode = os.readlink(f"/proc/self/fd/{name}")
            if not inode.startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(name))) as sock:
                if sock.type != socket.SOCK_STREAM or sock.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                (peer, peer_port), (own, _) = sock.getpeername()[:2], sock.getsockname()[:2]
        except (OSError, ValueError):  # gone since listed, not connected, not a socket
            continue
        peer, own = address(peer), address(own)
        if peer_port == port and peer != own and not peer.is_loopback:
            found.append(Connection(int(name), inode, (str(peer), peer_port)))
    return found


def bound(fd: int, give_up_s: float) -> None:
    """The kernel closes this connection once its peer has not answered for give_up_s."""
    with socket.socket(fileno=os.dup(fd)) as sock:  # options are the socket's, not the fd's
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(give_up_s * 1000))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_EVERY_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_EVERY_S)
        sock.setsockopt(
            socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, math.ceil(give_up_s / KEEPALIVE_EVERY_S))
        )


def unanswered_s(fd: int) -> float:
    """How long the peer has left data or a keepalive probe unanswered (0: it has answered all)."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SIZE)
    if len(info) < TCP_INFO_SIZE:
        return 0.0
    (unacked,) = struct.unpack_from("I", info, TCP_INFO_UNACKED)
    (last_ack_ms,) = struct.unpack_from("I", info, TCP_INFO_LAST_ACK_RECV)
    return last_ack_ms / 1000 if unacked or info[TCP_INFO_PROBES] else 0.0


class StoreLiveness:
    """The thread above, for the launch of a node that does not host the rendezvous."""

    def __init__(
        self,
        port: int,
        give_up_s: float,
        say: Callable[[str], None],
        interval_s: float = 1.0,
        line_every_s: int = LINE_EVERY_S,
    ) -> None:
        self.port, self.give_up_s, self.say, self.interval_s = port, give_up_s, say, interval_s
        self.line_every_s = line_every_s
        self.bounded: set[Connection] = set()
        self.said_at: dict[
            tuple[str, int], int
        ] = {}  # host -> the last multiple of line_every_s said
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="store-liveness", daemon=True)

    def __enter__(self) -> StoreLiveness:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()

    def watch(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.check()

    def check(self) -> None:
        connections = set(rendezvous_connections(self.port))
        self.bounded &= connections
        silent: dict[tuple[str, int], float] = {}  # a host's longest silence over its connections
        for connection in connections:
            try:
                if connection not in self.bounded:
                    bound(connection.fd, self.give_up_s)
                    self.bounded.add(connection)
                seconds = unanswered_s(connection.fd)
            except OSError:  # closed since listed
                continue
            silent[connection.peer] = max(seconds, silent.get(connection.peer, 0.0))
        for (host, port), seconds in silent.items():
            step = int(seconds // self.line_every_s) * self.line_every_s
            if not step:
                self.said_at.pop((host, port), None)
            elif step > self.said_at.get((host, port), 0) and seconds < self.give_up_s:
                self.said_at[host, port] = step
                self.say(
                    f": the rendezvous host {host}:{port} (pod 0) has not answered for {step} s; "
                    f"this node gives it up at {self.give_up_s:g} s "
                    "(half of --rdzv-conf read_timeout; deploy.rdzv_timeout_s in k8s/)"
                )

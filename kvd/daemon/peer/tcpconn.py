"""What the kernel knows about a peer's TCP connection (daemon process, peer side).

ZeroMQ hides its connections, but a received message names the descriptor it came in on
(`zmq.SRCFD`). Through it the daemon learns the addresses at both ends, which user owns the
other end when it is on this host's loopback (the host's /proc/net/tcp tables list both ends
of a loopback connection, with their owners), and can cut the connection: ZeroMQ then drops
it, and with it every frame it still had queued for that peer. No ZeroMQ calls here.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any

from kvd.errors import Unauthorized

PROC_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
# struct tcp_info (linux/tcp.h, since 4.1): tcpi_bytes_acked and tcpi_bytes_received, two u64 at 120
TCP_INFO_BYTES_ACKED = 120
TCP_INFO_BYTES = 136


@dataclass(frozen=True)
class TcpConnection:
    fd: int  # ZeroMQ's descriptor: borrowed, never closed here
    local: tuple[str, int]
    remote: tuple[str, int]

    @classmethod
    def of_fd(cls, fd: int) -> TcpConnection | None:
        """The connection on descriptor fd; None if it is not (or no longer) a TCP connection."""
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
                    return None
                return cls(fd, _host_port(sock.getsockname()), _host_port(sock.getpeername()))
        except OSError:
            return None

    def on_loopback(self) -> bool:
        return _ip(self.remote[0]).is_loopback

    def owner_uid(self, tables: tuple[str, ...] = PROC_TABLES) -> int | None:
        """The uid owning the other end of a connection within this host (loopback or one of its own
        addresses); None if it cannot be found (the connection is gone, or the other end is not on
        this host, or in another network namespace)."""
        wanted = (_normal(self.remote), _normal(self.local))
        for path in tables:
            try:
                with open(path) as table:
                    next(table, None)  # header
                    for line in table:
                        fields = line.split()
                        if len(fields) > 7 and (_address(fields[1]), _address(fields[2])) == wanted:
                            return int(fields[7])
            except OSError:
                continue
        return None

    def progress(self) -> int | None:
        """Bytes the kernel has seen move on this connection so far (acknowledged by the peer, and
        received from it): a count that grows while a transfer crosses a slow link, even when no
        whole message has arrived for a while. None if the connection is gone."""
        try:
            with socket.socket(fileno=os.dup(self.fd)) as sock:
                if (_host_port(sock.getsockname()), _host_port(sock.getpeername())) != (self.local, self.remote):
                    return None
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
        except OSError:
            return None
        if len(info) < TCP_INFO_BYTES:
            return None
        acked: int
        received: int
        acked, received = struct.unpack_from("=QQ", info, TCP_INFO_BYTES_ACKED)
        return acked + received

    def cut(self) -> bool:
        """Shut the connection down; False if the descriptor no longer carries this connection
        (it closed by itself, and the number may now belong to another)."""
        try:
            with socket.socket(fileno=os.dup(self.fd)) as sock:
                if (_host_port(sock.getsockname()), _host_port(sock.getpeername())) != (self.local, self.remote):
                    return False
                sock.shutdown(socket.SHUT_RDWR)
                return True
        except OSError:
            return False


def foreign_user(conn: TcpConnection | None) -> int | None:
    """The uid at the other end of a connection from this host when it is neither ours nor root's
    (-1 when a loopback peer cannot be told); None when the other end is another host's, or ours.

    Every address of a host is reachable by every user on it, so without CURVE this is what keeps
    another user's process from pulling (or being pushed) caches through the peer port, or from
    using a tcp:// client socket."""
    if conn is None:
        return None
    # any local connection, not only loopback: another user may connect through the host's own
    # address (10.0.0.5 -> 10.0.0.5). The kernel's tables list the other end iff it is on this host.
    uid = conn.owner_uid()
    if uid is None:
        return -1 if conn.on_loopback() else None  # (off loopback and not in the tables: another host)
    return None if uid in (os.getuid(), 0) else uid


def foreign_user_refusal(uid: int, what: str,
                         remedy: str = "run both daemons as one user, or turn on CURVE (--curve-secret-key) "
                                       "to let keys decide") -> Unauthorized:
    who = "an unknown user" if uid < 0 else f"uid {uid}"
    return Unauthorized(f"{what} belongs to another user of this host ({who}; this daemon runs as uid "
                        f"{os.getuid()}): {remedy}")


def _host_port(address: tuple[Any, ...]) -> tuple[str, int]:
    return address[0], address[1]


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(host.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _normal(address: tuple[str, int]) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    return _ip(address[0]), address[1]


def _address(field: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int] | None:
    """A /proc/net/tcp{,6} address: hex words of the address in host byte order, ':', hex port."""
    host, _, port = field.partition(":")
    try:
        words = [bytes.fromhex(host[i:i + 8]) for i in range(0, len(host), 8)]
        raw = b"".join(word[::-1] if sys.byteorder == "little" else word for word in words)
        ip = ipaddress.ip_address(raw)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip, int(port, 16)
    except ValueError:
        return None

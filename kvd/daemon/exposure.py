"""Which of the daemon's listeners may face the network (daemon process): the loopback rule.

Two listeners take connections over TCP: `--listen` (peers) and a `tcp://` `--socket` (local
clients, e.g. in another network namespace of this host). Either one bound beyond loopback is
reachable by other hosts, and neither authenticates them: the peer port only with CURVE, the
client socket never (a unix socket's 0600 mode, or the other end's uid on loopback, is all the
client socket checks). So, as Redis' protected mode does, the daemon refuses to start with such a
listener unless `--insecure` says the network is trusted, and then it warns at every start.

Under `--insecure` a client socket beyond loopback is open to any host that reaches it: the uid
check (`tcpconn.foreign_user`) refuses other users of this host only; a connection from another
host, or from another network namespace (which the kernel's tables of this one do not list), is
let in, as a container on a bridge must be. Such a client can list, read, consume and delete
every entry and clear the tier (the pool it cannot map, off this host), so the address must be
one that only trusted namespaces reach (firewall it).
"""
from __future__ import annotations

import logging

from kvd.errors import BadRequest
from kvd.wire.endpoints import is_loopback_endpoint, unix_path

from .config import Config

log = logging.getLogger(__name__)

SAFE_SOCKET = "unix:///run/kvd/kvd.sock"  # what a refusal suggests (the systemd unit's socket)


def check_exposure(cfg: Config, curve: bool) -> None:
    """Raise BadRequest (before anything binds) for a listener beyond loopback that nothing
    authenticates, unless --insecure."""
    if cfg.insecure:
        return
    if not curve and not is_loopback_endpoint(cfg.listen):
        raise BadRequest(insecure_refusal(cfg.listen))
    if exposed_socket(cfg.socket):
        raise BadRequest(socket_refusal(cfg.socket))


def warn_exposure(cfg: Config, curve: bool) -> None:
    """The warnings an --insecure start logs, once per listener it lets face the network."""
    if not curve and not is_loopback_endpoint(cfg.listen):
        log.warning("--insecure: peers are not authenticated: %s is reachable beyond this host and CURVE is "
                    "off, so any host that reaches it can read and consume every entry (set up a cluster CA: "
                    "kvd keygen --help)", cfg.listen)
    if exposed_socket(cfg.socket):
        log.warning("--insecure: clients are not authenticated: the client socket %s is reachable beyond this "
                    "host, so any host or network namespace that reaches it can list, read, consume and delete "
                    "every entry and clear the KV tier (only other users of this host are refused). Firewall it "
                    "to the namespaces that need it, or use a unix socket (%s)", cfg.socket, SAFE_SOCKET)


def exposed_socket(socket: str) -> bool:
    """A tcp:// client socket beyond loopback (a wildcard, or any other address)."""
    return unix_path(socket) is None and not is_loopback_endpoint(socket)


def socket_refusal(socket: str) -> str:
    return (f"refusing to serve clients on {socket}: the client socket has no authentication, so any host that "
            "reaches it could list, read, consume and delete every entry and clear the KV tier. Use a unix socket "
            f"(the default; e.g. --socket {SAFE_SOCKET}, shared with a container as a mounted directory), or a "
            "loopback tcp:// address, or pass --insecure if only trusted network namespaces can reach it (and "
            "firewall it).")


def insecure_refusal(listen: str) -> str:
    """Why a daemon with a --listen beyond loopback and no peer authentication does not start (as
    Redis' protected mode refuses), and the ways out."""
    return (f"refusing to listen for peers on {listen} without peer authentication: any host that reaches it "
            "could read, consume and inject KV caches. Set up a cluster CA (three commands):\n"
            "  kvd keygen --ca --dir /etc/kvd\n"
            "  kvd keygen NODE --dir /etc/kvd --ca-secret /etc/kvd/ca.key_secret\n"
            "  kvd serve --curve-secret-key /etc/kvd/NODE.key_secret --curve-ca /etc/kvd/ca.key ...\n"
            "(across hosts, each node's /etc/kvd also holds the others' NODE.cert, to dial its --peer nodes by)\n"
            "or listen on loopback only, or pass --insecure if the network is trusted (and firewalled).")

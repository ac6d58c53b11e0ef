"""Which plane a peer link's transfers ride (daemon process), settled in its handshake: both ends
offer a one-sided plane in their hellos (`--data-plane auto` or `nixl`), or the link's bytes go as
chunk frames on ZeroMQ. Only the authenticated hello carries a plane's info; nothing of it comes
from the registry.

`--data-plane nixl` refuses a peer that offers none, saying why; `auto` takes it where both have it.
A node seen under a new incarnation is a new agent: the old one is gone for good (its process is), so
what it may have touched is let go of (`on_peer_gone`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from kvd.errors import KvdError, PeerUnavailable

from .base import NIXL, DataPlane, PlaneInfo

log = logging.getLogger(__name__)


class PlaneHandshake:
    """Built before the peer side (its links offer our plane), and told at `start` whom to tell of
    a peer's agent gone for good (the transfers, built after the links)."""

    def __init__(self, mode: str, plane: DataPlane | None) -> None:
        self.mode = mode  # auto | nixl (zmq: no PlaneHandshake at all)
        self.plane = plane
        self.on_peer_gone: Callable[[str], None] = lambda agent: None
        self._agents: dict[str, str] = {}  # node id -> its agent on the plane now

    def start(self, on_peer_gone: Callable[[str], None]) -> None:
        self.on_peer_gone = on_peer_gone

    def offer(self) -> dict | None:
        """What our hello says of our plane."""
        return self.plane.info().to_wire() if self.plane is not None else None

    def admit(self, channel, node_id: str, incarnation: int, wire: object) -> KvdError | None:
        """A peer's hello (or answer) said this of its plane: the channel rides it, or frames; or
        the error the link is refused with (we require the plane, and the peer has none)."""
        channel.plane = channel.plane_agent = None
        if self.plane is None:
            return None
        if wire is None:
            return self._without(node_id, "it offers none (it runs --data-plane zmq, or has no NIXL installed)")
        try:
            info = PlaneInfo.from_wire(wire, node_id, incarnation)
            if info.name != self.plane.name:
                return self._without(node_id, f"it offers {info.name[:40]!r}")
            previous = self._agents.get(node_id)
            if previous is not None and previous != info.agent:  # it restarted: the old agent is no more
                self.tear_down(previous)
                self.on_peer_gone(previous)
            self.plane.add_peer(info)
        except KvdError as exc:
            return self._without(node_id, exc.message)
        self._agents[node_id] = info.agent
        channel.plane, channel.plane_agent = info.name, info.agent
        return None

    def _without(self, node_id: str, why: str) -> KvdError | None:
        if self.mode == NIXL:
            return PeerUnavailable(f"peer {node_id} cannot use the NIXL plane: {why}; this daemon runs "
                                   "--data-plane nixl (use auto to fall back to ZeroMQ for such peers)")
        log.info("peer %s: its transfers go over ZeroMQ (no one-sided plane: %s)", node_id, why)
        return None

    def tear_down(self, agent: str) -> None:
        """End our plane's connection to that agent (its operations fail); a new hello brings it back."""
        if self.plane is not None:
            self.plane.remove_peer(agent)
        for node_id, known in list(self._agents.items()):
            if known == agent:
                del self._agents[node_id]

    def stats(self) -> dict:
        return {"mode": self.mode, **(self.plane.stats() if self.plane is not None else {"plane": None})}

"""What a one-sided data plane is (daemon process), and what a daemon says of its own in its hello.

A `DataPlane` registers the pool once, says how a peer reaches it (`PlaneInfo`, carried in the
authenticated peer hello as opaque bytes and plain numbers), admits peers whose info came that
way, and posts writes (a push: our blocks into a region the receiver granted) and reads (a pull:
the holder's granted blocks into ours) of lists of (address, length) ranges. An operation is
polled until it is done or failed; tearing a peer down ends its operations.

kvd's other plane is ZeroMQ itself: the chunk frames of the transfer protocol (`zmq`, the default).
It needs none of this: its bytes ride the control plane's own connections.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from kvd.errors import KvdError, ProtocolError

ZMQ, NIXL = "zmq", "nixl"
PLANES = (ZMQ, NIXL)
CHOICES = ("auto", ZMQ, NIXL)  # --data-plane


class PlaneError(KvdError):
    """A one-sided operation failed, or a plane could not start (code as peer_unavailable)."""

    code = 5


class OpState(enum.Enum):
    RUNNING = "running"
    DONE = "done"  # for a write: in the peer's memory (the plane flushed it); for a read: in ours
    FAILED = "failed"


@dataclass(frozen=True)
class PlaneInfo:
    """What a daemon tells a peer of its one-sided plane, in its hello: trusted only as far as the
    hello is (CURVE, the CA), and only ever turned into descriptors of numbers, never unpickled."""

    name: str  # "nixl"
    agent: str  # the plane's name for this daemon: kvd/NODE/INCARNATION (checked against the hello)
    metadata: bytes  # the plane's own connection info (NIXL agent metadata), opaque to kvd
    base: int  # the pool's address in the daemon's memory (regions are offsets from it)
    size: int
    memory: str  # "DRAM" or "VRAM"

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "agent": self.agent, "md": self.metadata, "base": self.base, "size": self.size,
                "mem": self.memory}

    @classmethod
    def from_wire(cls, value: object, node_id: str, incarnation: int) -> PlaneInfo:
        """A peer's plane info from its hello, checked: the fields' types, and that its agent name is
        the one its node id and incarnation (which the hello's authentication vouches for) give."""
        if not isinstance(value, dict):
            raise ProtocolError("a hello's plane is a map")
        try:
            info = cls(value["name"], value["agent"], value["md"], value["base"], value["size"], value["mem"])
        except KeyError as exc:
            raise ProtocolError(f"a hello's plane lacks {exc}") from None
        if not (isinstance(info.name, str) and isinstance(info.agent, str) and isinstance(info.metadata, bytes)
                and type(info.base) is int and type(info.size) is int and info.memory in ("DRAM", "VRAM")
                and info.base >= 0 and info.size > 0):
            raise ProtocolError("a hello's plane has fields of the wrong kind")
        if info.agent != agent_name(node_id, incarnation):
            raise ProtocolError(f"a hello's plane names agent {info.agent[:80]!r}, not {node_id}'s")
        return info


def agent_name(node_id: str, incarnation: int) -> str:
    """One daemon run's name in a plane: a restarted daemon is another agent."""
    return f"kvd/{node_id}/{incarnation:x}"


Ranges = list[tuple[int, int]]  # (offset in the pool, length)


class DataPlane(Protocol):
    name: str

    def info(self) -> PlaneInfo:
        """What our hello tells peers."""
        ...

    def add_peer(self, info: PlaneInfo) -> None:
        """Admit a peer's agent (from an authenticated hello); again for the same agent is a no-op."""
        ...

    def remove_peer(self, agent: str) -> None:
        """Tear the peer's agent down: its connection goes, our operations towards it fail."""
        ...

    def post(self, op: str, agent: str, local: Ranges, remote: Ranges) -> object:
        """Start a "write" (local pool ranges -> the peer's) or a "read" (the peer's -> ours); the
        lists pair up range by range. Returns a handle for `state` and `release`."""
        ...

    def state(self, handle: object) -> OpState: ...

    def release(self, handle: object) -> None:
        """Let go of a handle whose operation is done or failed."""
        ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

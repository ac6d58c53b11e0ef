"""NIXL as kvd's one-sided plane (daemon process): one agent per daemon with the UCX backend, the
pool registered once, peers admitted from their authenticated hellos.

UCX chooses the transport per peer: RDMA (rc, ud), NVLink and GPU copies (cuda_ipc, cuda_copy),
shared memory on one host (sm, cma), TCP. Its TCP and shared-memory transports land bytes in
software, on the target's side, so the agent runs NIXL's progress thread, event-driven: NIXL's
Python API starts it busy-polling (a delay of 0: a whole core while idle, measured 0.89 CPU-s per
second on this 2-core VM, and slower transfers for it), so the agent is built with a delay of
PROGRESS_DELAY_US, which only bounds how long the thread sleeps on UCX's event fd (idle: 0.02 CPU-s
per second; a 64 KiB write ~90 µs either way).

Every call into NIXL is made from the daemon's event loop thread (the agent runs without locks:
NIXL_THREAD_SYNC_NONE, its default without a listener thread). NIXL's own metadata listener is
never started: metadata travels in kvd's hello.
"""
from __future__ import annotations

import fcntl
import importlib
import importlib.util
import ipaddress
import logging
import os
import signal
import socket
import struct
import sys
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

from kvd.errors import BadRequest

from .base import NIXL, OpState, PlaneError, PlaneInfo, Ranges, agent_name

log = logging.getLogger(__name__)

PROGRESS_DELAY_US = 1000  # the progress thread's longest sleep between looks at UCX (event-driven below it)
INSTALL_HINT = "pip install '.[nixl]' from kvd's checkout (./dev setup installs it into .venv)"
_BUILD_LOCK = threading.Lock()  # (the agent is built with NIXL's config class swapped for a moment)
_STATES = {"DONE": OpState.DONE, "PROC": OpState.RUNNING, "ERR": OpState.FAILED}
DAEMON_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


BUILDS = ("nixl_cu12", "nixl_cu13", "nixl_rocm")  # NIXL's wheels; `nixl` is a meta package choosing one


def available() -> bool:
    """A NIXL build is installed (found, not imported: importing is the plane's start)."""
    return any(importlib.util.find_spec(name) is not None for name in BUILDS)


def _nixl_api() -> ModuleType:
    """NIXL's Python API module. A host pool's daemon has not imported torch, and the meta package
    would import it (3.4 s of a 4.2 s start here) only to read which CUDA the process runs: any build
    will do for host memory, so the first installed is taken. A GPU pool's daemon has torch, and the
    meta package picks the build for its CUDA."""
    if "torch" not in sys.modules:
        for name in BUILDS:
            try:
                return importlib.import_module(f"{name}._api")
            except ModuleNotFoundError as exc:
                if exc.name not in (name, f"{name}._api"):
                    raise
    import nixl  # noqa: F401

    return sys.modules["nixl._api"]


def net_device_for(host: str) -> str | None:
    """The network interface UCX may use for --listen's host: lo for loopback, the interface that
    holds the address otherwise, None (UCX's own choice: every device) for a wildcard."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if address.is_unspecified:
        return None
    if address.is_loopback:
        return "lo"
    if address.version != 4:
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == str(address):
            return name
    return None


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


@dataclass
class _Peer:
    info: PlaneInfo


@dataclass
class NixlPlane:
    """The daemon's NIXL agent, with the pool registered. Build it with `open_nixl`."""

    node_id: str
    incarnation: int
    base: int
    size: int
    memory: str  # DRAM or VRAM
    device: int
    agent: Any = None  # NIXL's nixl_agent (NIXL ships no type information)
    _registration: object = None
    _metadata: bytes = b""
    _peers: dict[str, _Peer] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=lambda: {"posted": 0, "done": 0, "failed": 0, "peers_added": 0,
                                                            "peers_removed": 0})
    name: str = NIXL

    def start(self) -> None:
        self.agent = _build_agent(agent_name(self.node_id, self.incarnation))
        try:
            self._registration = self.agent.register_memory([(self.base, self.size, self.device, "")], self.memory)
            self._metadata = self.agent.get_agent_metadata()
        except Exception as exc:
            raise PlaneError(f"NIXL could not register the {self.memory} pool: {exc}") from None

    def info(self) -> PlaneInfo:
        return PlaneInfo(NIXL, agent_name(self.node_id, self.incarnation), self._metadata, self.base, self.size,
                         self.memory)

    # --- peers ------------------------------------------------------------------------------------

    def add_peer(self, info: PlaneInfo) -> None:
        known = self._peers.get(info.agent)
        if known is not None:
            if known.info.metadata == info.metadata:
                return
            self.remove_peer(info.agent)  # (new connection info under one name: take the new)
        try:
            loaded = self.agent.add_remote_agent(info.metadata)
        except Exception as exc:
            raise PlaneError(f"NIXL refused the metadata of {info.agent}: {exc}") from None
        if isinstance(loaded, bytes):
            loaded = loaded.decode(errors="replace")
        if loaded != info.agent:  # its metadata must name the agent its hello vouches for
            self._forget(loaded)
            raise PlaneError(f"the NIXL metadata of {info.agent} names agent {str(loaded)[:80]!r}")
        self._peers[info.agent] = _Peer(info)
        self.counts["peers_added"] += 1

    def remove_peer(self, agent: str) -> None:
        if self._peers.pop(agent, None) is not None:
            self._forget(agent)
            self.counts["peers_removed"] += 1

    def _forget(self, agent: str) -> None:
        try:
            self.agent.remove_remote_agent(agent)
        except Exception as exc:  # (it may never have loaded)
            log.debug("NIXL: removing agent %s: %s", agent, exc)

    def peers(self) -> list[str]:
        return sorted(self._peers)

    # --- operations ---------------------------------------------------------------------------------

    def post(self, op: str, agent: str, local: Ranges, remote: Ranges) -> object:
        peer = self._peers.get(agent)
        if peer is None:
            raise PlaneError(f"no NIXL connection to {agent} (its link went down)")
        if len(local) != len(remote) or any(a[1] != b[1] for a, b in zip(local, remote, strict=True)):
            raise PlaneError("local and remote ranges do not pair up")
        for offset, length in local:
            if not (offset >= 0 and length > 0 and offset + length <= self.size):
                raise PlaneError(f"range [{offset}, +{length}) is outside our pool")
        for offset, length in remote:
            if not (offset >= 0 and length > 0 and offset + length <= peer.info.size):
                raise PlaneError(f"range [{offset}, +{length}) is outside {agent}'s pool")
        agent_ = self.agent
        try:
            local_descs = agent_.get_xfer_descs([(self.base + o, n, self.device) for o, n in local], self.memory)
            remote_descs = agent_.get_xfer_descs([(peer.info.base + o, n, 0) for o, n in remote], peer.info.memory)
            handle = agent_.initialize_xfer("WRITE" if op == "write" else "READ", local_descs, remote_descs, agent)
            first = agent_.transfer(handle)
        except Exception as exc:
            self.counts["failed"] += 1
            raise PlaneError(f"NIXL {op} towards {agent} could not start: {exc}") from None
        self.counts["posted"] += 1
        return _Op(handle, _STATES.get(first, OpState.FAILED))

    def state(self, handle: object) -> OpState:
        op = handle
        assert isinstance(op, _Op)
        if op.state is OpState.RUNNING:
            try:
                op.state = _STATES.get(self.agent.check_xfer_state(op.handle), OpState.FAILED)
            except Exception as exc:
                log.debug("NIXL: checking a transfer: %s", exc)
                op.state = OpState.FAILED
        if op.state is not OpState.RUNNING and not op.counted:
            op.counted = True
            self.counts["done" if op.state is OpState.DONE else "failed"] += 1
        return op.state

    def release(self, handle: object) -> None:
        op = handle
        assert isinstance(op, _Op)
        try:
            self.agent.release_xfer_handle(op.handle)
        except Exception as exc:
            log.debug("NIXL: releasing a transfer: %s", exc)

    def stats(self) -> dict[str, Any]:
        return {"plane": NIXL, "agent": agent_name(self.node_id, self.incarnation), "memory": self.memory,
                "registered_bytes": self.size, "peers": self.peers(), **self.counts}

    def close(self) -> None:
        if self.agent is None:
            return
        for agent in list(self._peers):
            self.remove_peer(agent)
        try:
            if self._registration is not None:
                self.agent.deregister_memory(self._registration)
        except Exception as exc:
            log.debug("NIXL: deregistering the pool: %s", exc)
        self.agent = self._registration = None


@dataclass(eq=False)
class _Op:
    handle: object
    state: OpState
    counted: bool = False  # its end is in `counts`


def _build_agent(name: str) -> Any:
    """A NIXL agent with the UCX backend and an event-driven progress thread (module docstring)."""
    # the threads NIXL and UCX start (on import and with the agent) inherit the signal mask of this one:
    # with the daemon's signals blocked there, they are delivered to the thread that handles them
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, DAEMON_SIGNALS)
    try:
        return _build_agent_masked(name)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _build_agent_masked(name: str) -> Any:
    try:
        api = _nixl_api()
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
    except Exception as exc:
        raise PlaneError(f"NIXL is not installed ({exc}): {INSTALL_HINT}") from None
    bind = getattr(api, "nixlBind", None)
    if bind is None or not hasattr(bind, "nixlAgentConfig"):
        raise PlaneError("this NIXL's Python API is not the one kvd was tested with (pinned in pyproject.toml)")
    original = bind.nixlAgentConfig

    class EventDrivenConfig(original):  # type: ignore[misc,valid-type]  # (a pybind11 class, found at run time)
        def __setattr__(self, key: str, value: object) -> None:
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    with _BUILD_LOCK:
        bind.nixlAgentConfig = EventDrivenConfig
        try:
            agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
        except Exception as exc:
            raise PlaneError(f"NIXL could not start its agent: {exc}") from None
        finally:
            bind.nixlAgentConfig = original
    if "UCX" not in agent.backends:
        raise PlaneError(f"NIXL has no UCX backend here (plugins: {agent.get_plugin_list()})")
    return agent


def open_nixl(node_id: str, incarnation: int, region: tuple[int, int, str, int], listen_host: str) -> NixlPlane:
    """The daemon's plane: UCX kept to --listen's interface (unless UCX_NET_DEVICES says otherwise),
    the agent built, the pool (address, size, DRAM|VRAM, device) registered."""
    device = net_device_for(listen_host)
    if device is not None:
        os.environ.setdefault("UCX_NET_DEVICES", device)  # (read when UCX starts: before the agent)
    os.environ.setdefault("UCX_LOG_LEVEL", "warn")  # (this UCX build says pages at debug otherwise)
    # UCX takes SIGHUP for its own debug hook by default: the daemon's reload would never run
    os.environ.setdefault("UCX_DEBUG_SIGNO", "0")
    base, size, memory, index = region
    if memory not in ("DRAM", "VRAM"):
        raise BadRequest(f"NIXL cannot register {memory} memory")
    plane = NixlPlane(node_id, incarnation, base, size, memory, index)
    plane.start()
    log.info("NIXL plane: agent %s, %s pool registered (%d bytes), UCX devices %s, transports %s",
             agent_name(node_id, incarnation), memory, size, os.environ.get("UCX_NET_DEVICES", "all"),
             os.environ.get("UCX_TLS", "UCX's choice"))
    return plane


class _Registrable(Protocol):
    """A pool a plane registers (kvd.memory's host and CUDA pools)."""

    def plane_region(self) -> tuple[int, int, str, int]: ...


def start_plane(mode: str, node_id: str, incarnation: int, memory: _Registrable,
                listen_host: str) -> NixlPlane | None:
    """The daemon's one-sided plane for --data-plane: None for zmq, and for auto where NIXL is not
    installed (every link's bytes then go as frames); nixl without NIXL is an error saying what to do."""
    if mode == "zmq":
        return None
    if mode == "auto" and not available():
        log.info("--data-plane auto: NIXL is not installed, every link uses ZeroMQ (%s)", INSTALL_HINT)
        return None
    try:
        return open_nixl(node_id, incarnation, memory.plane_region(), listen_host)
    except PlaneError as exc:
        if mode == "auto":
            log.warning("--data-plane auto: the NIXL plane did not start (%s); every link uses ZeroMQ", exc.message)
            return None
        raise BadRequest(f"--data-plane nixl: {exc.message}") from None

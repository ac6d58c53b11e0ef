"""NIXL with the UCX backend over TCP: one WRITE transfer request per write, two processes.

Runs inside .venv-peers (started by bench/peers.py), imports nothing of kvd. UCX is held to its
TCP transport on loopback (UCX_TLS=tcp, UCX_NET_DEVICES=lo): on one machine it would otherwise
also select cross-memory attach (cma, a copy between the processes), which no network offers.
The agents' metadata goes over the harness's pipe (add_remote_agent), so no NIXL listener port
is opened. Each timed write creates, posts and polls a transfer request until NIXL reports it
DONE, then releases it.

Progress threads: the target needs NIXL's (its main thread only waits on the pipe, and UCX's TCP
transport lands the bytes in software). The initiator has none: its own polling progresses its
UCX worker, and the Python API's thread polls without sleeping, so on 2 cores a third busy
thread made writes wait for the scheduler (every size slower in two alternating pairs of runs on
2026-12-02: medians 1.2-23x, CPU per GB 1.5-16x). That is NIXL_BENCH_PROGRESS=busy, the default.
NIXL_BENCH_PROGRESS=event builds both agents as kvd's daemons build theirs (kvd/daemon/plane/nixl.py):
a progress thread each that sleeps on UCX's event fd up to EVENT_DELAY_US between looks, instead of
polling without pause. UCX_TLS=sm,tcp lets UCX use shared memory (cma moves the bytes), as two
processes of one host would. Prints one JSON object.

kvd's own benchmark (bench/planes.py) runs this script with kvd's .venv too, where NIXL is kvd's.
"""
from __future__ import annotations

import base64
import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from harness import PeerError, main, package_version

os.environ.setdefault("UCX_TLS", "tcp")  # before nixl loads UCX; the target inherits it
os.environ.setdefault("UCX_NET_DEVICES", "lo")
PROGRESS = os.environ.setdefault("NIXL_BENCH_PROGRESS", "busy")  # busy | event (the target inherits it)
EVENT_DELAY_US = 1000  # kvd's PROGRESS_DELAY_US: the event-driven thread's longest sleep
PACKAGE = "nixl"


def _api() -> Any:
    """NIXL's Python API: an installed build's own (the meta package imports torch where it is installed,
    to read which CUDA it runs: seconds, for host memory that needs none of it), else the meta package's."""
    for build in ("nixl_cu12", "nixl_cu13"):
        try:
            return importlib.import_module(f"{build}._api")
        except ModuleNotFoundError as exc:
            if exc.name not in (build, f"{build}._api"):
                raise
    return importlib.import_module("nixl._api")


def agent(name: str, progress_thread: bool) -> Any:
    """A NIXL agent with the UCX backend (both with an event-driven progress thread under `event`)."""
    try:
        api = _api()
    except ImportError as exc:
        raise PeerError(f"import nixl: {exc}", "pip install nixl-cu12 nixl (into .venv-peers)") from exc
    if PROGRESS == "event":
        node = _event_driven(api, name)
    else:
        node = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    if "UCX" not in node.get_plugin_list():
        raise PeerError(f"NIXL has no UCX plugin (plugins: {node.get_plugin_list()})")
    node.create_backend("UCX", {})
    return node


def _event_driven(api: Any, name: str) -> Any:
    """An agent whose progress thread waits on UCX's events (NIXL's Python API fixes its delay at 0:
    its config class is swapped for one that sets ours, as kvd's daemon does)."""
    original = api.nixlBind.nixlAgentConfig

    class EventDriven(original):  # type: ignore[misc,valid-type]
        def __setattr__(self, key: str, value: object) -> None:
            super().__setattr__(key, EVENT_DELAY_US if key == "pthrDelay" else value)

    api.nixlBind.nixlAgentConfig = EventDriven
    try:
        return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=True, backends=[]))
    finally:
        api.nixlBind.nixlAgentConfig = original


def case_name() -> str:
    """The row's name: the transports UCX may use, and the progress threads (the defaults: the peer row's)."""
    tls = os.environ["UCX_TLS"]
    if tls == "tcp" and PROGRESS == "busy":
        return "NIXL UCX-TCP, write"
    return f"NIXL UCX {tls}, write, {PROGRESS} progress"


_keep: list[Any] = []  # agents and their registrations live as long as the process


def register(node: Any, buffer: np.ndarray) -> None:
    _keep.append(node.register_memory([(buffer.ctypes.data, buffer.nbytes, 0, "")], "DRAM"))


def serve(buffer: np.ndarray) -> dict[str, Any]:
    node = agent("target", progress_thread=True)
    register(node, buffer)
    _keep.append(node)
    return {"metadata": base64.b64encode(node.get_agent_metadata()).decode(), "addr": buffer.ctypes.data}


def connect(buffer: np.ndarray, info: dict[str, Any]) -> Callable[[int], None]:
    node = agent("initiator", progress_thread=False)
    register(node, buffer)
    _keep.append(node)
    remote = node.add_remote_agent(base64.b64decode(info["metadata"]))
    local, address = buffer.ctypes.data, info["addr"]

    def write(nbytes: int) -> None:
        handle = node.initialize_xfer("WRITE", node.get_xfer_descs([(local, nbytes, 0)], "DRAM"),
                                      node.get_xfer_descs([(address, nbytes, 0)], "DRAM"), remote)
        try:
            state = node.transfer(handle)
            while state == "PROC":  # each check progresses the worker; a sleep would add latency
                state = node.check_xfer_state(handle)
            if state != "DONE":
                raise PeerError(f"NIXL write of {nbytes} bytes ended in {state}")
        finally:
            node.release_xfer_handle(handle)

    return write


if __name__ == "__main__":
    sys.exit(main(case_name(), "nixl", package_version(PACKAGE), serve, connect))

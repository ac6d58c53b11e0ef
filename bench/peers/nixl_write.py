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
2026-12-02: medians 1.2-23x, CPU per GB 1.5-16x). Prints one JSON object.
"""
from __future__ import annotations

import base64
import os
import sys
from typing import Any
from collections.abc import Callable

import numpy as np

from harness import PeerError, main, package_version

os.environ.setdefault("UCX_TLS", "tcp")  # before nixl loads UCX; the target inherits it
os.environ.setdefault("UCX_NET_DEVICES", "lo")
PACKAGE = "nixl"


def agent(name: str, progress_thread: bool) -> Any:
    """A NIXL agent with the UCX backend."""
    try:
        from nixl import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise PeerError(f"import nixl: {exc}", "pip install nixl-cu12 nixl (into .venv-peers)") from exc
    node = nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread, backends=[]))
    if "UCX" not in node.get_plugin_list():
        raise PeerError(f"NIXL has no UCX plugin (plugins: {node.get_plugin_list()})")
    node.create_backend("UCX", {})
    return node


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
    sys.exit(main("NIXL UCX-TCP, write", "nixl", package_version(PACKAGE), serve, connect))

"""Mooncake Transfer Engine, TCP protocol: synchronous one-sided writes between two processes.

Runs inside .venv-peers (started by bench/peers.py), imports nothing of kvd. Both processes use
P2PHANDSHAKE metadata (no etcd): the initiator names the target by "127.0.0.1:<rpc port>" and
the engine exchanges the segment description on the first write. Prints one JSON object.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from harness import PeerError, main, package_version

PACKAGE = "mooncake-transfer-engine-non-cuda"
HOST = "127.0.0.1"


def engine() -> Any:
    """A TransferEngine on loopback TCP; the import fails without Debian's libibverbs1."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        install = "apt-get install -y libibverbs1" if "libibverbs" in str(exc) else f"pip install {PACKAGE}"
        raise PeerError(f"import mooncake.engine: {exc}", install) from exc
    te = TransferEngine()
    if te.initialize(HOST, "P2PHANDSHAKE", "tcp", "") != 0:
        raise PeerError("TransferEngine.initialize(tcp, P2PHANDSHAKE) failed, see stderr")
    return te


def register(te: Any, buffer: np.ndarray) -> None:
    if te.register_memory(buffer.ctypes.data, buffer.nbytes) != 0:
        raise PeerError(f"register_memory of {buffer.nbytes} bytes failed")


_keep: list[Any] = []  # the engines live as long as the process


def serve(buffer: np.ndarray) -> dict[str, Any]:
    te = engine()
    register(te, buffer)
    _keep.append(te)
    return {"session": f"{HOST}:{te.get_rpc_port()}", "addr": buffer.ctypes.data}


def connect(buffer: np.ndarray, info: dict[str, Any]) -> Callable[[int], None]:
    te = engine()
    register(te, buffer)
    _keep.append(te)
    session, remote, local = info["session"], info["addr"], buffer.ctypes.data

    def write(nbytes: int) -> None:
        status = te.transfer_sync_write(session, local, remote, nbytes)
        if status < 0:
            raise PeerError(f"transfer_sync_write of {nbytes} bytes returned {status}")

    return write


if __name__ == "__main__":
    sys.exit(main("Mooncake TCP, sync write", "mooncake", package_version(PACKAGE), serve, connect))

"""Fixtures that start real `kvd serve` daemons in subprocesses on loopback and temp ipc paths."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import kvd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class DaemonProc:
    node_id: str
    socket: str
    listen: str
    proc: subprocess.Popen
    log_path: Path
    args: list[str] = field(default_factory=list)

    def client(self) -> kvd.Client:
        return kvd.Client(self.socket)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"daemon {self.node_id} did not exit on SIGTERM:\n{self.log()}")
        return self.proc.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(10)


class DaemonFactory:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.daemons: list[DaemonProc] = []

    def start(self, node_id: str = "A", *, peers: dict[str, str] | None = None, port: int | None = None,
              pool_size: str = "64MiB", extra: list[str] | None = None, env: dict[str, str] | None = None,
              wait: bool = True) -> DaemonProc:
        port = port or free_port()
        sock = f"ipc://{self.tmp_path}/{node_id}-{len(self.daemons)}.sock"
        listen = f"tcp://127.0.0.1:{port}"
        args = [sys.executable, "-m", "kvd", "serve", "--node-id", node_id, "--listen", listen,
                "--socket", sock, "--pool-size", pool_size, "--metrics-port", "0", "--log-level", "debug"]
        for name, endpoint in (peers or {}).items():
            args += ["--peer", f"{name}={endpoint}"]
        args += extra or []
        log_path = self.tmp_path / f"{node_id}-{len(self.daemons)}.log"
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen(args, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=full_env)
        daemon = DaemonProc(node_id, sock, listen, proc, log_path, args)
        self.daemons.append(daemon)
        if wait:
            wait_ready(daemon)
        return daemon

    def pair(self, **kwargs) -> tuple[DaemonProc, DaemonProc]:
        port_a, port_b = free_port(), free_port()
        a = self.start("A", port=port_a, peers={"B": f"tcp://127.0.0.1:{port_b}"}, wait=False, **kwargs)
        b = self.start("B", port=port_b, peers={"A": f"tcp://127.0.0.1:{port_a}"}, wait=False, **kwargs)
        wait_ready(a)
        wait_ready(b)
        return a, b


def wait_ready(daemon: DaemonProc, timeout: float = 20.0) -> None:
    path = daemon.socket[len("ipc://"):]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.proc.poll() is not None:
            raise AssertionError(f"daemon {daemon.node_id} exited with {daemon.proc.returncode}:\n{daemon.log()}")
        if os.path.exists(path) and "ready" in daemon.log():
            return
        time.sleep(0.05)
    raise AssertionError(f"daemon {daemon.node_id} not ready after {timeout}s:\n{daemon.log()}")


@pytest.fixture
def daemons(tmp_path):
    factory = DaemonFactory(tmp_path)
    yield factory
    failures = []
    for daemon in factory.daemons:
        if daemon.proc.poll() is None:
            code = daemon.stop()
            if code != 0:
                failures.append(f"{daemon.node_id} exited {code}:\n{daemon.log()[-3000:]}")
    assert not failures, "\n".join(failures)


@pytest.fixture
def daemon(daemons):
    return daemons.start("A")


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c

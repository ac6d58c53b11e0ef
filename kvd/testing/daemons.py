"""Start real `kvd serve` daemons in subprocesses, for tests, benchmarks and examples (runs in the
test's or benchmark's process; the daemons are their own).

Each daemon gets a free loopback port and a unix client socket in a directory you choose;
`stop()` sends SIGTERM and returns the exit code.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..wire.endpoints import unix_path

if TYPE_CHECKING:  # (imported where used: the fixtures must not pull torch in)
    from ..client.aio import AsyncClient
    from ..client.connection import BlockingConnection
    from ..client.sync import Client

_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: set[int] = set()
_pick = random.SystemRandom()  # not the seeded `random`: two test processes must not draw the same ports


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_range() -> tuple[int, int]:
    """[first, end) of the ports free_port draws from: below the kernel's ephemeral range, and under
    pytest-xdist each worker a slice of its own (two workers never draw the same port)."""
    end = min(_ephemeral_low(), 65536)
    first = 10000 if end > 12000 else 1024
    try:
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
        workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    except ValueError:
        worker, workers = 0, 1
    size = (end - first) // workers
    return first + worker % workers * size, first + (worker % workers + 1) * size


def free_port() -> int:
    """A loopback TCP port that nothing listens on and this process never handed out before.

    Drawn below the kernel's ephemeral range, not from bind(port 0): a port the kernel picked and we
    released can be its next pick, for the next caller or for the source port of any outgoing
    connection, before the daemon it was meant for binds it. CI once gave both daemons of one pair
    the same port that way."""
    first, end = port_range()
    if len(_handed_out) > (end - first) // 2:  # a long run: forget the old ones (their daemons are gone)
        _handed_out.clear()
    for _ in range(200):
        port = _pick.randrange(first, end)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {first}-{end - 1} after 200 tries")


@dataclass
class DaemonProc:
    node_id: str
    socket: str
    listen: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    args: list[str] = field(default_factory=list)

    def client(self) -> Client:
        from ..client.sync import Client

        return Client(self.socket)

    def async_client(self) -> AsyncClient:
        from ..client.aio import AsyncClient

        return AsyncClient(self.socket)

    def log(self) -> str:
        return self.log_path.read_text()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"daemon {self.node_id} did not exit on SIGTERM:\n{self.log()}") from None
        return self.proc.returncode

    def kill(self, sig: int = signal.SIGKILL) -> None:
        self.proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            self.proc.wait(10)


class DaemonFactory:
    def __init__(self, workdir: Path, log_level: str = "debug", extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        """extra, env: what every daemon it starts gets too (a test suite run on another data plane)."""
        self.workdir = Path(workdir)
        self.log_level = log_level
        self.extra = list(extra or [])
        self.env = dict(env or {})
        self.daemons: list[DaemonProc] = []

    def start(self, node_id: str = "A", *, peers: dict[str, str] | None = None, port: int | None = None,
              pool_size: str = "64MiB", extra: list[str] | None = None, env: dict[str, str] | None = None,
              wait: bool = True) -> DaemonProc:
        port = port or free_port()
        index = len(self.daemons)
        sock = f"unix://{self.workdir}/{node_id}-{index}.sock"
        listen = f"tcp://127.0.0.1:{port}"
        args = [sys.executable, "-m", "kvd", "serve", "--node-id", node_id, "--listen", listen,
                "--socket", sock, "--pool-size", pool_size, "--metrics-port", "0", "--log-level", self.log_level]
        for name, endpoint in (peers or {}).items():
            args += ["--peer", f"{name}={endpoint}"]
        args += [*self.extra, *(extra or [])]  # (a test's own flags come last: they win)
        log_path = self.workdir / f"{node_id}-{index}.log"
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT,
                                    env={**os.environ, **self.env, **(env or {})})
        daemon = DaemonProc(node_id, sock, listen, proc, log_path, args)
        self.daemons.append(daemon)
        if wait:
            wait_ready(daemon)
        return daemon

    def pair(self, **kwargs: Any) -> tuple[DaemonProc, DaemonProc]:
        """Daemons A and B, each configured with the other as a peer."""
        port_a, port_b = free_port(), free_port()
        a = self.start("A", port=port_a, peers={"B": f"tcp://127.0.0.1:{port_b}"}, wait=False, **kwargs)
        b = self.start("B", port=port_b, peers={"A": f"tcp://127.0.0.1:{port_a}"}, wait=False, **kwargs)
        wait_ready(a)
        wait_ready(b)
        return a, b

    def stop_all(self) -> list[str]:
        """SIGTERM every daemon still running; returns a description of each unclean exit."""
        failures = []
        for daemon in self.daemons:
            if daemon.proc.poll() is None:
                code = daemon.stop()
                if code != 0:
                    failures.append(f"{daemon.node_id} exited {code}:\n{daemon.log()[-3000:]}")
        return failures


def wait_ready(daemon: DaemonProc, timeout: float = 20.0) -> None:
    """Wait until the daemon answers a hello on its client socket."""
    path = unix_path(daemon.socket)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.proc.poll() is not None:
            raise AssertionError(f"daemon {daemon.node_id} exited with {daemon.proc.returncode}:\n{daemon.log()}")
        if (path is None or os.path.exists(path)) and _answers_hello(daemon.socket):
            return
        time.sleep(0.05)
    raise AssertionError(f"daemon {daemon.node_id} not ready after {timeout}s:\n{daemon.log()}")


def eventually(condition: Callable[[], object], timeout: float = 5.0) -> None:
    """Wait until condition() holds, for what a daemon finishes just after a call returns (a
    pulled entry's holder dropping its copy, a departed client's blocks coming back)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def raw_connection(endpoint: str, timeout: float = 5.0) -> BlockingConnection:
    """A bare connection to a daemon's client socket, for sending hand-made messages:
    `.send(frames)`, `.receive(timeout)` -> frames or None, `.close()`."""
    from ..client.connection import BlockingConnection

    return BlockingConnection(endpoint, timeout)


def _answers_hello(endpoint: str) -> bool:
    from ..errors import KvdError
    from ..wire import protocol as p

    try:
        conn = raw_connection(endpoint, 0.5)
    except KvdError:
        return False
    try:
        conn.send(p.encode(p.Hello(req=1, client="wait_ready")))
        frames = conn.receive(0.5)
        return frames is not None and isinstance(p.decode(frames), p.HelloOk)
    except KvdError:
        return False
    finally:
        conn.close()

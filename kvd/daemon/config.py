"""Daemon configuration (daemon process): one frozen dataclass, from defaults < TOML < KVD_* < CLI.

Every field has a default, so `kvd serve` runs bare. Units are parsed here, at the edge
("512MiB", "30s"); the rest of the daemon sees plain ints and floats.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvd.units import parse_duration, parse_size
from kvd.wire.checksum import ALGORITHMS
from kvd.wire.endpoints import LOCAL_SCHEMES, default_socket, tcp_endpoint_problem, unix_path

UNIX_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path) on Linux, the terminating NUL included
DEFAULT_PEER_PORT = 7470
DEFAULT_METRICS_PORT = 9470


@dataclass(frozen=True)
class Config:
    node_id: str = field(default_factory=socket.gethostname)
    listen: str = f"tcp://127.0.0.1:{DEFAULT_PEER_PORT}"  # peer-facing; loopback unless configured
    socket: str = field(default_factory=default_socket)  # local clients
    pool_size: int = 1 << 30
    block_size: int = 64 << 10
    pool_path: str = ""  # empty: memfd (see kvd.memory.host)
    pool_prefault: bool = True
    pool_overcommit: bool = False  # start even when the pool is bigger than the RAM available
    scratch_max: int = 4 << 20  # puts up to this size take one round trip (blocks lent ahead); 0 = off
    device: str = "cpu"
    peers: Mapping[str, str] = field(default_factory=dict)  # name -> tcp:// endpoint
    default_ttl: float = 600.0  # seconds an unread entry is kept; 0 = forever
    lease_timeout: float = 30.0  # a client must finish a put's or get's copy within this
    transfer_timeout: float = 15.0  # a peer transfer fails after this long without progress
    connect_timeout: float = 5.0  # peer handshake deadline
    heartbeat_interval: float = 1.0  # peers are pinged this often
    heartbeat_timeout: float = 5.0  # a peer silent this long is lost; its transfers fail
    drain_timeout: float = 10.0  # on SIGTERM, in-flight transfers get this long to finish
    chunk_size: int = 4 << 20
    window: int = 8  # chunks in flight per transfer
    io_threads: int = 1  # ZeroMQ I/O threads (raise on many cores and fast NICs)
    checksum: str = "xxh3_64"
    # how transfers' bytes move (kvd.daemon.plane): zmq, as chunk frames on the peer connections; nixl, by
    # NIXL's one-sided writes and reads, refusing peers without it; auto, NIXL where both ends have it
    data_plane: str = "zmq"
    log_level: str = "info"
    log_format: str = "text"  # text | json
    metrics_port: int = DEFAULT_METRICS_PORT  # 0 = disabled
    metrics_host: str = "127.0.0.1"
    curve_secret_key: str = ""  # our key pair (from `kvd keygen`); empty: no CURVE
    curve_allow: tuple[str, ...] = ()  # public keys allowed to connect: files, directories, Z85 strings
    curve_ca: str = ""  # the cluster CA's public key (ca.key): admits any peer whose cert it signed
    curve_cert: str = ""  # this node's cert (NODE.cert); empty: beside curve_secret_key, same name
    curve_deny: str = ""  # a file of revoked CURVE public keys (Z85, one a line), re-read on SIGHUP
    insecure: bool = False  # allow a non-loopback --listen (or tcp:// --socket) without authentication
    # bounds: what one client, peer or scraper can make the daemon hold
    max_clients: int = 1024  # local client connections; past it, a new one is answered with an error
    max_peer_connections: int = 1024  # peer connections to our --listen; the newest past it are cut
    max_entries: int = 65536  # entries held (any state); past it a put gets PoolFull
    # the KV tier's budget: a fraction of the pool (0 < x <= 1) or bytes (> 1); 0 = off. A cap, not a
    # reservation: handoffs may take the room back (docs/kv-tier.md)
    cache_size: float = 0.25
    # pages the tier holds, in all and per namespace (0: as many as in all): each page costs about 1 KB
    # of daemon memory beside its pool blocks, so a flood of tiny pages is bounded by count too
    cache_max_pages: int = 1 << 20
    cache_namespace_pages: int = 0
    # the tier's disk level (docs/kv-tier.md): a directory of this user's alone, and its budget (a hard cap
    # on its files); empty: none. Pages go there from RAM and survive a restart
    cache_dir: str = ""
    cache_disk_size: int = 0
    # the cluster registry (kvd.cluster); empty registry: no registry, static peers only
    registry: str = ""  # etcd[s]://[USER:PASS@]HOST:PORT[,HOST:PORT...] | redis[s]://[USER:PASS@]HOST:PORT[/DB]
    registry_password_file: str = ""  # the registry password (first line), instead of one in the URL
    registry_ca: str = ""  # CA bundle that signed the registry's TLS certificate (etcds://, rediss://)
    registry_cert: str = ""  # client certificate for mutual TLS with the registry
    registry_key: str = ""  # its private key
    cluster: str = "kvd"  # scopes every key, so several clusters can share one registry
    advertise: str = ""  # the endpoint peers dial, as published; empty: --listen (not a wildcard)
    registry_ttl: float = 5.0  # a node that dies leaves the registry within about twice this
    registry_publish: str = "pullable"  # pullable | all | none: which entries the holder directory lists
    role: str = "any"  # prefill | decode | any, as routers see this node
    labels: Mapping[str, str] = field(default_factory=dict)  # zone=..., host=...: free-form, published

    def __post_init__(self) -> None:
        # each group checks its own fields, in the order the message lists them
        problems = [*self._endpoint_problems(), *self._pool_problems(), *self._process_problems(),
                    *self._peer_problems(), *self._tier_problems(), *self._cluster_problems()]
        if problems:
            raise ValueError("invalid configuration: " + "; ".join(problems))

    def _endpoint_problems(self) -> list[str]:
        """The node id and the endpoints it listens at."""
        problems = []
        if not self.node_id or len(self.node_id) > 128:
            problems.append("node_id must be 1-128 characters")
        if (problem := tcp_endpoint_problem(self.listen)) is not None:
            problems.append(f"listen {problem}")
        if not self.socket.startswith(LOCAL_SCHEMES):
            problems.append(f"socket must be a unix://PATH (or tcp://) endpoint, got {self.socket!r}")
        elif self.socket.startswith("tcp://") and (problem := tcp_endpoint_problem(self.socket)) is not None:
            problems.append(f"socket {problem}")
        elif (path := unix_path(self.socket)) is not None:
            if not os.path.isabs(path):
                problems.append(f"socket {self.socket!r}: the path must be absolute (unix:///dir/kvd.sock): clients "
                                "elsewhere would look for it relative to their own directory")
            elif len(os.fsencode(path)) >= UNIX_PATH_MAX:
                problems.append(f"socket path {path} is {len(os.fsencode(path))} bytes; a unix socket path has at most "
                                f"{UNIX_PATH_MAX - 1}: choose a shorter --socket (or KVD_RUNTIME_DIR)")
        return problems

    def _pool_problems(self) -> list[str]:
        """The pool, its blocks and chunks, and how transfers use them."""
        problems = []
        if self.block_size < 4096 or self.block_size & (self.block_size - 1):
            problems.append(f"block_size must be a power of two >= 4096, got {self.block_size}")
        if self.pool_size < self.block_size:
            problems.append(f"pool_size {self.pool_size} is smaller than one block")
        if self.chunk_size < self.block_size or self.chunk_size % self.block_size:
            problems.append("chunk_size must be a multiple of block_size")
        if self.scratch_max < 0:
            problems.append("scratch_max must not be negative")
        if self.window < 1:
            problems.append("window must be at least 1")
        if not 1 <= self.io_threads <= 64:
            problems.append("io_threads must be 1-64")
        if self.checksum not in ALGORITHMS:
            problems.append(f"checksum must be one of {ALGORITHMS}")
        if self.data_plane not in ("auto", "zmq", "nixl"):
            problems.append(f"data_plane must be auto, zmq or nixl, got {self.data_plane!r}")
        return problems

    def _process_problems(self) -> list[str]:
        """Logging and the device."""
        problems = []
        if self.log_format not in ("text", "json"):
            problems.append("log_format must be text or json")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            problems.append(f"unknown log_level {self.log_level!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            problems.append(f"device must be cpu or cuda:N, got {self.device!r}")
        return problems

    def _peer_problems(self) -> list[str]:
        """Static peers, liveness, timeouts, CURVE and metrics."""
        problems = []
        for name, endpoint in self.peers.items():
            if not name or not endpoint.startswith("tcp://"):
                problems.append(f"peer {name!r} needs a tcp:// endpoint, got {endpoint!r}")
            elif (problem := tcp_endpoint_problem(endpoint)) is not None:
                problems.append(f"peer {name!r}: {problem}")
        if self.heartbeat_interval <= 0 or self.heartbeat_timeout <= self.heartbeat_interval:
            problems.append("heartbeat_interval must be > 0 and below heartbeat_timeout")
        for name in ("default_ttl", "lease_timeout", "transfer_timeout", "connect_timeout", "drain_timeout"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must not be negative")
        if self.curve_allow and not self.curve_secret_key:
            problems.append("curve_allow needs curve_secret_key (our own key pair)")
        if not 0 <= self.metrics_port < 65536:
            problems.append("metrics_port must be 0-65535")
        return problems

    def _tier_problems(self) -> list[str]:
        """The KV tier and the limits on what clients and peers may hold."""
        problems = []
        if not (self.cache_size >= 0 and self.cache_size != float("inf")):
            problems.append(f"cache_size must be a fraction of the pool (0-1) or a size, got {self.cache_size!r}")
        for name in ("max_clients", "max_peer_connections", "max_entries", "cache_max_pages"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1")
        if self.cache_namespace_pages < 0:
            problems.append("cache_namespace_pages must not be negative (0: as many as cache_max_pages)")
        if self.cache_dir and not os.path.isabs(self.cache_dir):
            problems.append(f"cache_dir must be an absolute path, got {self.cache_dir!r}")
        if self.cache_dir and self.cache_disk_size < 1 << 20:
            problems.append("cache_dir needs cache_disk_size, the disk level's budget: at least 1MiB (e.g. 100GiB)")
        if self.cache_disk_size and not self.cache_dir:
            problems.append("cache_disk_size needs cache_dir (the directory it budgets)")
        if self.cache_dir and self.device != "cpu":
            problems.append("cache_dir needs a host pool (device cpu): a CUDA pool's tier has no disk level")
        return problems

    def _cluster_problems(self) -> list[str]:
        from kvd.cluster.records import ROLES, check_cluster
        from kvd.cluster.url import parse_url

        problems = []
        if self.registry:
            try:
                parse_url(self.registry)
            except ValueError as exc:
                problems.append(str(exc))
            if not self.advertise and _wildcard(self.listen):
                problems.append(f"listen {self.listen} is a wildcard address, which peers cannot dial: set "
                                "advertise (--advertise tcp://HOST:PORT) to the address they reach this node at")
        if self.advertise and self.advertise.startswith("tcp://") and (
                problem := tcp_endpoint_problem(self.advertise)) is not None:
            problems.append(f"advertise {problem}")
        elif self.advertise and (not self.advertise.startswith("tcp://") or _wildcard(self.advertise)):
            problems.append(f"advertise must be a tcp://HOST:PORT peers can dial, got {self.advertise!r}")
        try:
            check_cluster(self.cluster)
        except ValueError as exc:
            problems.append(str(exc))
        if self.registry_ttl < 1:
            problems.append("registry_ttl must be at least 1s")
        if self.registry_publish not in ("pullable", "all", "none"):
            problems.append("registry_publish must be pullable, all or none")
        if self.role not in ROLES:
            problems.append(f"role must be one of {', '.join(ROLES)}")
        for key, value in self.labels.items():
            if not key or not isinstance(value, str):
                problems.append(f"label {key!r} needs a string value")
        return problems

    @property
    def cache_budget(self) -> int:
        """The KV tier's budget in bytes: cache_size of the pool (a fraction) or as given, at most the pool."""
        size = self.pool_size * self.cache_size if self.cache_size <= 1 else self.cache_size
        return int(min(size, self.pool_size))

    @property
    def advertised(self) -> str:
        """The endpoint this node publishes for peers to dial."""
        return self.advertise or self.listen

    def public(self) -> dict[str, Any]:
        """The effective configuration, for the start-up log line and `kvd status`."""
        values = dataclasses.asdict(self)
        values["peers"] = dict(self.peers)
        values["labels"] = dict(self.labels)
        from kvd.cluster.url import redact

        values["registry"] = redact(self.registry)  # a password in the URL never reaches a log
        return values


_SIZES = {"pool_size", "block_size", "chunk_size", "scratch_max", "cache_disk_size"}
_DURATIONS = {"default_ttl", "lease_timeout", "transfer_timeout", "connect_timeout", "heartbeat_interval",
              "heartbeat_timeout", "drain_timeout", "registry_ttl"}
_INTS = {"window", "metrics_port", "io_threads", "max_clients", "max_peer_connections", "max_entries",
         "cache_max_pages", "cache_namespace_pages"}
_BOOLS = {"pool_prefault", "insecure", "pool_overcommit"}
FIELD_NAMES = [f.name for f in dataclasses.fields(Config)]


def parse_peers(items: list[str] | str) -> dict[str, str]:
    """['B=tcp://h:7470', ...] or 'B=tcp://h:7470,C=...' -> {name: endpoint}."""
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    peers: dict[str, str] = {}
    for item in items:
        name, sep, endpoint = item.partition("=")
        if not sep:
            raise ValueError(f"peer must be NAME=tcp://HOST:PORT, got {item!r}")
        peers[name.strip()] = endpoint.strip()
    return peers


def parse_labels(items: list[str] | str) -> dict[str, str]:
    """['zone=a', 'host=h1'] or 'zone=a,host=h1' -> {key: value}."""
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"label must be KEY=VALUE, got {item!r}")
        labels[key.strip()] = value.strip()
    return labels


def _wildcard(endpoint: str) -> bool:
    host = endpoint.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    return host in ("0.0.0.0", "::", "*", "")


def parse_cache_size(value: Any) -> float:
    """'0.25' or 0.25: a fraction of the pool; '2GiB' or '2147483648B': bytes; 0: off. A number
    above 1 without a unit is refused: it read as bytes, and `--cache-size 2` turned the tier off."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"cache_size must be a fraction or a size, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        return float(parse_size(value))
    if number > 1:
        raise ValueError(f"cache_size {value!r} has no unit: a bare number is a fraction of the pool (0-1, e.g. "
                         f"0.5); give a size with its unit (e.g. 2GiB, or {int(number)}B for bytes)")
    return number


def _coerce(name: str, value: Any) -> Any:
    if name == "cache_size":
        return parse_cache_size(value)
    if name in _SIZES:
        return parse_size(value)
    if name in _DURATIONS:
        return parse_duration(value)
    if name in _INTS:
        if isinstance(value, bool) or not (isinstance(value, int)
                                           or (isinstance(value, str) and value.strip().lstrip("-").isdigit())):
            raise ValueError(f"{name} must be a whole number, got {value!r}")
        return int(value)
    if name in _BOOLS:
        if isinstance(value, str):
            if value.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(f"{name}: not a boolean: {value!r}")
            return value.lower() in ("1", "true", "yes", "on")
        return bool(value)
    if name == "peers":
        return parse_peers(value) if isinstance(value, (str, list)) else dict(value)
    if name == "labels":
        return parse_labels(value) if isinstance(value, (str, list)) else {str(k): str(v) for k, v in value.items()}
    if name == "curve_allow":
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(item.strip() for item in items if item.strip())
    return str(value)


def load_config(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> Config:
    """Merge the layers: defaults < file < KVD_* environment < CLI (None means 'not given'). An
    error names where the value came from: the file and key, the variable, or the flag."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}  # field -> where its value came from, for the errors
    config_file = config_file or env.get("KVD_CONFIG")
    if config_file:
        try:
            with open(config_file, "rb") as handle:
                data = tomllib.load(handle)
        except OSError as exc:
            raise ValueError(f"cannot read the config file {config_file}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{config_file}: not valid TOML: {exc}") from None
        if "kvd" in data:  # everything under a [kvd] table; nothing may sit beside it
            table = data["kvd"]
            unknown = set(data) - {"kvd"} | set(table) - set(FIELD_NAMES)
        else:
            table = data
            unknown = set(table) - set(FIELD_NAMES)
        if unknown:
            raise ValueError(f"{config_file}: unknown option(s) "
                             f"{', '.join(_with_closest(name, FIELD_NAMES) for name in sorted(unknown))}")
        for k, v in table.items():
            origins[k] = f"{k} in {config_file}"
            values[k] = _coerce_from(k, v, origins[k])
    for name in FIELD_NAMES:
        raw = env.get(f"KVD_{name.upper()}")
        if raw is not None and raw != "":
            origins[name] = f"KVD_{name.upper()}"
            values[name] = _coerce_from(name, raw, origins[name])
    for name, value in (cli or {}).items():
        if value is not None:
            origins[name] = flag_of(name)
            values[name] = _coerce_from(name, value, origins[name])
    try:
        return Config(**values)
    except ValueError as exc:
        set_by = [origin for name, origin in origins.items() if _mentions(str(exc), name)]
        raise ValueError(f"{exc} (set by {'; '.join(set_by)})" if set_by else str(exc)) from None


def flag_of(name: str) -> str:
    """The `kvd serve` flag that sets a field."""
    return {"peers": "--peer", "labels": "--label", "pool_prefault": "--no-prefault"}.get(
        name, "--" + name.replace("_", "-"))


def _coerce_from(name: str, value: Any, origin: str) -> Any:
    try:
        return _coerce(name, value)
    except (ValueError, TypeError) as exc:  # (TypeError: a TOML value of the wrong kind, e.g. a list)
        text = str(exc) if isinstance(exc, ValueError) else f"{value!r} is not a valid {name}"
        raise ValueError(f"{origin}: {text}") from None


def _mentions(problem: str, name: str) -> bool:
    words = {"peers": r"\bpeer\b", "labels": r"\blabel\b"}.get(name, rf"\b{name}\b")
    return re.search(words, problem) is not None


def _with_closest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1)
    return f"{name} (did you mean {close[0]}?)" if close else name


# KVD_* variables that are no Config field but mean something to kvd, its tools or its tests
OTHER_VARIABLES = {"KVD_CONFIG", "KVD_RUNTIME_DIR", "KVD_VLLM_COMMIT_IN_BACKGROUND", "KVD_VENV", "KVD_TORCH_INDEX",
                   "KVD_ETCD_BIN", "KVD_REDIS_BIN", "KVD_PASSWORD"}


def unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning for each KVD_* variable that sets nothing (a misspelling is ignored otherwise),
    with the closest name it may have meant."""
    env = os.environ if env is None else env
    known = [f"KVD_{name.upper()}" for name in FIELD_NAMES] + sorted(OTHER_VARIABLES)
    return [f"environment variable {_with_closest(var, known)} is not a kvd setting: ignored"
            for var in sorted(env) if var.startswith("KVD_") and var not in known and not var.startswith("KVD_TEST_")]


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_SIZE_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def config_default(name: str) -> Any:
    """A field's default value (computed for the fields with a default_factory)."""
    f = _FIELDS[name]
    if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def shown_default(name: str) -> str | None:
    """A field's default as help text shows it ("1GiB", "600s", "8"), in a form `_coerce` reads
    back. None where there is no one value to show: computed at start (the hostname, the socket
    path), empty (off, or derived from another option), a flag, a list."""
    f = _FIELDS[name]
    value = f.default
    if value is dataclasses.MISSING or isinstance(value, (bool, tuple)) or value == "":
        return None
    if name in _SIZES:
        unit, suffix = next(((u, s) for u, s in _SIZE_UNITS if value and value % u == 0), (1, "B"))
        return f"{value // unit}{suffix}"
    if name in _DURATIONS:
        return f"{value:g}s"
    return str(value)

"""The kv_transfer_params handshake between prefill and decode vLLM instances, and the connector's
options.

Runs in vLLM's scheduler process. Plain data, no vLLM import: it is tested on its own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..client import Client
from .paged.handoff import SaveSpec
from .paged.plans import SourceDeployment

OPTIONS = {"kvd_socket", "kvd_endpoint", "kvd_push_to", "kvd_ttl", "kvd_load_timeout", "kvd_load_threads",
           "kvd_cache", "kvd_salt", "kvd_lookup_timeout"}
CACHE_MODES = ("off", "load", "save", "both")  # prefix reuse through the KV tier: what this engine does


@dataclass(frozen=True)
class ConnectorSettings:
    socket: str | None = None
    endpoint: str | None = None
    push_to: str | None = None
    ttl: float = 300.0
    load_timeout: float = 30.0
    load_threads: int = 4
    cache: str = "off"  # prefix reuse: look prompts up in the tier ("load"), store them ("save"), both
    salt: str | None = None  # a tenant's own namespace of the tier: engines share pages only with equal salts
    lookup_timeout: float = 1.0  # seconds a tier lookup may take before it counts as a miss

    @property
    def cache_loads(self) -> bool:
        return self.cache in ("load", "both")

    @property
    def cache_saves(self) -> bool:
        return self.cache in ("save", "both")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        unknown = sorted(k for k in extra if k.startswith("kvd_") and k not in OPTIONS)
        if unknown:
            raise ValueError(f"unknown kvd options in kv_connector_extra_config: {unknown} (known: {sorted(OPTIONS)})")
        for name in ("kvd_socket", "kvd_endpoint", "kvd_push_to", "kvd_salt"):
            if extra.get(name) is not None and not isinstance(extra[name], str):
                raise ValueError(f"{name} must be a string, got {extra[name]!r}")
        cache = extra.get("kvd_cache", "off")
        if cache not in CACHE_MODES:
            raise ValueError(f"kvd_cache must be one of {', '.join(map(repr, CACHE_MODES))}, got {cache!r}")
        settings = cls(socket=extra.get("kvd_socket"), endpoint=extra.get("kvd_endpoint"),
                       push_to=extra.get("kvd_push_to"), ttl=float(extra.get("kvd_ttl", 300.0)),
                       load_timeout=float(extra.get("kvd_load_timeout", 30.0)),
                       load_threads=int(extra.get("kvd_load_threads", 4)), cache=cache,
                       salt=extra.get("kvd_salt") or None, lookup_timeout=float(extra.get("kvd_lookup_timeout", 1.0)))
        if settings.ttl <= 0 or settings.load_timeout <= 0 or settings.load_threads < 1 or settings.lookup_timeout <= 0:
            raise ValueError("kvd_ttl, kvd_load_timeout and kvd_lookup_timeout must be > 0 and kvd_load_threads "
                             f">= 1: got {settings.ttl}, {settings.load_timeout}, {settings.lookup_timeout}, "
                             f"{settings.load_threads}")
        return settings

    def client(self) -> Client:
        """A connected client of the local daemon. It answers at once: short timeouts keep a dead
        daemon from stalling the engine."""
        return Client(self.socket, reply_timeout=5.0, connect_timeout=2.0).connect()


@dataclass(frozen=True)
class LocalDaemon:
    """What the prefill's scheduler tells decode about its node's daemon (asked once)."""

    endpoint: str | None  # where peers reach it: kvd_endpoint, else its listen address
    directory: bool  # it lists its puts in a cluster registry: decode finds them by request id


def local_daemon(stats: dict[str, Any], endpoint: str | None) -> LocalDaemon:
    """From a daemon's stats: a daemon with a registry lists the entries put with no destination
    (unless started with --registry-publish none; stats name the policy as "publish" where they do)."""
    registry = stats.get("registry") or {}
    lists = bool(registry) and registry.get("publish", "pullable") != "none"
    return LocalDaemon(endpoint or stats.get("listen"), lists)


@dataclass(frozen=True)
class RemoteKV:
    """What a decode request's kv_transfer_params say about its prompt's KV."""

    request_key: str  # the producer's entries are shard_key(request_key, tp, pp)
    num_tokens: int
    source: str | None  # pull from this daemon; None: pushed here, or found through the directory
    producer: SourceDeployment  # the producer's TP/PP layout
    directory: bool = False  # listed in the cluster registry: the local daemon looks each shard up


@dataclass(frozen=True)
class RequestParams:
    """What one request's kv_transfer_params ask of kvd, read once, when the request arrives."""

    produce: bool = False  # a prefill whose KV goes to a decoder (do_remote_decode)
    dest: str | None = None  # where it is pushed (kvd_dest, else kvd_push_to); None: kept here, pulled
    load: RemoteKV | None = None  # a decode request's prompt KV, on some prefill's daemon

    @classmethod
    def parse(cls, params: dict[str, Any] | None, push_to: str | None = None) -> RequestParams:
        """Raises ValueError on malformed kvd params (the request is then computed as a plain one)."""
        produce = bool((params or {}).get("do_remote_decode"))
        return cls(produce, dest_for_prefill(params, push_to) if produce else None, params_for_decode(params))


def params_for_decode(params: dict[str, Any] | None) -> RemoteKV | None:
    """The KV a decode request's kv_transfer_params point at, or None when they do not ask for a kvd
    load. Raises ValueError on malformed kvd params."""
    if not params or not params.get("do_remote_prefill") or "kvd_request_id" not in params:
        return None
    key, num_tokens = params["kvd_request_id"], params.get("kvd_num_tokens")
    if not isinstance(key, str) or not key or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"malformed kvd kv_transfer_params: {params!r}")
    directory = params.get("kvd_directory", False)
    if not isinstance(directory, bool):
        raise ValueError(f"kvd_directory must be true or false, got {directory!r}")
    pushed = bool(params.get("kvd_pushed"))
    # by request id alone when listed: each shard's holder is the directory's to say (the shards of
    # one request may sit on several nodes, which no one kvd_source names)
    source = None if pushed or directory else params.get("kvd_source")
    if source is not None and not isinstance(source, str):
        raise ValueError(f"kvd_source must be an endpoint string, got {source!r}")
    if "kvd_layout" not in params:
        raise ValueError("kvd_layout (the prefill's TP/PP layout) is missing from kv_transfer_params")
    return RemoteKV(key, num_tokens, source, SourceDeployment.from_params(params["kvd_layout"]),
                    directory and not pushed)


def dest_for_prefill(params: dict[str, Any] | None, default: str | None) -> str | None:
    """Where a prefill request's KV is pushed: its own `kvd_dest`, else the connector's default
    (None: kept on the prefill daemon, for decode to pull)."""
    dest = (params or {}).get("kvd_dest") or default
    if dest is not None and not isinstance(dest, str):
        raise ValueError(f"kvd_dest must be a peer name or tcp:// endpoint, got {dest!r}")
    return dest


def params_for_decoder(spec: SaveSpec, source: str | None, engine_id: str | None,
                       deployment: SourceDeployment | None = None, *, directory: bool = False) -> dict[str, Any]:
    """What a finished prefill request returns: the decode request carries it to find the KV.
    Three ways: pushed (`kvd_pushed`: read where it landed), listed (`kvd_directory`, when the
    prefill's daemon lists its puts in a cluster registry: no address at all, decode's daemon asks
    the registry who holds each shard), or pulled from `kvd_source`."""
    pushed = spec.dest is not None
    listed = not pushed and directory
    return {
        "kvd_layout": (deployment or SourceDeployment()).to_params(),
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "kvd_request_id": spec.request_key,
        "kvd_num_tokens": spec.num_tokens,
        "kvd_source": None if listed else source,
        "kvd_pushed": pushed,
        "kvd_directory": listed,
        "kvd_dest": spec.dest,
        "remote_engine_id": engine_id,
    }

"""The backend's settings from SGLang's `--hicache-storage-backend-extra-config` JSON (scheduler process; pure).

SGLang hands the whole JSON to the backend as `storage_config.extra_config`; its own keys
(backend_name, module_path, class_name, interface_v1, prefetch_threshold, ...) sit beside ours.
Ours start with `kvd_`; an unknown one is a mistake (a typo of kvd_salt would silently share a
tenant's pages), so it fails the attach with the list of known ones.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT = 5.0  # seconds a tier call may take before it counts as a miss (SGLang waits on it)


@dataclass(frozen=True)
class Settings:
    socket: str | None = None  # kvd_socket: the local daemon's client socket (None: kvd's default)
    salt: str | None = None  # kvd_salt: the tenant's salt; pages of another salt never match
    timeout: float = DEFAULT_TIMEOUT  # kvd_timeout: seconds per call (connect included)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        known = {"kvd_socket", "kvd_salt", "kvd_timeout"}
        unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("kvd_") and k not in known)
        if unknown:
            raise ValueError(f"unknown kvd setting(s) {', '.join(unknown)} in the HiCache extra config; "
                             f"known: {', '.join(sorted(known))}")
        for name in ("kvd_socket", "kvd_salt"):
            if extra.get(name) is not None and not isinstance(extra[name], str):
                raise ValueError(f"{name} must be a string, got {type(extra[name]).__name__}")
        timeout = extra.get("kvd_timeout", DEFAULT_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"kvd_timeout must be a positive number of seconds, got {timeout!r}")
        return cls(socket=extra.get("kvd_socket") or None, salt=extra.get("kvd_salt") or None,
                   timeout=float(timeout))

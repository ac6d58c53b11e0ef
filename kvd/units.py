"""Parsing of human units at the edge (any process): sizes ("512MiB") and durations ("30s")."""
from __future__ import annotations

import re

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float) -> int:
    """'4GiB' -> 4294967296; ints pass through. Raises ValueError on nonsense."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size must not be negative: {value!r}")
        return int(value)
    match = _NUMBER_UNIT.match(value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (try e.g. 512MiB, 4GiB, 1048576)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def parse_duration(value: str | int | float) -> float:
    """'30s' -> 30.0, '250ms' -> 0.25; plain numbers are seconds."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"duration must not be negative: {value!r}")
        return float(value)
    match = _NUMBER_UNIT.match(value)
    if not match or match.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {value!r} (try e.g. 30s, 250ms, 5m)")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()]


def format_size(nbytes: int) -> str:
    """4294967296 -> '4.0GiB' (for logs and status output)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")

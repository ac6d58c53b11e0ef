"""Rate-limited logging (any kvd process: the daemon, routers, engine processes): at most one line
per key per interval, so that a peer refused every 2 s or a registry holding a million bad records
cannot fill the log.

Pure standard library, so that every package may import it (`kvd.cluster` may not import the
daemon). It decides only whether to log; the caller logs:

    if throttle.allow(key):
        log.warning(...)

`due` also says how many lines of that key were held back since the last one, for a line that
says "(and N more)". Not thread-safe: a caller on several threads holds its own lock.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable

EVERY = 60.0  # seconds between two lines of one key: an operator reads the log, not a stream
KEYS = 1024  # keys remembered at most: a key may come from anyone (a peer's name, a refused key)


class Throttle:
    def __init__(self, interval: float = EVERY, keys: int = KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.keys, self.clock = interval, keys, clock
        self._last: dict[Hashable, float] = {}  # key -> when its last line was let through
        self._held: dict[Hashable, int] = {}  # key -> lines held back since then

    def allow(self, key: Hashable = None) -> bool:
        """Log this one? True at most once per interval per key."""
        return self.due(key) is not None

    def due(self, key: Hashable = None) -> int | None:
        """None: hold this line back. Else log it, saying the number returned: how many lines of
        this key were held back since its last one."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._held[key] = self._held.get(key, 0) + 1
            return None
        if last is None and len(self._last) >= self.keys:  # (bounded: forget everyone, start again)
            self._last.clear()
            self._held.clear()
        self._last[key] = now
        return self._held.pop(key, 0)

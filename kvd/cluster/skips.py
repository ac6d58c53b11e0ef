"""Records a registry backend skipped as it read them: counted, and logged without flooding the log
(the etcd and Redis backends, in whichever process reads the registry).

A registry may be written by an attacker, who can plant a million bad records; each is counted by
(kind, reason) in `dropped` (the backend's `dropped` Counter, kvd_registry_records_dropped_total) and
at most one line per kind and reason is logged a minute, saying how many went unlogged since.
"""
from __future__ import annotations

import logging
from collections import Counter

from kvd.throttle import Throttle

LOG_EVERY = 60.0  # seconds between two lines for one (kind, reason)
_DETAIL = 120  # characters of a key or an error shown in a line; the rest is an attacker's to fill


class Skips:
    def __init__(self, log: logging.Logger, registry: str, every: float = LOG_EVERY) -> None:
        self.log, self.registry, self.every = log, registry, every
        self.dropped: Counter[tuple[str, str]] = Counter()
        self._logged = Throttle(every)  # by (kind, reason)

    def __call__(self, kind: str, reason: str, detail: object) -> None:
        what = (kind, reason)
        self.dropped[what] += 1
        more = self._logged.due(what)
        if more is None:
            return
        text = ascii(detail if isinstance(detail, str) else repr(detail))[1:-1]  # no line breaks of theirs
        self.log.warning("%s: skipped a %s record (%s): %s%s", self.registry, kind, reason, text[:_DETAIL],
                         f" (and {more} more since the last such line)" if more else "")

"""What keeps a failing daemon out of SGLang's threads (SGLang's scheduler process; pure, no SGLang import).

SGLang calls the storage backend from its prefetch and backup threads; an exception there, or a
None from a *_v1 call, ends the thread for good. So every call is wrapped: a failure becomes the
call's miss value, is logged at most once per LOG_EVERY seconds (with how many were not), and a
daemon that is down or not answering is not asked again for RETRY_AFTER seconds, so that each
prefetch costs a miss at once rather than a connect timeout.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvd.errors import BadRequest, KvdError
from kvd.throttle import Throttle

log = logging.getLogger("kvd.sglang")

RETRY_AFTER = 1.0  # seconds without asking a daemon that failed to answer (down, slow, restarting)
LOG_EVERY = 30.0  # seconds between two failure logs


class Guard:
    """Failure accounting shared by a backend's threads: backoff after transport failures, rate-limited logs."""

    def __init__(self, *, retry_after: float = RETRY_AFTER, log_every: float = LOG_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_after = retry_after
        self.log_every = log_every
        self.clock = clock
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._logs = Throttle(log_every, clock=clock)  # (under the lock: the backend's threads share it)
        self.failures = 0  # every failure, for get_stats

    def available(self) -> bool:
        """False while backing off a daemon that just failed to answer."""
        return self.clock() >= self._down_until

    def failed(self, op: str, error: BaseException) -> None:
        """A call failed: back off if the daemon did not answer, log if the last log is old enough."""
        now = self.clock()
        # the daemon's health (down, slow, lost): not a request it refused, nor a fault of ours
        transport = isinstance(error, KvdError) and not isinstance(error, BadRequest)
        with self._lock:
            self.failures += 1
            if transport:
                self._down_until = now + self.retry_after
            suppressed = self._logs.due("failure")
            if suppressed is None:
                return
        level = logging.WARNING if isinstance(error, KvdError) else logging.ERROR
        log.log(level, "kvd HiCache storage: %s failed, answering misses: %s: %s%s", op, type(error).__name__,
                error, f" ({suppressed} more failures since the last report)" if suppressed else "",
                exc_info=error if error.__traceback__ is not None and not isinstance(error, KvdError) else None)

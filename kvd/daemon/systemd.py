"""systemd's notify protocol without libsystemd (daemon process): one datagram per state change.

READY=1 once the pool and listeners are up, WATCHDOG=1 from the event loop while it is
healthy, STOPPING=1 at shutdown. Does nothing when NOTIFY_SOCKET is unset.
"""
from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):  # abstract namespace
            address = "\0" + address[1:]
        self.address = address
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        self.watchdog_interval: float | None = None
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval = int(usec) / 1e6 / 2  # ping at half the deadline, as systemd advises

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def notify(self, state: str) -> None:
        if not self.address:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.connect(self.address)
                sock.sendall(state.encode())
        except OSError as exc:
            log.warning("systemd notify %r failed: %s", state, exc)

"""Where the daemon is in its life (daemon process): one small record the root updates and the
parts that answer for the daemon read (the handlers refuse new work while draining; the status
reader and the health checks report it)."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field


@dataclass
class Lifecycle:
    node_id: str
    incarnation: int = field(default_factory=lambda: random.getrandbits(63))  # new on every start: peers see restarts
    started_at: float = field(default_factory=time.time)
    ready: bool = False  # pool allocated, sockets bound, not draining (/readyz)
    draining: bool = False  # SIGTERM: new work refused, work in flight finishes

"""`kvd.sharded`: layout-aware KV handoff between TP/PP layouts, in worker processes (kvd.client.reshard)."""
from kvd.client.reshard import *  # noqa: F403  (the public path docs/client.md documents)
from kvd.client.reshard import __all__  # noqa: F401

"""`kvd.sharded`: layout-aware KV handoff between TP/PP layouts, in worker processes (kvd.client.sharded)."""
from kvd.client.sharded import *  # noqa: F403  (the public path the README documents)
from kvd.client.sharded import __all__  # noqa: F401

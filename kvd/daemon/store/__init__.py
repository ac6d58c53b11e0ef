"""The daemon's pool bookkeeping (daemon process), pure: no sockets, no asyncio, no memory.

`allocator` hands out fixed-size blocks; `entries` keeps handoff entries by request id, their
states, leases and pins (a block is never handed to another request while anyone may touch it);
`page_store` keeps the KV tier's pages by (namespace, key) in the same pool (budgets, LRU, pins)
and `tier_events` the feed of what was stored and removed, `page_names` what a page may be
called and hold; `intervals` is the byte-range set.
"""

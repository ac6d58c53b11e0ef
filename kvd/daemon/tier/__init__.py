"""The daemon's KV tier (daemon process): evictable pages by (namespace, key), shared across a node
and, with a registry, a cluster.

`service` answers the tier's client messages; `homes` places pages on the cluster's tier nodes
(rendezvous) and serves the other nodes' tier messages; `page_store` is the pure bookkeeping of pages
in the pool (budgets, LRU, pins) and `tier_events` the feed of what was stored and removed; `disk/`
is the level below RAM.
"""

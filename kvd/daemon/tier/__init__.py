"""The daemon's KV tier (daemon process): evictable pages by (namespace, key), shared across a node
and, with a registry, a cluster.

`service` answers the tier's client messages (its reservations and pins are the local core's,
`kvd.daemon.local.ledger`, as a handoff's are); `homes` places pages on the cluster's tier nodes
(rendezvous) and serves the other nodes' tier messages; the pages' bookkeeping is the store's
(`kvd.daemon.store.page_store`); `disk/` is the level below RAM.
"""

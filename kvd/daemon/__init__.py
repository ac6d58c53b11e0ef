"""The per-node daemon process (`kvd serve`).

`daemon.py` is the composition root: it builds the parts below, each given its collaborators,
and runs the process's life (start, housekeeping, reload, drain). `store/` is the pool's pure
bookkeeping; `peer/` is the ZeroMQ side (transfers with other daemons); `local_server` and
`handlers` serve local clients; `watch` knows who waits on which entry; `status` reads the
daemon's state for `kvd status` and Prometheus. Nothing here imports the client library.
"""

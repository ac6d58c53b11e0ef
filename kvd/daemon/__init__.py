"""The per-node daemon process (`kvd serve`).

The top level is the process shell: `startup` builds the parts, each given its collaborators;
`daemon` starts them and runs the process's life (housekeeping, reload, drain); `config`, `http`,
`metrics`, `status`, `membership` (the cluster registry) and the rest serve the process. The rooms
hold the rest: `local/` (the clients on this node), `peer/` (the ZeroMQ side: transfers with other
daemons), `transfer/` (the pure transfer machine), `tier/` (the KV tier, and its disk level),
`plane/` (one-sided data planes) and `store/` (the pool's pure bookkeeping). Nothing here imports
the client library.
"""

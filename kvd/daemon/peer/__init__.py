"""The daemon's ZeroMQ side (daemon process): entries moving between daemons.

`transfers` runs pushes and pulls (offer, accept, chunks, seal, done, abort) over channels;
`window` is the pure send window and receive ledger; `router` is the peer-facing ROUTER
socket; `links` are our DEALERs to peers and `peers` the set of them with their liveness;
`handshake` is one link's handshake as a pure machine, `admission` the ROUTER's side of it;
`loopsocket` drives a ZeroMQ socket from the event loop; `auth` is CURVE; `tcpconn` reads what
the kernel knows about a peer's TCP connection.
"""

"""The daemon's peer side (daemon process): the sockets and links that move entries between daemons.

`transfers` runs the transfer machine's pushes and pulls over channels, with `frameholds` and
`planeio` for bytes that ride frames or a data plane; `router` is the peer-facing ROUTER socket;
`links` are our DEALERs to peers and `peers` the set of them with their liveness; `link_state` is
one link's handshake as a pure machine, `admission` the ROUTER's side of it; `loopsocket` drives a
ZeroMQ socket from the event loop; `auth` is CURVE; `owed` accounts what a peer's socket holds;
`tcpconn` reads what the kernel knows about a peer's TCP connection.
"""

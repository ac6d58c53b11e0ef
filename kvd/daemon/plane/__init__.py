"""One-sided data planes (daemon process): bytes moved by a peer's writes into, or reads out of,
pool memory this daemon registered, under the ZeroMQ control plane (proto/PROTOCOL.md 2.2b).

`base` says what a plane is and what a daemon tells its peers of one; `nixl` is NIXL's (one agent
per daemon, the UCX backend); `poller` runs a plane's operations from the event loop and reports
their ends; `negotiation` settles a link's plane in the hello; `parking` keeps what a plane may still
touch after a failure. The transfer machine decides what moves where; a plane only moves it.
"""

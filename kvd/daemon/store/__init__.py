"""The daemon's pool bookkeeping (daemon process), pure: no sockets, no asyncio, no memory.

`allocator` hands out fixed-size blocks; `entries` keeps entries by request id, their states,
leases and pins (a block is never handed to another request while anyone may touch it);
`intervals` is the byte-range set both use.
"""

"""The daemon's local side (daemon process): the inference workers on this node, as clients.

`server` is the client socket (unix, or TCP with CURVE); `handlers` turns each client message into
calls on the rest; `ledger` is who holds what (reservations, read leases, loans) per connection;
`reservation` is one local write's lifecycle, for handoffs and tier pages alike; `put_side` and
`get_side` serve puts and gets, `shared_pulls` folds concurrent pulls of one entry into one, and
`watch` wakes the clients waiting for an entry.
"""

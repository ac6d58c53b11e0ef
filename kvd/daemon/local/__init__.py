"""The daemon's local side (daemon process): the inference workers on this node, as clients.

The core is pure: `ledger` (`LocalLedger`) is who holds what per connection (reservations, read
leases, loans, tier reservations and pins, waiting gets), moved only by the events of `events` and
answering with actions; `books` holds its records, `audit` its invariants, and `reservation` is one
local write's lifecycle, for handoffs and tier pages alike. The shell carries the actions out:
`server` is the client socket (unix, or TCP with CURVE); `handlers` turns each client message into
events and calls on the rest; `put_side` and `get_side` serve puts and gets, `shared_pulls` folds
concurrent pulls of one entry into one, and `watch` wakes the clients waiting for an entry. The
tier's requests (`tier/service.py`) use the same ledger.
"""

"""What each local client connection holds (daemon process): pure bookkeeping, no sockets.

A connection holds reservations it writes into (a put between put_slots and its commit, each
with its `LocalWrite`), read leases (a get between get_slots and get_done), by token, loans of
scratch blocks (one per small put it may have in flight), and answers it is owed (a push's
put_ok, a locate). Tokens are sequential, so everything is bound to its connection: another
connection naming a token finds nothing. When a connection closes, `gone` says what to give back.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvd.errors import NotFound

from ..store.entries import Entry, Store
from .reservation import LocalWrite

PRUNE_AT = 1024  # per connection: holds tracked before ended ones are pruned


@dataclass(eq=False)
class Hold:
    token: int
    request_id: str
    entry: Entry | None = None  # the reservation (None: a read lease)
    req: int = 0  # the put_alloc that made a reservation: its writer is told on it if the put ends
    stream: bool = False
    write: LocalWrite | None = None  # a reservation's life (made with the hold)

    def __post_init__(self) -> None:
        if self.entry is not None and self.write is None:
            self.write = LocalWrite()

    @property
    def writing(self) -> bool:
        return self.entry is not None


class Holds:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._held: dict[bytes, dict[int, Hold]] = {}  # connection -> what it holds, by token
        self._writers: dict[int, bytes] = {}  # reservation token -> the connection writing it
        self._loans: dict[bytes, dict[int, int]] = {}  # connection -> {token: blocks} lent to it
        self._owed: dict[bytes, int] = {}  # connection -> answers it still waits for, besides its reads

    def owe(self, conn: bytes, count: int) -> None:
        """The connection waits for `count` more (or, negative, fewer) answers."""
        owed = self._owed.get(conn, 0) + count
        if owed > 0:
            self._owed[conn] = owed
        else:
            self._owed.pop(conn, None)

    def owed(self, conn: bytes) -> bool:
        return conn in self._owed

    def loans(self, conn: bytes) -> dict[int, int]:
        """The connection's loans of scratch blocks: token -> blocks."""
        return self._loans.get(conn, {})

    def lend(self, conn: bytes, token: int, blocks: int) -> None:
        self._loans.setdefault(conn, {})[token] = blocks

    def take_loan(self, conn: bytes, token: int | None) -> bool:
        """The connection uses (or returns) the loan `token`: True if it was lent to it."""
        loans = self._loans.get(conn)
        if not loans or loans.pop(token, None) is None:
            return False
        if not loans:
            del self._loans[conn]
        return True

    def hold(self, conn: bytes, hold: Hold) -> None:
        held = self._held.setdefault(conn, {})
        held[hold.token] = hold
        if hold.writing:
            self._writers[hold.token] = conn
        if len(held) > PRUNE_AT:  # a long-lived client whose holds ended otherwise (expiry, delete)
            for stale in [t for t, h in held.items() if not self.is_live(h)]:
                del held[stale]

    def is_live(self, hold: Hold) -> bool:
        """Still something to give back: a lease not released, a reservation whose blocks its
        writer may still write into."""
        if hold.writing:
            return hold.entry.writer
        return self.store.lease_of(hold.token) is not None

    def holds_any(self, conn: bytes) -> bool:
        """The connection has something to give back: a reservation, a read lease, a loan."""
        return bool(self._loans.get(conn)) or any(self.is_live(h) for h in self._held.get(conn, {}).values())

    def release(self, conn: bytes, token: int) -> None:
        held = self._held.get(conn)
        if held is not None and held.pop(token, None) is not None:
            self._writers.pop(token, None)

    def get(self, conn: bytes, token: int) -> Hold | None:
        return self._held.get(conn, {}).get(token)

    def write_hold(self, conn: bytes, token: int, request_id: str) -> Hold:
        """The reservation `token` of this connection (put_part, put_commit name it)."""
        hold = self.get(conn, token)
        if hold is None or not hold.writing or hold.request_id != request_id:
            raise NotFound(f"the put of {request_id!r} with token {token} is not held by this connection "
                           "(committed, aborted, or another connection's)")
        return hold

    def read_hold(self, conn: bytes, token: int) -> Hold:
        hold = self.get(conn, token)
        if hold is None or hold.writing:
            # a read lease is released only by the connection it was given to (a client that
            # reconnected to a restarted daemon must not end another's by number)
            raise NotFound(f"read lease {token} is not held by this connection")
        return hold

    def writer_of(self, entry: Entry) -> tuple[bytes, Hold] | None:
        """The connection writing this reservation, and its hold; forgets the pairing."""
        conn = self._writers.pop(entry.token, None)
        hold = self.get(conn, entry.token) if conn is not None else None
        return (conn, hold) if hold is not None else None

    def stream_hold(self, entry: Entry) -> Hold | None:
        conn = self._writers.get(entry.token)
        return self.get(conn, entry.token) if conn is not None else None

    def gone(self, conn: bytes) -> tuple[list[int], list[Hold]]:
        """A connection closed: its scratch loans (tokens) and the holds still to give back."""
        held = self._held.pop(conn, {})
        self._owed.pop(conn, None)
        for token in [t for t, h in held.items() if h.writing]:
            self._writers.pop(token, None)
        return list(self._loans.pop(conn, {})), [h for h in held.values() if self.is_live(h)]

"""One local connection's holdings (daemon process), as the ledger (`ledger.py`) keeps them: pure
records, changed only by the ledger.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from ..store.entry import Entry
from .reservation import LocalWrite, WriteState

LIVE = (WriteState.WRITING, WriteState.ENDED)  # a write whose writer may still copy into its blocks
# gets and get_streams one local connection may have waiting at once: each holds memory for as long
# as it waits (up to an hour), so one client must not add them without end
MAX_WAITS_PER_CONNECTION = 1024


@dataclass(eq=False)
class Hold:
    """A handoff reservation (entry set) or a read lease (entry None) a connection holds."""

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


@dataclass(eq=False)
class PageHold:
    """A tier reservation (write set: its life; deadline while it is live) or a pin of pages."""

    token: int
    write: LocalWrite | None = None
    deadline: float | None = None  # monotonic: the commit is due by then


@dataclass
class Books:
    """One connection's: by token."""

    held: dict[int, Hold]
    pages: dict[int, PageHold]
    loans: dict[int, int]  # scratch token -> blocks lent
    waits: dict[Hashable, None]  # its gets waiting for their entry, oldest first
    owed: int = 0  # answers it still waits for, besides its reads

    def empty(self) -> bool:
        return not (self.held or self.pages or self.loans or self.waits or self.owed)

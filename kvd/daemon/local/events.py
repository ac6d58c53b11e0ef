"""What the local side's core hears and what it asks for (daemon process): the events the shell
feeds `LocalLedger.handle` and the actions it gets back. Pure data: no sockets, no loop.

An event is something that happened to a local client's holdings (a reservation made, a write
announced, a commit, a read lease given or released, a connection lost, a lease tick, a push's
outcome). An action is what the shell must carry out beyond the bookkeeping the ledger did
itself (it frees and parks blocks in the Store and the page store): a message to a client, an
entry's end told to its stream readers and transfers, a log line or a counter.
"""
from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from kvd.errors import KvdError

from ..store.entry import Entry, Lease
from ..store.page_store import Page

# --- events: handoffs (entries in the Store) ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reserved:
    """put_alloc: `conn` reserved `entry` (the Store made it, pinned for its writer)."""

    conn: bytes
    entry: Entry
    req: int  # the put_alloc's req: its writer is told on it if the put ends under it
    stream: bool


@dataclass(frozen=True, slots=True)
class Wrote:
    """put_part: the writer says more of its tensors are in."""

    conn: bytes
    token: int
    request_id: str


@dataclass(frozen=True, slots=True)
class Commit:
    """put_commit: every byte is in."""

    conn: bytes
    token: int
    request_id: str


@dataclass(frozen=True, slots=True)
class Abort:
    """The writer deletes its own reservation (a delete naming its token)."""

    conn: bytes
    token: int
    request_id: str


@dataclass(frozen=True, slots=True)
class Remove:
    """Someone removes an entry in any state (a delete, a stream reader that consumed it, a push
    that failed before its commit): whoever still works on it must hear why."""

    entry: Entry
    error: KvdError


@dataclass(frozen=True, slots=True)
class WriteExpired:
    """The Store's sweep removed an entry whose write did not finish within its lease."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class PushRefused:
    """A push could not start (an unknown peer): the put it was for ends at once, unheard (its
    request gets the error); `conn` is the writer when the push started at its put_alloc."""

    entry: Entry
    conn: bytes | None


@dataclass(frozen=True, slots=True)
class PushEnded:
    """A transfer's outcome: the push of a local put ended (`error`: why it failed)."""

    entry: Entry
    error: KvdError | None


@dataclass(frozen=True, slots=True)
class Lent:
    """The connection was lent scratch blocks (`token`) for its next small put."""

    conn: bytes
    token: int
    blocks: int


@dataclass(frozen=True, slots=True)
class LoanReturned:
    """A put_alloc gives a loan back (give_back): its blocks return to the pool if it was lent."""

    conn: bytes
    token: int | None


@dataclass(frozen=True, slots=True)
class LoanUsed:
    """A one-round-trip put names the loan it filled: it becomes the entry's (NotFound if not lent)."""

    conn: bytes
    token: int | None


@dataclass(frozen=True, slots=True)
class LeaseGiven:
    """get_slots reached the connection: it holds the read lease `token` until its get_done."""

    conn: bytes
    token: int
    request_id: str


@dataclass(frozen=True, slots=True)
class Release:
    """get_done: the reader copied out (consume: it took the entry)."""

    conn: bytes
    token: int
    consume: bool


@dataclass(frozen=True, slots=True)
class Undelivered:
    """A read lease whose get_slots found its client gone: it goes back at once."""

    token: int


@dataclass(frozen=True, slots=True)
class AnswerOwed:
    """The connection waits for one more answer (a push's put_ok, a locate): it is not idle.
    `count` is -1 when the answer went."""

    conn: bytes
    count: int = 1


@dataclass(frozen=True, slots=True)
class WaitStarted:
    """A get or get_stream of the connection waits for its entry: `wait` is the shell's handle on it
    (a task, or a get parked in the entry watch), called off if the connection goes. The shell asks
    `LocalLedger.admit_wait` first."""

    conn: bytes
    wait: Hashable


@dataclass(frozen=True, slots=True)
class WaitEnded:
    """The wait is over (answered, timed out, cancelled); a wait already called off is ignored."""

    conn: bytes
    wait: Hashable


# --- events: the KV tier's pages (in the page store) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class PagesReserved:
    """cache_put: `conn` reserved pages under `token` (the page store made them); its commit is due
    by `deadline` (monotonic)."""

    conn: bytes
    token: int
    deadline: float


@dataclass(frozen=True, slots=True)
class PagesCommit:
    """cache_commit: the writer copied its pages (ok) or gave up (not ok)."""

    conn: bytes
    token: int
    ok: bool


@dataclass(frozen=True, slots=True)
class PagesPinned:
    """cache_get: `conn` pins its hits under `token` until its cache_release."""

    conn: bytes
    token: int


@dataclass(frozen=True, slots=True)
class PagesRelease:
    """cache_release (or a pin whose reader left before its answer): a stale token is ignored."""

    conn: bytes
    token: int


# --- events: both -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    """The client hung up: everything it held goes back, as it would at lease expiry."""

    conn: bytes


@dataclass(frozen=True, slots=True)
class LeaseTick:
    """Housekeeping at `now` (monotonic): tier reservations past their deadline end."""

    now: float


Event = (Reserved | Wrote | Commit | Abort | Remove | WriteExpired | PushRefused | PushEnded | Lent | LoanReturned
         | LoanUsed | LeaseGiven | Release | Undelivered | AnswerOwed | WaitStarted | WaitEnded | PagesReserved
         | PagesCommit | PagesPinned | PagesRelease | ConnectionLost | LeaseTick)

# --- actions ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tell:
    """Send the error to the connection on `req` (a writer whose put ended under it)."""

    conn: bytes
    req: int
    error: KvdError


@dataclass(frozen=True, slots=True)
class Copied:
    """The writer's announced tensors are in: renew its lease, tell stream readers and the push."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class Publish:
    """Every byte of the write is in: publish the entry (and push it, if it has a destination)."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class Fail:
    """Answer the request with this error (its blocks were let go already)."""

    error: KvdError


@dataclass(frozen=True, slots=True)
class Ended:
    """The entry was removed: its stream readers (when `readers`) and transfers hear why."""

    entry: Entry
    error: KvdError
    readers: bool


@dataclass(frozen=True, slots=True)
class Abandoned:
    """A put was dropped because its writer hung up before committing (a counter)."""

    entry: Entry


@dataclass(frozen=True, slots=True)
class LeaseEnded:
    """A read lease went back unread: the entry is readable again, its waiters wake."""

    lease: Lease


@dataclass(frozen=True, slots=True)
class Released:
    """get_done carried out in the Store: what the shell needs for counters and waiters."""

    entry: Entry
    lease: Lease | None  # as it was before the release (None: released already)
    claiming: bool  # the lease still claimed the entry (it had not run out)
    consume: bool


@dataclass(frozen=True, slots=True)
class Answer:
    """Answer the request with this value (Ok)."""

    value: object


@dataclass(frozen=True, slots=True)
class PagesPublished:
    """A tier commit published its pages (`published[i]`: whether `pages[i]` became visible)."""

    pages: list[Page]
    published: list[bool]


@dataclass(frozen=True, slots=True)
class PagesExpired:
    """Tier reservations ran out (`count` now, `total` so far): a warning, rate limited."""

    count: int
    total: int


@dataclass(frozen=True, slots=True)
class CallOff:
    """The connection went: end these waits of its unanswered (cancel the tasks, unpark the gets)."""

    waits: tuple[Hashable, ...]


@dataclass(frozen=True, slots=True)
class GaveBack:
    """A lost connection left `writes` unfinished puts and `reads` open reads (a warning)."""

    writes: int
    reads: int


Action = (Tell | Copied | Publish | Fail | Ended | Abandoned | LeaseEnded | Released | Answer | PagesPublished
          | PagesExpired | CallOff | GaveBack)

"""A local write's life (daemon process): one put, from its put_slots to its end, as a small
state machine. Pure: no sockets, no store; `put_side.py` carries the actions out.

A local client reserves an entry (put_alloc), copies its tensors into the pool, may announce a
stream's parts as written (put_part), and commits (put_commit) or gives up (a delete naming its
token). The entry can also end under it: deleted, its lease ran out, its push failed. Its writer
may still be copying then, so its blocks stay parked (the store's writer pin) until the writer
lets go: told why at once, its next write is ignored, its commit fails with the reason, and its
commit, abort or hang-up frees the blocks. `TABLE` is all of it, on `kvd.statetable`'s engine (a row's
`does` is the action to carry out; `describe()` prints it, "same" keeping the state):

| state | event | when | does | next |
|---|---|---|---|---|
| writing | write |  | copied | same |
| writing | commit |  | publish | committed |
| writing | abort, gone |  | drop | released |
| writing | removed |  | tell | ended |
| writing, ended | removed_unheard |  | free | released |
| ended | write, removed |  | nothing | same |
| ended | commit |  | fail | released |
| ended | abort, gone |  | free | released |

committed and released are final: the connection no longer holds the write, so no event can
name it (a put_part or commit after them is NotFound before it reaches the machine); the table
refuses every event there, with that reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from kvd.errors import InternalError, KvdError
from kvd.statetable import Table


class WriteState(Enum):
    WRITING = "writing"  # reserved: the writer copies in, its blocks pinned for it
    ENDED = "ended"  # removed under a connected writer, who was told why; blocks parked for it
    COMMITTED = "committed"  # every byte in and published: the write is over, the entry lives on
    RELEASED = "released"  # the write is over and its writer let go: its blocks can go with the entry


class WriteEvent(Enum):
    WRITE = "write"  # put_part: the writer says these tensors are in
    COMMIT = "commit"  # put_commit
    ABORT = "abort"  # the writer deletes its own reservation (delete with its token)
    REMOVED = "removed"  # the entry was removed (deleted, expired, its push failed), its writer connected
    REMOVED_UNHEARD = "removed_unheard"  # the same, with nobody left who could hear of it
    GONE = "gone"  # the writer's connection closed


class WriteAction(Enum):
    COPIED = "copied"  # note the tensors written (stream readers, the push), renew the lease
    PUBLISH = "publish"  # publish the entry: it is complete
    DROP = "drop"  # remove the entry (ending whatever works on it), then let go of its blocks
    TELL = "tell"  # tell the writer why, on its put_alloc's req; its blocks stay parked
    FAIL = "fail"  # let go of the blocks; the commit is answered with why the write ended
    FREE = "free"  # let go of the blocks: nobody will copy into them any more
    NOTHING = "nothing"  # the writer was told already


S, E, A = WriteState, WriteEvent, WriteAction
FINAL = frozenset({S.COMMITTED, S.RELEASED})


def _rows(table: Table[WriteState, WriteAction]) -> Table[WriteState, WriteAction]:
    """A row's `does` is the action itself: the shell carries it out."""
    add = table.add
    add([S.WRITING], E.WRITE, A.COPIED)
    add([S.WRITING], E.COMMIT, A.PUBLISH, S.COMMITTED)
    add([S.WRITING], E.ABORT, A.DROP, S.RELEASED)
    add([S.WRITING], E.REMOVED, A.TELL, S.ENDED)
    add([S.WRITING], E.REMOVED_UNHEARD, A.FREE, S.RELEASED)
    add([S.WRITING], E.GONE, A.DROP, S.RELEASED)
    add([S.ENDED], E.WRITE, A.NOTHING)
    add([S.ENDED], E.COMMIT, A.FAIL, S.RELEASED)
    add([S.ENDED], E.ABORT, A.FREE, S.RELEASED)
    add([S.ENDED], E.REMOVED, A.NOTHING)  # (once removed, an entry is not removed again)
    add([S.ENDED], (E.REMOVED_UNHEARD, E.GONE), A.FREE, S.RELEASED)
    table.refuse(FINAL, tuple(WriteEvent), "the write is over: its connection no longer holds it, so no event "
                                           "names it (a put_part or commit is NotFound before it gets here)")
    return table


TABLE: Table[WriteState, WriteAction] = _rows(Table(WriteState, WriteEvent))
_STEPS = TABLE.compile()


@dataclass(eq=False)
class LocalWrite:
    """One reservation's life as its writer's connection holds it."""

    state: WriteState = WriteState.WRITING
    ended: KvdError | None = None  # why the entry ended under its writer (the error its commit gets)

    def step(self, event: WriteEvent, error: KvdError | None = None) -> WriteAction:
        """Move on `event` (`error`: why the entry was removed); returns what to carry out."""
        steps = _STEPS.get((self.state, event))
        if steps is None:  # refused: a final write (the shell forgot the hold, or let an event through twice)
            raise InternalError(f"a local write that is {self.state.value} cannot take {event.value}: "
                                f"{TABLE.refusal(self.state, event)}")
        _, action, self.state = steps[0]  # (one row a pair, none with a guard)
        if event is WriteEvent.REMOVED and action is WriteAction.TELL:
            self.ended = error
        return action

    @property
    def live(self) -> bool:
        """The writer may still write, and its put can still succeed."""
        return self.state is WriteState.WRITING

    def validate(self, pinned: bool, removed: bool) -> None:
        """What must hold between two events, given the store's view of the entry: `pinned`
        (its writer pin) and `removed`. Checked by the tests after every step."""
        if self.state in (S.WRITING, S.ENDED):
            assert pinned, f"a {self.state.value} write whose blocks are not pinned for its writer"
        if self.state is S.ENDED:
            assert removed and self.ended is not None, "an ended write needs its entry removed, and why"
        if self.state is S.WRITING:  # (every removal of a reservation goes through the machine)
            assert not removed and self.ended is None, "a live write whose entry is gone, or that ended"
        if self.state is S.RELEASED:
            assert not pinned, "a released write still pins its blocks"


def describe() -> str:
    """The table as markdown, as the module docstring shows it."""
    return TABLE.markdown(code=False, event_name=lambda event: str(getattr(event, "value", event)))

"""The transfer protocol as one table (daemon process): in each state, for each event, what the
machine does and the state it leaves the transfer in. Nothing else decides a transfer's next
state; `machine.py` looks the row up, runs the handler it names and assigns the state.

A row is (state, event, when, does, next). Rows of one state and event are tried in order; the
first whose `when` holds (a guard, a pure test of the transfer and the event) is taken, and the
last of them has none. `does` names a `Machine` method. Three rules hold outside the rows:

- a peer message whose event has no row in the transfer's state is a protocol error that fails
  the transfer (`abort`, code 6, to the peer); in `no transfer` such a message is dropped;
- a handler that raises a kvd error fails the transfer (its peer told), whatever the row said;
- a message for a transfer that runs on another connection is dropped before any lookup.

`no transfer` is where a message is looked up when no live transfer has its id: the rows that
start one, and those that drop what comes for one that ended. The table is the protocol's
documentation: `markdown()` writes the transfer table of proto/PROTOCOL.md, and a test holds
the two equal (`python -m kvd.daemon.transfer.table` prints it).
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvd.wire import protocol as p

from ..store.entries import State
from .states import (
    NONE,
    Cancel,
    ChannelLost,
    Commit,
    Connected,
    ConnectFailed,
    EntryMissing,
    EntryReady,
    OpEnded,
    R,
    S,
    Tick,
    Written,
)

# chunks every sender sends right after the offer, before the receiver accepts (wasted if it
# refuses); a receiver whose whole entry fits in them needs no accept (proto/PROTOCOL.md)
EAGER_CHUNKS = 2


@dataclass(frozen=True)
class Guard:
    says: str
    test: Callable[[Any, Any], bool]  # (transfer, event): their types are the row's state's and event's

    def __call__(self, transfer, event) -> bool:
        return self.test(transfer, event)


@dataclass(frozen=True)
class Row:
    state: enum.Enum
    event: type
    when: Guard | None
    does: str  # a Machine method, without its underscore
    next: enum.Enum


# --- guards -----------------------------------------------------------------------------------------

CARRIES_ALL = Guard("it carries its whole entry",
                    lambda t, e: e.lengths is not None and sum(e.lengths) == e.total_bytes)
CARRIES_PART = Guard("it carries less than its entry", lambda t, e: e.lengths is not None)
SEALED_EMPTY = Guard("sealed, 0 bytes", lambda t, e: e.sealed and e.total_bytes == 0)
SEALED_SMALL = Guard(f"sealed, at most {EAGER_CHUNKS} chunks",
                     lambda t, e: e.sealed and e.total_bytes <= EAGER_CHUNKS * e.chunk_size)
SEALED = Guard("sealed", lambda t, e: e.sealed)
EMPTY = Guard("not sealed, 0 bytes", lambda t, e: e.total_bytes == 0)
OTHER_GENERATION = Guard("its entry is not the generation the pull asked for",
                         lambda t, e: t.pull.expect_gen is not None and e.entry.token != t.pull.expect_gen)
BEING_WRITTEN = Guard("a local put is still writing it", lambda t, e: e.entry.state is State.WRITING)
ALL_SENT = Guard("every chunk was sent", lambda t, e: t.window.all_sent)
COMPLETES = Guard("its bytes complete the entry",
                  lambda t, e: t.ledger.received_bytes + sum(e.lengths) == t.ledger.total_bytes)
PRODUCER_IDLE = Guard("nothing in flight, bytes still to be written",
                      lambda t, e: not t.window.in_flight and t.window.queued_bytes < t.window.total_bytes)
STALLED = Guard("no progress for transfer_timeout", lambda t, e: t.deadline <= e.now)
# a one-sided plane (PROTOCOL.md 2.2b)
ON_PLANE = Guard("the link has a plane, and the entry is big enough for it",
                 lambda t, e: t.channel.plane is not None and t.entry.total_bytes >= t.plane_min)
PULLED_ON_PLANE = Guard("the puller reads over the link's plane, and the entry is sealed and big enough",
                        lambda t, e: t.pull.plane is not None and t.pull.plane == t.channel.plane
                        and e.entry.state is not State.WRITING and e.entry.total_bytes >= t.plane_min)
PLANE_OFFER = Guard("it is for the plane", lambda t, e: e.plane is not None)
# a holder's answer to a pull of ours that ended meanwhile (its abort and `released` are on their way to
# the holder): no push to grant, which would park our blocks for a `released` that never comes
LENDS = Guard("it lends the holder's blocks (a pull's answer)", lambda t, e: e.plane is not None
              and e.regions is not None)
PLANE_SEALED = Guard("it is for the plane, sealed", lambda t, e: e.plane is not None and e.sealed)
OP_FAILED = Guard("the operation failed", lambda t, e: e.error is not None)
ALL_PLACED = Guard("every slice was written and said placed",
                   lambda t, e: t.window.all_sent and not t.ops and not t.placed)
PLACED_COMPLETES = Guard("its bytes complete the entry",
                         lambda t, e: t.ledger.received_bytes + e.length == t.ledger.total_bytes)
READ_COMPLETES = Guard("its slice completes the entry",
                       lambda t, e: t.ledger.received_bytes + t.slices[e.seq][1] == t.ledger.total_bytes)

# --- the rows ---------------------------------------------------------------------------------------

ON_A_PLANE_SENDING = (S.ASKED, S.STREAM_ASKED, S.PLACING, S.STREAM_PLACING, S.LENT)
ON_A_PLANE_RECEIVING = (R.GRANTED, R.STREAM_GRANTED, R.READING)
SENDER_LIVE = (S.WAITING, S.CONNECTING, S.STREAM_CONNECTING, S.OFFERED, S.STREAM_OFFERED, S.SENDING,
               S.STREAM_SENDING, *ON_A_PLANE_SENDING)
RECEIVER_LIVE = (R.PULLING, R.RECEIVING, R.RECEIVING_SMALL, R.STREAMING, R.STREAMED, *ON_A_PLANE_RECEIVING)
SENDER_OFFERED = (S.OFFERED, S.STREAM_OFFERED, S.SENDING, S.STREAM_SENDING,
                  *ON_A_PLANE_SENDING)  # the peer knows of it
PEER_MESSAGES = (p.Offer, p.Pull, p.Accept, p.Chunk, p.ChunkAck, p.Seal, p.Done, p.Abort, p.Grant, p.Placed)
_FAILED, _DONE, _SAME = "failed", "done", "same"  # resolved for each row's state


def _rows() -> list[Row]:
    rows: list[Row] = []

    def add(states, events, does: str, next=_SAME, when: Guard | None = None) -> None:
        for state in states:
            for event in events if isinstance(events, tuple) else (events,):
                sender = isinstance(state, S)
                target = {_SAME: state, _FAILED: S.FAILED if sender else R.FAILED,
                          _DONE: S.DONE if sender else R.DONE}.get(next, next)
                rows.append(Row(state, event, when, does, target))

    # starting: an offer (pushed to us, or answering our pull), a pull we serve
    add([NONE], p.Offer, "ignore", when=LENDS)
    add([NONE], p.Offer, "grant_offer", R.GRANTED, PLANE_SEALED)  # (its bytes come by the plane)
    add([NONE], p.Offer, "grant_offer", R.STREAM_GRANTED, PLANE_OFFER)
    add([R.PULLING], p.Offer, "read_offer", R.READING, PLANE_OFFER)
    for state in (NONE, R.PULLING):
        add([state], p.Offer, "take_offer_with_entry", R.DONE, CARRIES_ALL)
        add([state], p.Offer, "take_offer_with_chunk", R.RECEIVING_SMALL, CARRIES_PART)
        add([state], p.Offer, "take_offer_and_publish", R.DONE, SEALED_EMPTY)
        add([state], p.Offer, "take_offer", R.RECEIVING_SMALL, SEALED_SMALL)
        add([state], p.Offer, "accept_offer", R.RECEIVING, SEALED)
        add([state], p.Offer, "accept_offer", R.STREAMED, EMPTY)
        add([state], p.Offer, "accept_offer", R.STREAMING)
    add([NONE], p.Pull, "serve", S.WAITING)
    add([NONE], p.Ping, "pong")
    add([NONE], p.Pong, "ignore")
    # what comes for a transfer that ended (or that we refused, or never heard of): dropped
    add([NONE], (p.Accept, p.Chunk, p.ChunkAck, p.Seal, p.Done, p.Abort), "ignore")
    add([NONE], (p.Grant, p.Placed, p.Released), "ignore")
    add([NONE], (Connected, ConnectFailed, Written, Commit, EntryReady, EntryMissing, Cancel, OpEnded), "ignore")

    # a pull we serve, waiting for its entry (the pull's timeout is its own timer: WaitForEntry)
    add([S.WAITING], EntryReady, "refuse_generation", _FAILED, OTHER_GENERATION)
    add([S.WAITING], EntryReady, "lend_entry", S.LENT, PULLED_ON_PLANE)
    add([S.WAITING], EntryReady, "offer_stream_entry", S.STREAM_OFFERED, BEING_WRITTEN)
    add([S.WAITING], EntryReady, "offer_entry", S.OFFERED)
    add([S.WAITING], EntryMissing, "fail_missing", _FAILED)
    add([S.WAITING], (Written, Commit, Tick), "ignore")  # its offer takes the entry as it is then

    # a push, waiting for its link (whose handshake has its own deadline; a lost link dials again)
    add([S.CONNECTING], Connected, "ask", S.ASKED, ON_PLANE)
    add([S.CONNECTING], Connected, "offer", S.OFFERED)
    add([S.STREAM_CONNECTING], Connected, "ask_stream", S.STREAM_ASKED, ON_PLANE)
    add([S.STREAM_CONNECTING], Connected, "offer_stream", S.STREAM_OFFERED)
    add([S.CONNECTING, S.STREAM_CONNECTING], ConnectFailed, "fail_unconnected", _FAILED)
    add([S.CONNECTING, S.STREAM_CONNECTING], (ChannelLost, Tick), "ignore")
    add([S.STREAM_CONNECTING], Written, "queue")
    add([S.STREAM_CONNECTING], Commit, "ignore", S.CONNECTING)  # its offer will be sealed

    # sending
    add([S.CONNECTING, S.OFFERED, S.SENDING], (Written, Commit), "ignore")  # every byte is queued, sealed
    add([S.OFFERED], p.Accept, "open_window", S.SENDING)
    add([S.STREAM_OFFERED], p.Accept, "open_window", S.STREAM_SENDING)
    add([S.SENDING, S.STREAM_SENDING], p.ChunkAck, "ack_and_send")
    add([S.STREAM_OFFERED, S.STREAM_SENDING], Written, "queue_and_send")
    add([S.STREAM_OFFERED], Commit, "seal", S.OFFERED)
    add([S.STREAM_SENDING], Commit, "seal", S.SENDING)
    add([S.OFFERED, S.SENDING], p.Done, "finish_sending", _DONE, ALL_SENT)
    add([S.OFFERED, S.SENDING], p.Done, "refuse_early_done", _FAILED)
    add([S.STREAM_OFFERED, S.STREAM_SENDING], p.Done, "refuse_unsealed_done", _FAILED)  # published only once sealed
    add([S.STREAM_OFFERED, S.STREAM_SENDING], Tick, "wait_for_producer", when=PRODUCER_IDLE)

    # sending on a plane: a push's writes (each said placed once it ended), a pull's reads of what we lent
    add([S.ASKED], p.Grant, "take_grant", S.PLACING)
    add([S.STREAM_ASKED], p.Grant, "take_grant", S.STREAM_PLACING)
    add([S.ASKED, S.PLACING, S.LENT], (Written, Commit), "ignore")  # every byte is queued, sealed
    add([S.STREAM_ASKED, S.STREAM_PLACING], Written, "queue_and_send")  # (written once granted)
    add([S.STREAM_ASKED], Commit, "seal", S.ASKED)
    add([S.STREAM_PLACING], Commit, "seal", S.PLACING)
    add([S.PLACING, S.STREAM_PLACING], OpEnded, "fail_op", _FAILED, OP_FAILED)
    add([S.PLACING, S.STREAM_PLACING], OpEnded, "say_placed")  # (and the next slice goes: no ack awaited)
    add([S.PLACING], p.Done, "finish_sending", _DONE, ALL_PLACED)
    add([S.ASKED, S.PLACING], p.Done, "refuse_early_done", _FAILED)
    add([S.STREAM_ASKED, S.STREAM_PLACING], p.Done, "refuse_unsealed_done", _FAILED)
    add([S.STREAM_ASKED, S.STREAM_PLACING], Tick, "wait_for_producer", when=PRODUCER_IDLE)
    add([S.LENT], p.Done, "finish_sending", _DONE)  # (the puller's reads are over: it read every slice)

    # receiving
    add([R.RECEIVING, R.RECEIVING_SMALL], p.Chunk, "store_and_publish", _DONE, COMPLETES)  # done acks it
    add([R.RECEIVING], p.Chunk, "store_and_ack")
    add([R.RECEIVING_SMALL], p.Chunk, "store")
    add([R.STREAMING], p.Chunk, "store_and_ack", R.STREAMED, COMPLETES)
    add([R.STREAMING], p.Chunk, "store_and_ack")
    add([R.RECEIVING, R.RECEIVING_SMALL], p.Seal, "ignore")
    add([R.STREAMING], p.Seal, "ignore", R.RECEIVING)
    add([R.STREAMED], p.Seal, "publish", R.DONE)

    # receiving on a plane: what the sender's plane placed in our ranges, what ours read
    add([R.GRANTED], p.Placed, "take_placed_and_publish", R.DONE, PLACED_COMPLETES)  # done answers them all
    add([R.GRANTED], p.Placed, "take_placed")
    add([R.STREAM_GRANTED], p.Placed, "take_placed", R.STREAMED, PLACED_COMPLETES)
    add([R.STREAM_GRANTED], p.Placed, "take_placed")
    add([R.GRANTED], p.Seal, "ignore")
    add([R.STREAM_GRANTED], p.Seal, "ignore", R.GRANTED)
    add([R.READING], OpEnded, "fail_op", _FAILED, OP_FAILED)
    add([R.READING], OpEnded, "take_read_and_publish", R.DONE, READ_COMPLETES)
    add([R.READING], OpEnded, "take_read")

    # endings, in every state where they may come
    timed = (R.PULLING, R.RECEIVING, R.RECEIVING_SMALL, R.STREAMING, R.STREAMED, *ON_A_PLANE_RECEIVING,
             *SENDER_OFFERED)
    add(timed, Tick, "fail_stalled", _FAILED, STALLED)
    add(timed, Tick, "ignore")
    talking = (S.WAITING, *SENDER_OFFERED, *RECEIVER_LIVE)  # the peer knows of them
    add(talking, p.Abort, "fail_by_peer", _FAILED)
    add(talking, ChannelLost, "fail_lost", _FAILED)
    add((*SENDER_LIVE, *RECEIVER_LIVE), Cancel, "fail_cancelled", _FAILED)
    add((*SENDER_LIVE, *RECEIVER_LIVE), p.Pull, "refuse_id_in_use", _FAILED)  # one transfer per id
    add((*SENDER_LIVE, *RECEIVER_LIVE[1:]), p.Offer, "refuse_id_in_use", _FAILED)
    return rows


TABLE: list[Row] = _rows()


def compile_rows(handler: Callable[[str], Callable]) -> dict[tuple, tuple]:
    """(state, event type) -> ((guard's test, handler, next state), ...) in the table's order."""
    compiled: dict[tuple, list] = {}
    for row in TABLE:
        test = row.when.test if row.when is not None else None
        compiled.setdefault((row.state, row.event), []).append((test, handler(row.does), row.next))
    return {key: tuple(rows) for key, rows in compiled.items()}


# --- the table as documentation -----------------------------------------------------------------------

def event_name(event: type) -> str:
    if hasattr(event, "TYPE"):
        return f"`{event.TYPE}`"
    return "".join("_" + c.lower() if c.isupper() else c for c in event.__name__).lstrip("_")


def markdown() -> str:
    """The table as markdown, rows that differ only in their state or their event merged ("same":
    the state is kept). A merged row keeps its place among the rows of each state and event (it
    carries its rank there), so the first row that holds is still the one taken."""
    by_state: dict[tuple, list] = {}
    rank: dict[tuple, int] = {}
    for row in TABLE:
        place = rank[row.state, row.event] = rank.get((row.state, row.event), -1) + 1
        next_state = "same" if row.next is row.state else row.next.value
        by_state.setdefault((row.event, row.when, row.does, next_state, place), []).append(row.state)
    by_event: dict[tuple, list] = {}
    for (event, when, does, next_state, place), states in by_state.items():
        by_event.setdefault((tuple(states), when, does, next_state, place), []).append(event)
    lines = ["| state | event | when | does | next |", "|---|---|---|---|---|"]
    for (states, when, does, next_state, _), events in by_event.items():
        lines.append(f"| {_states(states)} | {', '.join(map(event_name, events))} | {when.says if when else ''} "
                     f"| `{does}` | {next_state} |")
    return "\n".join(lines) + "\n"


def _states(states: tuple) -> str:
    live = (*SENDER_LIVE, *RECEIVER_LIVE)
    missing = [s for s in live if s not in states]
    if set(states) <= set(live) and len(missing) <= 2:
        return "any" + "".join(f" but {s.value}" if i == 0 else f", {s.value}" for i, s in enumerate(missing))
    return ", ".join(s.value for s in states)


if __name__ == "__main__":
    print(markdown(), end="")

"""The transfer protocol as one table (daemon process): in each state, for each event, what the
machine does and the state it leaves the transfer in. Nothing else decides a transfer's next
state; `machine.py` looks the row up, runs its handler and assigns the state. The engine is
`kvd.statetable`'s, as for a link's handshake and a local write.

A row is (state, event, when, does, next). Rows of one state and event are tried in order; the
first whose `when` holds (a guard, a pure test of the transfer and the event) is taken, and the
last of them has none. `does` is the handler itself (`sending.py`, `receiving.py`, `onesided.py`,
`failures.py`): it returns actions, a row that fails its `Fail`. Three rules hold outside the rows:

- a peer message whose event has no row in the transfer's state is a protocol error that fails
  the transfer (`abort`, code 6, to the peer); in `no transfer` such a message is dropped; every
  such pair of the table's states and events is refused below, with its reason (a test holds
  the table to no pair that is neither handled nor refused);
- a handler that raises a kvd error fails the transfer (its peer told), whatever the row said;
- a message for a transfer that runs on another connection is dropped before any lookup.

`no transfer` is where a message is looked up when no live transfer has its id: the rows that
start one, and those that drop what comes for one that ended. The table is the protocol's
documentation: `markdown()` writes the transfer table of proto/PROTOCOL.md, and a test holds
the two equal (`python -m kvd.daemon.transfer.table` prints it).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

from kvd.statetable import Guard, Table
from kvd.wire import protocol as p

from ..store.entry import State
from .failures import (
    fail_by_peer,
    fail_cancelled,
    fail_lost,
    fail_missing,
    fail_stalled,
    fail_unconnected,
    refuse_early_done,
    refuse_generation,
    refuse_id_in_use,
    refuse_unsealed_done,
)
from .onesided import (
    ask,
    ask_stream,
    fail_op,
    grant_offer,
    lend_entry,
    read_offer,
    say_placed,
    take_grant,
    take_placed,
    take_placed_and_publish,
    take_read,
    take_read_and_publish,
)
from .receiving import (
    accept_offer,
    publish,
    store,
    store_and_ack,
    store_and_publish,
    take_offer,
    take_offer_and_publish,
    take_offer_with_chunk,
    take_offer_with_entry,
)
from .sending import (
    EAGER_CHUNKS,
    ack_and_send,
    finish_sending,
    offer,
    offer_entry,
    offer_stream,
    offer_stream_entry,
    open_window,
    queue,
    queue_and_send,
    seal,
    serve,
    wait_for_producer,
)
from .states import (
    LOCAL_EVENTS,
    NONE,
    Action,
    Books,
    Cancel,
    ChannelLost,
    Commit,
    Connected,
    ConnectFailed,
    EntryMissing,
    EntryReady,
    NoTransfer,
    OpEnded,
    R,
    ReceiverState,
    S,
    Send,
    SenderState,
    Tick,
    Written,
)

TransferState: TypeAlias = SenderState | ReceiverState | NoTransfer
# a row's handler: (the machine's books, the transfer or in `no transfer` the channel, the event) -> actions
Handler = Callable[[Books, Any, Any], list[Action]]


def ignore(m: Books, transfer: object, event: object) -> list[Action]:
    return []


def pong(m: Books, channel: Any, msg: p.Ping) -> list[Action]:
    return [Send(channel, p.Pong(nonce=msg.nonce))]


def failed(state: TransferState) -> TransferState:
    """`next` for a row that fails: its side's FAILED."""
    return S.FAILED if isinstance(state, S) else R.FAILED


def done(state: TransferState) -> TransferState:
    return S.DONE if isinstance(state, S) else R.DONE


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


def _rows(table: Table[TransferState, Handler]) -> Table[TransferState, Handler]:
    add = table.add

    # starting: an offer (pushed to us, or answering our pull), a pull we serve
    add([NONE], p.Offer, ignore, when=LENDS)
    add([NONE], p.Offer, grant_offer, R.GRANTED, PLANE_SEALED)  # (its bytes come by the plane)
    add([NONE], p.Offer, grant_offer, R.STREAM_GRANTED, PLANE_OFFER)
    add([R.PULLING], p.Offer, read_offer, R.READING, PLANE_OFFER)
    for state in (NONE, R.PULLING):
        add([state], p.Offer, take_offer_with_entry, R.DONE, CARRIES_ALL)
        add([state], p.Offer, take_offer_with_chunk, R.RECEIVING_SMALL, CARRIES_PART)
        add([state], p.Offer, take_offer_and_publish, R.DONE, SEALED_EMPTY)
        add([state], p.Offer, take_offer, R.RECEIVING_SMALL, SEALED_SMALL)
        add([state], p.Offer, accept_offer, R.RECEIVING, SEALED)
        add([state], p.Offer, accept_offer, R.STREAMED, EMPTY)
        add([state], p.Offer, accept_offer, R.STREAMING)
    add([NONE], p.Pull, serve, S.WAITING)
    add([NONE], p.Ping, pong)
    add([NONE], p.Pong, ignore)
    # what comes for a transfer that ended (or that we refused, or never heard of): dropped
    add([NONE], (p.Accept, p.Chunk, p.ChunkAck, p.Seal, p.Done, p.Abort), ignore)
    add([NONE], (p.Grant, p.Placed, p.Released), ignore)
    add([NONE], (Connected, ConnectFailed, Written, Commit, EntryReady, EntryMissing, Cancel, OpEnded), ignore)

    # a pull we serve, waiting for its entry (the pull's timeout is its own timer: WaitForEntry)
    add([S.WAITING], EntryReady, refuse_generation, failed, OTHER_GENERATION)
    add([S.WAITING], EntryReady, lend_entry, S.LENT, PULLED_ON_PLANE)
    add([S.WAITING], EntryReady, offer_stream_entry, S.STREAM_OFFERED, BEING_WRITTEN)
    add([S.WAITING], EntryReady, offer_entry, S.OFFERED)
    add([S.WAITING], EntryMissing, fail_missing, failed)
    add([S.WAITING], (Written, Commit, Tick), ignore)  # its offer takes the entry as it is then

    # a push, waiting for its link (whose handshake has its own deadline; a lost link dials again)
    add([S.CONNECTING], Connected, ask, S.ASKED, ON_PLANE)
    add([S.CONNECTING], Connected, offer, S.OFFERED)
    add([S.STREAM_CONNECTING], Connected, ask_stream, S.STREAM_ASKED, ON_PLANE)
    add([S.STREAM_CONNECTING], Connected, offer_stream, S.STREAM_OFFERED)
    add([S.CONNECTING, S.STREAM_CONNECTING], ConnectFailed, fail_unconnected, failed)
    add([S.CONNECTING, S.STREAM_CONNECTING], (ChannelLost, Tick), ignore)
    add([S.STREAM_CONNECTING], Written, queue)
    add([S.STREAM_CONNECTING], Commit, ignore, S.CONNECTING)  # its offer will be sealed

    # sending
    add([S.CONNECTING, S.OFFERED, S.SENDING], (Written, Commit), ignore)  # every byte is queued, sealed
    add([S.OFFERED], p.Accept, open_window, S.SENDING)
    add([S.STREAM_OFFERED], p.Accept, open_window, S.STREAM_SENDING)
    add([S.SENDING, S.STREAM_SENDING], p.ChunkAck, ack_and_send)
    add([S.STREAM_OFFERED, S.STREAM_SENDING], Written, queue_and_send)
    add([S.STREAM_OFFERED], Commit, seal, S.OFFERED)
    add([S.STREAM_SENDING], Commit, seal, S.SENDING)
    add([S.OFFERED, S.SENDING], p.Done, finish_sending, done, ALL_SENT)
    add([S.OFFERED, S.SENDING], p.Done, refuse_early_done, failed)
    add([S.STREAM_OFFERED, S.STREAM_SENDING], p.Done, refuse_unsealed_done, failed)  # published only once sealed
    add([S.STREAM_OFFERED, S.STREAM_SENDING], Tick, wait_for_producer, when=PRODUCER_IDLE)

    # sending on a plane: a push's writes (each said placed once it ended), a pull's reads of what we lent
    add([S.ASKED], p.Grant, take_grant, S.PLACING)
    add([S.STREAM_ASKED], p.Grant, take_grant, S.STREAM_PLACING)
    add([S.ASKED, S.PLACING, S.LENT], (Written, Commit), ignore)  # every byte is queued, sealed
    add([S.STREAM_ASKED, S.STREAM_PLACING], Written, queue_and_send)  # (written once granted)
    add([S.STREAM_ASKED], Commit, seal, S.ASKED)
    add([S.STREAM_PLACING], Commit, seal, S.PLACING)
    add([S.PLACING, S.STREAM_PLACING], OpEnded, fail_op, failed, OP_FAILED)
    add([S.PLACING, S.STREAM_PLACING], OpEnded, say_placed)  # (and the next slice goes: no ack awaited)
    add([S.PLACING], p.Done, finish_sending, done, ALL_PLACED)
    add([S.ASKED, S.PLACING], p.Done, refuse_early_done, failed)
    add([S.STREAM_ASKED, S.STREAM_PLACING], p.Done, refuse_unsealed_done, failed)
    add([S.STREAM_ASKED, S.STREAM_PLACING], Tick, wait_for_producer, when=PRODUCER_IDLE)
    add([S.LENT], p.Done, finish_sending, done)  # (the puller's reads are over: it read every slice)

    # receiving
    add([R.RECEIVING, R.RECEIVING_SMALL], p.Chunk, store_and_publish, done, COMPLETES)  # done acks it
    add([R.RECEIVING], p.Chunk, store_and_ack)
    add([R.RECEIVING_SMALL], p.Chunk, store)
    add([R.STREAMING], p.Chunk, store_and_ack, R.STREAMED, COMPLETES)
    add([R.STREAMING], p.Chunk, store_and_ack)
    add([R.RECEIVING, R.RECEIVING_SMALL], p.Seal, ignore)
    add([R.STREAMING], p.Seal, ignore, R.RECEIVING)
    add([R.STREAMED], p.Seal, publish, R.DONE)

    # receiving on a plane: what the sender's plane placed in our ranges, what ours read
    add([R.GRANTED], p.Placed, take_placed_and_publish, R.DONE, PLACED_COMPLETES)  # done answers them all
    add([R.GRANTED], p.Placed, take_placed)
    add([R.STREAM_GRANTED], p.Placed, take_placed, R.STREAMED, PLACED_COMPLETES)
    add([R.STREAM_GRANTED], p.Placed, take_placed)
    add([R.GRANTED], p.Seal, ignore)
    add([R.STREAM_GRANTED], p.Seal, ignore, R.GRANTED)
    add([R.READING], OpEnded, fail_op, failed, OP_FAILED)
    add([R.READING], OpEnded, take_read_and_publish, R.DONE, READ_COMPLETES)
    add([R.READING], OpEnded, take_read)

    # endings, in every state where they may come
    timed = (R.PULLING, R.RECEIVING, R.RECEIVING_SMALL, R.STREAMING, R.STREAMED, *ON_A_PLANE_RECEIVING,
             *SENDER_OFFERED)
    add(timed, Tick, fail_stalled, failed, STALLED)
    add(timed, Tick, ignore)
    talking = (S.WAITING, *SENDER_OFFERED, *RECEIVER_LIVE)  # the peer knows of them
    add(talking, p.Abort, fail_by_peer, failed)
    add(talking, ChannelLost, fail_lost, failed)
    add((*SENDER_LIVE, *RECEIVER_LIVE), Cancel, fail_cancelled, failed)
    add((*SENDER_LIVE, *RECEIVER_LIVE), p.Pull, refuse_id_in_use, failed)  # one transfer per id
    add((*SENDER_LIVE, *RECEIVER_LIVE[1:]), p.Offer, refuse_id_in_use, failed)
    return table


def _refusals(table: Table[TransferState, Handler]) -> Table[TransferState, Handler]:
    """Why every other pair of a state and an event has no row (what the machine then does is the
    rule above: a protocol error that fails a live transfer, a drop in `no transfer`)."""
    refuse, live = table.refuse, (*SENDER_LIVE, *RECEIVER_LIVE)
    ended = (S.DONE, S.FAILED, R.DONE, R.FAILED)
    refuse(ended, EVENTS, "an ended transfer is no longer held: what comes for its id is looked up in no transfer")
    refuse([NONE], (Tick, ChannelLost), "handed to each live transfer (of that connection), never to no transfer")
    refuse(live, (p.Ping, p.Pong), "a ping carries no transfer id: it is looked up in no transfer")
    refuse(live, p.Released, "the plane's I/O takes every released before the machine (planeio.py)")
    refuse(live, (Connected, ConnectFailed), "only a push waiting for its link is told how its handshake went")
    refuse(live, (EntryReady, EntryMissing), "only a served pull waiting for its entry is told of it")
    refuse(RECEIVER_LIVE, (Written, Commit), "only a push hears of its producer's writes and commit")
    refuse(live, OpEnded, "only a transfer whose own plane operations run hears of their end")
    refuse(live, PEER_MESSAGES, "the peer broke the protocol: the transfer fails (abort, code 6)")
    return table


STATES = (NONE, *S, *R)
EVENTS = (*PEER_MESSAGES, p.Ping, p.Pong, p.Released, *LOCAL_EVENTS)
TABLE: Table[TransferState, Handler] = _refusals(_rows(Table(STATES, EVENTS)))


# --- the table as documentation -----------------------------------------------------------------------

def event_name(event: Any) -> str:
    if hasattr(event, "TYPE"):
        return f"`{event.TYPE}`"
    return "".join("_" + c.lower() if c.isupper() else c for c in event.__name__).lstrip("_")


def markdown() -> str:
    """The table as markdown, rows that differ only in their state or their event merged ("same":
    the state is kept; `statetable.Table.markdown`)."""
    return TABLE.markdown(event_name=event_name, states_name=_states)


def _states(states: tuple[TransferState, ...]) -> str:
    live = (*SENDER_LIVE, *RECEIVER_LIVE)
    missing = [s for s in live if s not in states]
    if set(states) <= set(live) and len(missing) <= 2:
        return "any" + "".join(f" but {s.value}" if i == 0 else f", {s.value}" for i, s in enumerate(missing))
    return ", ".join(s.value for s in states)


if __name__ == "__main__":
    print(markdown(), end="")

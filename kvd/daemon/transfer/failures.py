"""The transfer machine's handlers for the rows that fail a transfer (daemon process; pure): each
returns one `Fail`, the error the transfer ends with and whether the peer is told (an abort);
the machine turns it into the abort, the entry's drop and the `Finished`. A failure is an action
like any other: these rows are the table's `next: failed`, and a handler elsewhere that raises a
kvd error fails its transfer the same way.
"""
from __future__ import annotations

from kvd.errors import NotFound, PeerUnavailable, ProtocolError, error_from_code
from kvd.statetable import Fail
from kvd.wire import protocol as p

from .states import (
    Action,
    Books,
    Cancel,
    ChannelLost,
    ConnectFailed,
    EntryMissing,
    EntryReady,
    Outbound,
    Tick,
    Transfer,
)


def fail_missing(m: Books, out: Outbound, event: EntryMissing) -> list[Action]:
    return [Fail(event.error)]


def fail_unconnected(m: Books, out: Outbound, event: ConnectFailed) -> list[Action]:
    return [Fail(event.error, notify=False)]  # nothing was sent


def fail_cancelled(m: Books, transfer: Transfer, event: Cancel) -> list[Action]:
    return [Fail(event.error, event.notify)]


def fail_by_peer(m: Books, transfer: Transfer, msg: p.Abort) -> list[Action]:
    return [Fail(error_from_code(msg.code, msg.message, remote=transfer.channel.peer_name), notify=False)]


def fail_lost(m: Books, transfer: Transfer, event: ChannelLost) -> list[Action]:
    # told: a peer that only stalled drops its half of the transfer when it resumes
    return [Fail(PeerUnavailable(event.reason))]


def fail_stalled(m: Books, transfer: Transfer, tick: Tick) -> list[Action]:
    return [Fail(PeerUnavailable(f"no progress from peer {transfer.channel.peer_name} for "
                                 f"{m.limits.transfer_timeout:g}s"))]


def refuse_generation(m: Books, out: Outbound, event: EntryReady) -> list[Action]:
    return [Fail(NotFound(f"{event.entry.request_id!r} on {m.node_id} is not the generation asked for "
                          f"(a stale hint)"))]


def refuse_early_done(m: Books, out: Outbound, msg: p.Done) -> list[Action]:
    return [Fail(ProtocolError("done before every chunk was sent"))]


def refuse_unsealed_done(m: Books, out: Outbound, msg: p.Done) -> list[Action]:
    # (taken as the end, it would consume an entry its writer has not committed)
    return [Fail(ProtocolError("done before the seal"))]


def refuse_id_in_use(m: Books, transfer: Transfer, msg: p.Pull | p.Offer) -> list[Action]:
    return [Fail(ProtocolError("transfer id in use"))]  # never two transfers under one id

"""What must hold of a transfer machine between any two events (daemon process), as Dask's
worker state machine checks its own (`validate_state`): `Machine.validate()` calls this after
every step of the property tests. It reads, never changes, and is too slow for the hot path. A
broken invariant of one transfer is raised keyed by its id (`InvariantBroken`), so that
`validate()` can tell that transfer's story.

- every transfer held is live (no terminal state), under its own id, in a state its kind has;
- a sender holds a lease on its entry that still claims it (none while WAITING), no two
  senders share a lease, and its window says what its state says (all of a sealed entry
  queued, nothing sent while connecting, no ack before accept, acks and chunks in flight add up);
- a receiver's entry is the store's live, RECEIVING entry of that id, its blocks still there,
  its ledger and the entry's missing bytes agree, and STREAMED (only it) has every byte;
  no two receivers share an entry, and every RECEIVING entry in the store has its receiver;
- on a one-sided plane (its states, and only they, have one): a sender has sent nothing before the
  grant (or while lending), and after it has one `placed` waiting for each write of its own running;
  a receiver's entry is pinned for the plane's writer (only then), and one that reads has the
  holder's ranges and slices, its reads window and its ledger in step.
"""
from __future__ import annotations

import itertools

from kvd.statetable import InvariantBroken
from kvd.wire.layout import blocks_needed

from ..store.entries import State
from .states import KIND_STATES, STREAM_SENDER, TERMINAL, Books, Inbound, Kind, Outbound, R, S, Transfer

PLANE_SENDER = frozenset({S.ASKED, S.STREAM_ASKED, S.PLACING, S.STREAM_PLACING, S.LENT})
PLANE_RECEIVER = frozenset({R.GRANTED, R.STREAM_GRANTED, R.READING})


def check_machine(machine: Books) -> None:
    """Raise InvariantBroken, keyed by the transfer it concerns, for the first invariant that does not hold."""
    leases: set[int] = set()
    entries: set[int] = set()
    for xfer, transfer in machine.transfers.items():
        try:
            _check_transfer(machine, xfer, transfer, leases, entries)
        except InvariantBroken:
            raise
        except AssertionError as exc:
            raise InvariantBroken(xfer, str(exc)) from exc
    # only a receiver reserves an entry RECEIVING: one left in the store with none is lost blocks
    for entry in machine.store.entries.values():
        assert entry.state is not State.RECEIVING or id(entry) in entries, \
            f"{entry.request_id!r} is receiving, but no transfer receives it"


def _check_transfer(machine: Books, xfer: int, transfer: Transfer, leases: set[int], entries: set[int]) -> None:
    where = f"transfer {xfer:x} ({transfer.kind.value}, {transfer.state.value})"
    assert transfer.xfer == xfer, f"{where} is held under another id"
    assert transfer.state not in TERMINAL, f"{where} has ended but is still held"
    assert transfer.state in KIND_STATES[transfer.kind], f"{where}: a state a {transfer.kind.value} never has"
    if isinstance(transfer, Outbound):
        _check_sender(machine, transfer, where, leases)
    else:
        _check_receiver(machine, transfer, where, entries)


def _check_sender(machine: Books, out: Outbound, where: str, leases: set[int]) -> None:
    assert (out.kind is Kind.SERVE) == (out.pull is not None), f"{where}: a served pull, and only one, has a pull"
    if out.state is S.WAITING:
        assert out.entry is None and out.window is None and out.lease_token == 0, f"{where} holds an entry"
        return
    entry, window = out.entry, out.window
    assert entry is not None and window is not None, f"{where} has no entry or no window"
    lease = machine.store.lease_of(out.lease_token)
    assert lease is not None and out.lease_token in entry.leases, f"{where}: its lease is not the store's"
    assert lease.claiming, f"{where}: its lease no longer claims the entry"
    assert lease.consume == (out.pull is None or not out.pull.keep), f"{where}: its lease consumes wrongly"
    assert out.lease_token not in leases, f"{where} shares its lease with another transfer"
    leases.add(out.lease_token)
    assert sum(n for _, n in entry.extents) >= blocks_needed(entry.total_bytes, machine.store.block_size), \
        f"{where}: its entry's blocks are gone"
    assert window.total_bytes == entry.total_bytes, f"{where}: the window is not its entry's"
    assert sum(n for _, n in window.chunks) == window.queued_bytes <= window.total_bytes, f"{where}: queued bytes"
    covered = sorted(window.chunks)
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(covered)), f"{where}: chunks overlap"
    assert window.next_seq <= len(window.chunks), f"{where}: sent chunks that are not queued"
    assert all(0 <= seq < window.next_seq for seq in window.in_flight), f"{where}: in flight but never sent"
    assert window.acked + len(window.in_flight) == window.next_seq, f"{where}: acks and chunks in flight"
    if out.state not in STREAM_SENDER:
        assert window.queued_bytes == window.total_bytes, f"{where}: sealed with bytes not queued"
    if out.state in (S.CONNECTING, S.STREAM_CONNECTING):
        assert window.next_seq == 0, f"{where}: sent before its link was up"
    if out.state in (S.OFFERED, S.STREAM_OFFERED):
        assert window.acked == 0, f"{where}: acked before accept"
    _check_plane_sender(machine, out, where)


def _check_plane_sender(machine: Books, out: Outbound, where: str) -> None:
    entry, window = out.sending()
    assert (out.plane is not None) == (out.state in PLANE_SENDER), f"{where}: its plane is {out.plane}"
    if out.plane is None:
        assert out.regions is None and out.ops == 0 and not out.placed, f"{where}: plane operations off a plane"
        return
    assert out.plane == out.channel.plane, f"{where}: on plane {out.plane}, its link on {out.channel.plane}"
    assert entry.total_bytes >= out.plane_min, f"{where}: an entry too small for the plane rides it"
    assert window.chunk_size == machine.limits.slice_bytes, f"{where}: not cut into slices"
    if out.state is not S.PLACING and out.state is not S.STREAM_PLACING:  # asked, or lent: nothing sent
        assert window.next_seq == 0 and out.regions is None, f"{where}: wrote before a grant"
        assert out.ops == 0 and not out.placed, f"{where}: plane operations before a grant"
        if out.state is S.LENT:
            assert entry.state in (State.READY, State.CLAIMED), f"{where}: lends an entry that is {entry.state}"
        return
    regions = out.regions
    assert regions is not None and sum(n for _, n in regions) == entry.total_bytes, f"{where}: its grant"
    assert out.ops == len(out.placed), f"{where}: {out.ops} writes running, {len(out.placed)} placed to say"
    assert set(out.placed) <= window.in_flight, f"{where}: a placed waits for a slice not in flight"
    assert all((msg.offset, msg.length) == window.chunks[seq] for seq, msg in out.placed.items()), \
        f"{where}: a placed that is not its slice's"
    assert len(window.in_flight) <= machine.limits.plane_in_flight, f"{where}: more writes than its window"


def _check_receiver(machine: Books, inbound: Inbound, where: str, entries: set[int]) -> None:
    if inbound.state is R.PULLING:
        assert inbound.entry is None and inbound.ledger is None, f"{where} holds an entry before the offer"
        assert inbound.plane is None and inbound.reads is None, f"{where} reads before the offer"
        return
    entry, ledger = inbound.entry, inbound.ledger
    assert entry is not None and ledger is not None, f"{where} has no entry or no ledger"
    assert not entry.removed and machine.store.entries.get(inbound.request_id) is entry, \
        f"{where}: its entry is not the store's"
    assert entry.state is State.RECEIVING, f"{where}: its entry is {entry.state.value}"
    assert id(entry) not in entries, f"{where} shares its entry with another transfer"
    entries.add(id(entry))
    assert sum(n for _, n in entry.extents) >= blocks_needed(entry.total_bytes, machine.store.block_size), \
        f"{where}: its entry's blocks are gone"
    assert ledger.total_bytes == entry.total_bytes, f"{where}: the ledger is not its entry's"
    assert sum(entry.remaining) == entry.total_bytes - ledger.received_bytes, \
        f"{where}: the entry's missing bytes are not the ledger's"
    assert ledger.complete == (inbound.state is R.STREAMED), f"{where}: complete only once streamed"
    _check_plane_receiver(machine, inbound, where)


def _check_plane_receiver(machine: Books, inbound: Inbound, where: str) -> None:
    entry, ledger = inbound.receiving()
    if inbound.state in PLANE_RECEIVER:
        assert inbound.plane is not None, f"{where} has no plane"
    if inbound.plane is not None:  # (STREAMED too, after a plane's stream: its seal is still to come)
        assert inbound.state in PLANE_RECEIVER or inbound.state is R.STREAMED, f"{where} has a plane"
        assert inbound.plane == inbound.channel.plane, f"{where}: on {inbound.plane}, its link on another"
    # the plane's writer (the peer's writes, our reads) may write into the entry until its end: pinned
    assert entry.writer == (inbound.plane is not None), f"{where}: its entry's writer pin is {entry.writer}"
    reads = inbound.reads
    if inbound.state is not R.READING:
        assert inbound.regions is None and inbound.slices is None and reads is None, f"{where}: reads, not reading"
        return
    regions, slices = inbound.regions, inbound.slices
    assert regions is not None and slices is not None and reads is not None, f"{where}: reads nothing"
    assert sum(n for _, n in regions) == entry.total_bytes, f"{where}: the holder's ranges are not its entry"
    assert reads.total_bytes == reads.queued_bytes == entry.total_bytes, f"{where}: reads not all of its entry"
    assert [s[:2] for s in slices] == reads.chunks, f"{where}: slices and reads differ"
    assert len(reads.in_flight) <= machine.limits.plane_in_flight, f"{where}: more reads than its window"
    assert reads.acked + len(reads.in_flight) == reads.next_seq, f"{where}: reads ended and running"
    read = sum(n for seq, (_, n) in enumerate(reads.chunks[:reads.next_seq]) if seq not in reads.in_flight)
    assert ledger.received_bytes == read, f"{where}: {ledger.received_bytes} bytes received, {read} read"

"""What must hold of a transfer machine between any two events (daemon process), as Dask's
worker state machine checks its own (`validate_state`): `Machine.validate()` calls this after
every step of the property tests. It reads, never changes, and is too slow for the hot path.

- every transfer held is live (no terminal state), under its own id, in a state its kind has;
- a sender holds a lease on its entry that still claims it (none while WAITING), no two
  senders share a lease, and its window says what its state says (all of a sealed entry
  queued, nothing sent while connecting, no ack before accept, acks and chunks in flight add up);
- a receiver's entry is the store's live, RECEIVING entry of that id, its blocks still there,
  its ledger and the entry's missing bytes agree, and STREAMED (only it) has every byte;
  no two receivers share an entry, and every RECEIVING entry in the store has its receiver.
"""
from __future__ import annotations

import itertools

from kvd.wire.layout import blocks_needed

from ..store.entries import State
from .states import KIND_STATES, STREAM_SENDER, TERMINAL, Inbound, Kind, Outbound, R, S


def check_machine(machine) -> None:
    leases: set[int] = set()
    entries: set[int] = set()
    for xfer, transfer in machine.transfers.items():
        where = f"transfer {xfer:x} ({transfer.kind.value}, {transfer.state.value})"
        assert transfer.xfer == xfer, f"{where} is held under another id"
        assert transfer.state not in TERMINAL, f"{where} has ended but is still held"
        assert transfer.state in KIND_STATES[transfer.kind], f"{where}: a state a {transfer.kind.value} never has"
        if isinstance(transfer, Outbound):
            _check_sender(machine, transfer, where, leases)
        else:
            _check_receiver(machine, transfer, where, entries)
    # only a receiver reserves an entry RECEIVING: one left in the store with none is lost blocks
    for entry in machine.store.entries.values():
        assert entry.state is not State.RECEIVING or id(entry) in entries, \
            f"{entry.request_id!r} is receiving, but no transfer receives it"


def _check_sender(machine, out: Outbound, where: str, leases: set[int]) -> None:
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


def _check_receiver(machine, inbound: Inbound, where: str, entries: set[int]) -> None:
    if inbound.state is R.PULLING:
        assert inbound.entry is None and inbound.ledger is None, f"{where} holds an entry before the offer"
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

"""Entries by request id (daemon process): states, leases, expiry, and the blocks each one holds.

Bookkeeping only; no sockets. The daemon reserves an entry (WRITING for a local put,
RECEIVING for an inbound transfer), publishes it (READY, visible to get), and removes it.

Who may touch an entry's blocks pins them, and the blocks return to the allocator only once
the entry is removed *and* nothing pins them, so a block is never handed to another request
while anyone may still read or write it:
- the local writer of a WRITING entry, until it commits (`publish`) or says it stopped
  (`release_writer`): removing the entry before then (its lease ran out, a delete) parks the
  blocks instead of freeing them;
- every lease (a reader, a transfer sending the entry). A lease *claims* the entry (a
  consuming one hides it from others) until its claim ends (`end_claim`: it ran out, or its
  transfer finished); it keeps pinning the blocks until `release`, when its holder is sure
  it no longer touches them (the reader said so or hung up, ZeroMQ let go of the frames).
Every reservation gets a fresh token (a generation number), and every lease names its token,
so a stale client or transfer can never act on a reused slot.
"""
from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from kvd.errors import AlreadyExists, BadRequest, NotFound, PoolFull
from kvd.wire.layout import (
    Extent,
    TensorSpec,
    blocks_needed,
    physical_segments,
    split_extents,
    tensor_offsets,
    validate_specs,
)
from kvd.wire.protocol import MAX_HEADER_BYTES, packed_size

from .allocator import BlockAllocator
from .entry import Entry as Entry  # re-exported: callers take the entry types from here
from .entry import Lease as Lease
from .entry import State as State

MAX_REQUEST_ID_LEN = 256
# what one entry, and all of them, may carry beside their bytes: a layout description is ~1 KiB,
# and a daemon must not grow without bound on entries of zero bytes with a large meta
MAX_META_BYTES = 64 << 10
MAX_META_TOTAL = 256 << 20
DEFAULT_MAX_ENTRIES = 65536
# a reader's get_slots names every tensor, its pool segments and the meta in one header; an
# entry whose description could not fit in one is refused at its put, not found unreadable later
ANSWERABLE_HEADER = MAX_HEADER_BYTES - 4096


def validate_request_id(request_id: str) -> None:
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
        raise BadRequest(f"request id must be a non-empty string of at most {MAX_REQUEST_ID_LEN} chars")


class Store:
    """`on_published(entry, received)` and `on_removed(entry)`, when given, hear of every entry that
    becomes complete (received: it came from a peer) and of every one removed: the holder
    directory lists and unlists entries from them."""

    def __init__(self, allocator: BlockAllocator, block_size: int, default_ttl: float | None,
                 on_published: Callable[[Entry, bool], None] | None = None,
                 on_removed: Callable[[Entry], None] | None = None, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.meta_bytes = 0  # of all entries, live or parked
        self._on_published = on_published
        self._on_removed = on_removed
        self.allocator = allocator
        self.block_size = block_size
        self.default_ttl = default_ttl
        self.entries: dict[str, Entry] = {}  # request id -> live entry (any state)
        self._leases: dict[int, tuple[Entry, Lease]] = {}
        self._tokens = itertools.count(1)
        self._zombies: set[Entry] = set()  # removed, but a lease or their writer still pins their blocks
        self._scratch: dict[int, list[Extent]] = {}  # token -> blocks lent to a client (see lend_scratch)
        self.scratch_blocks = 0  # blocks lent to connected clients, in all
        self.expired_total = 0

    # --- reservation and publication ---------------------------------------------------

    def reserve(
        self, request_id: str, specs: list[TensorSpec], ttl: float | None, meta: dict[str, Any] | None,
        state: State, write_deadline: float | None,
    ) -> Entry:
        offsets, total = self._check_new(request_id, specs, ttl, meta)
        try:
            extents = self.allocator.allocate(blocks_needed(total, self.block_size))
        except PoolFull as exc:
            if self.scratch_blocks:  # say where the blocks are that no entry holds
                raise PoolFull(f"{exc.message}; {self.scratch_blocks} blocks are lent to connected clients "
                               "for their next put") from None
            raise
        try:
            self._check_answerable(request_id, specs, offsets, extents, meta)
        except BaseException:
            self.allocator.free(extents)
            raise
        entry = self._add(request_id, specs, offsets, total, extents, ttl, meta, state, write_deadline)
        entry.writer = state is State.WRITING  # the client copies in after this returns
        return entry

    def _check_new(self, request_id: str, specs: list[TensorSpec], ttl: float | None,
                   meta: dict[str, Any] | None) -> tuple[list[int], int]:
        """Validate a new entry; returns its tensor offsets and total size."""
        validate_request_id(request_id)
        validate_specs(specs)
        if request_id in self.entries:
            raise AlreadyExists(f"request {request_id!r} is already held by this daemon")
        if ttl is not None and (not math.isfinite(ttl) or ttl < 0):
            raise BadRequest(f"ttl must be a non-negative number of seconds, got {ttl!r}")
        if len(self.entries) >= self.max_entries:
            raise PoolFull(f"this daemon holds {len(self.entries)} entries, its limit (--max-entries)")
        meta_bytes = packed_size(meta) if meta is not None else 0
        if meta_bytes > MAX_META_BYTES:
            raise BadRequest(f"meta of {request_id!r} takes {meta_bytes} bytes; at most {MAX_META_BYTES}")
        if self.meta_bytes + meta_bytes > MAX_META_TOTAL:
            raise PoolFull(f"the meta of all entries would pass {MAX_META_TOTAL >> 20} MiB")
        return tensor_offsets(specs)

    def _check_answerable(self, request_id: str, specs: list[TensorSpec], offsets: list[int],
                          extents: list[Extent], meta: dict[str, Any] | None) -> None:
        """Refuse an entry whose get_slots would not fit in a header (a bound first, the exact
        size only when the bound is near: most entries are far from it)."""
        bound = sum(len(s.name.encode()) + 16 + 10 * len(s.shape) for s in specs) \
            + 20 * len(specs) * len(extents) + (packed_size(meta) if meta is not None else 0)
        if bound <= ANSWERABLE_HEADER // 2:
            return
        segments = [physical_segments(extents, self.block_size, offset, spec.nbytes)
                    for spec, offset in zip(specs, offsets, strict=True)]
        size = packed_size([[s.to_wire() for s in specs], segments, meta])
        if size > ANSWERABLE_HEADER:
            raise BadRequest(f"{request_id!r} would be described in {size} bytes (tensor names, pool segments and "
                             f"meta), more than a reply can carry ({ANSWERABLE_HEADER}): fewer or shorter names, "
                             "a smaller meta")

    def _add(self, request_id: str, specs: list[TensorSpec], offsets: list[int], total: int,
             extents: list[Extent], ttl: float | None, meta: dict[str, Any] | None, state: State,
             write_deadline: float | None) -> Entry:
        ttl = self.default_ttl if ttl is None else ttl
        expires = time.monotonic() + ttl if ttl else None
        entry = Entry(request_id, next(self._tokens), specs, offsets, total, extents, meta, state,
                      expires, write_deadline)
        entry.meta_bytes = packed_size(meta) if meta is not None else 0
        self.meta_bytes += entry.meta_bytes
        self.entries[request_id] = entry
        return entry

    # --- scratch: blocks lent to a client for its next put ----------------------------------

    def lend_scratch(self, blocks: int) -> tuple[int, list[Extent]]:
        """Reserve blocks a client may write its next put into before it asks (one round trip
        instead of two); PoolFull if they are not free. They belong to no entry until
        `reserve_in_scratch` claims them, and return with `return_scratch`."""
        extents = self.allocator.allocate(blocks)
        token = next(self._tokens)
        self._scratch[token] = extents
        self.scratch_blocks += blocks
        return token, extents

    def return_scratch(self, token: int) -> None:
        extents = self._take_scratch(token)
        if extents is not None:
            self.allocator.free(extents)

    def _take_scratch(self, token: int) -> list[Extent] | None:
        extents = self._scratch.pop(token, None)
        if extents is not None:
            self.scratch_blocks -= sum(count for _, count in extents)
        return extents

    def reserve_in_scratch(
        self, token: int, request_id: str, specs: list[TensorSpec], ttl: float | None, meta: dict[str, Any] | None,
        state: State, write_deadline: float | None,
    ) -> Entry:
        """Turn lent scratch blocks, already written, into an entry; blocks it does not need go
        back to the pool. The scratch is used up either way (on error its blocks are freed)."""
        extents = self._scratch.get(token)
        if extents is None:
            raise NotFound(f"no scratch blocks {token} lent to this connection")
        try:
            offsets, total = self._check_new(request_id, specs, ttl, meta)
            needed = blocks_needed(total, self.block_size)
            have = sum(count for _, count in extents)
            if needed > have:
                raise BadRequest(f"{request_id!r} needs {needed} blocks, the scratch lent has {have}")
        except BaseException:
            self.return_scratch(token)
            raise
        self._take_scratch(token)
        used, spare = split_extents(extents, needed)
        try:
            self._check_answerable(request_id, specs, offsets, used, meta)
        except BaseException:
            self.allocator.free(extents)
            raise
        self.allocator.free(spare)
        return self._add(request_id, specs, offsets, total, used, ttl, meta, state, write_deadline)

    def writing_entry(self, request_id: str, token: int, state: State) -> Entry:
        entry = self.entries.get(request_id)
        if entry is None or entry.token != token or entry.state is not state:
            raise NotFound(f"no pending put for {request_id!r} with token {token} (expired or aborted?)")
        return entry

    def publish(self, entry: Entry) -> None:
        """Complete: visible to readers, unless a consuming lease (a streaming push) already owns it.
        A local writer commits only after its last copy, so its pin ends here."""
        received = entry.state is State.RECEIVING
        entry.state = State.CLAIMED if self._consumer_of(entry) else State.READY
        entry.write_deadline = None
        entry.writer = False
        entry.remaining = [0] * len(entry.remaining)
        if self._on_published is not None:
            self._on_published(entry, received)

    def pin_writer(self, entry: Entry) -> None:
        """A writer outside this process's code, a one-sided plane (a peer's writes into ranges we
        granted, or our own reads landing), may write into the entry's blocks until `release_writer`:
        removed before then, its blocks are parked, as under a local writer."""
        entry.writer = True

    def release_writer(self, entry: Entry) -> None:
        """The local writer will copy nothing more into this entry (it hung up, or acknowledged
        that its put is over): a removed entry's parked blocks can go."""
        entry.writer = False
        self._free_if_unused(entry)

    def claimed(self, entry: Entry) -> bool:
        """A consuming lease (a reader, a push) owns the entry already, or will once it is complete."""
        return self._consumer_of(entry) is not None

    @staticmethod
    def _consumer_of(entry: Entry) -> Lease | None:
        return next((lease for lease in entry.leases.values() if lease.consume and lease.claiming), None)

    # --- reading and sending ------------------------------------------------------------

    def ready(self, request_id: str) -> Entry | None:
        entry = self.entries.get(request_id)
        return entry if entry is not None and entry.state is State.READY else None

    def lease(self, entry: Entry, consume: bool, deadline: float | None, incomplete: bool = False) -> Lease:
        """Take a read lease. A consuming lease hides the entry from everyone else.

        With incomplete=True the entry may still be WRITING or RECEIVING (streams)."""
        if entry.removed or not (entry.state is State.READY or (incomplete and entry.state is not State.CLAIMED)):
            raise NotFound(f"request {entry.request_id!r} is not ready")
        lease = Lease(next(self._tokens), entry.request_id, consume, deadline)
        if consume and entry.state is State.READY:
            entry.state = State.CLAIMED
        entry.leases[lease.token] = lease
        self._leases[lease.token] = (entry, lease)
        return lease

    def end_claim(self, token: int, success: bool) -> Entry:
        """The lease stops claiming its entry: a successful consuming lease removes it, a failed one
        gives it back to other readers. Its blocks stay pinned until `release`."""
        found = self._leases.get(token)
        if found is None:
            raise NotFound(f"no read lease {token} (expired?)")
        entry, lease = found
        if not lease.claiming:
            return entry
        lease.claiming, lease.deadline = False, None
        if lease.consume and not entry.removed:
            if success:
                self.remove(entry)
            elif entry.state is State.CLAIMED and self._consumer_of(entry) is None:
                entry.state = State.READY
        return entry

    def release(self, token: int, success: bool) -> Entry:
        """End a lease: its claim (as in `end_claim`, if still claiming) and its pin."""
        entry = self.end_claim(token, success)
        del self._leases[token], entry.leases[token]
        self._free_if_unused(entry)
        return entry

    def lease_of(self, token: int) -> Lease | None:
        found = self._leases.get(token)
        return found[1] if found else None

    def set_lease_deadline(self, token: int, deadline: float | None) -> None:
        found = self._leases.get(token)
        if found is not None and found[1].claiming:
            found[1].deadline = deadline

    # --- removal and expiry -------------------------------------------------------------

    def remove(self, entry: Entry) -> None:
        if entry.removed:
            return
        entry.removed = True
        if self.entries.get(entry.request_id) is entry:
            del self.entries[entry.request_id]
        self._zombies.add(entry)
        self._free_if_unused(entry)
        if self._on_removed is not None:
            self._on_removed(entry)

    def _free_if_unused(self, entry: Entry) -> None:
        if entry.removed and not entry.leases and not entry.writer and entry in self._zombies:
            self._zombies.discard(entry)
            self.allocator.free(entry.extents)
            entry.extents = []
            self.meta_bytes -= entry.meta_bytes
            entry.meta_bytes = 0

    def sweep(self, now: float) -> tuple[list[Entry], list[Entry], list[Lease]]:
        """Expire what ran out of time: (ttl-expired entries, abandoned writes, stale leases).

        An abandoned write is removed, its blocks parked until its writer lets go; a stale lease
        stops claiming its entry, its blocks pinned until its reader releases it."""
        expired = [
            e for e in self.entries.values()
            if e.expires_at is not None and e.expires_at <= now and e.state is State.READY
        ]
        abandoned = [
            e for e in self.entries.values()
            if e.write_deadline is not None and e.write_deadline <= now
            and e.state in (State.WRITING, State.RECEIVING)
        ]
        stale = [lease for _, lease in self._leases.values() if lease.deadline is not None and lease.deadline <= now]
        for lease in stale:
            self.end_claim(lease.token, success=False)
        for entry in expired:
            self.remove(entry)
        for entry in abandoned:
            self.remove(entry)
        self.expired_total += len(expired)
        return expired, abandoned, stale

    # --- accounting -------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes held by entries (scratch lent to clients is counted apart)."""
        return (self.allocator.used_blocks - self.scratch_blocks) * self.block_size

    @property
    def parked_bytes(self) -> int:
        """Bytes of removed entries whose blocks someone may still touch (part of used_bytes)."""
        return sum(count for entry in self._zombies for _, count in entry.extents) * self.block_size

    @property
    def scratch_bytes(self) -> int:
        return self.scratch_blocks * self.block_size

    def counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in State}
        for entry in self.entries.values():
            counts[entry.state.value] += 1
        return counts

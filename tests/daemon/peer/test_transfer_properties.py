"""kvd.daemon.transfer.machine, at random: Hypothesis drives the two-machine pair (`pair.py`) with
local puts (sealed, or streamed tensor by tensor), pushed at once, at their commit, or kept for
a pull; pulls; served pulls' entries found by the watch (and told a turn later) or not; links
that come up or fail; and, where faults are on, dropped messages, lost connections, time
passing, cancels, and a peer that breaks the protocol (a message twice, a done too early, an
offer or a pull under an id in use). Some examples run on a one-sided plane (`pair(plane=True)`):
then the plane's operations end among the rest, in any order, late, or failed (faults on). After
every step both machines' `validate()` must pass, and:

- every transfer that leaves a machine says so once (`Finished`), and only one that was there;
- no lease is left on an entry but a live sender's (the harness gives an ended one's back), or
  one the plane's ledger holds (drained, or parked for the peer);
- the ledger counts exactly the operations the plane runs, under their live transfer, or under
  an ended one that it drains; no plane operation reads or lands in blocks that are no longer its
  entry's (checked as each ends, `pair.Side.complete`), where the peer did not lie;
- an entry is consumed by one sender at most;
- every entry published by a receiver has exactly the bytes its sender had;
- a sender that succeeded has a receiver that published its entry (unless a peer lied), and its
  own copy is gone unless a pull asked to keep it;
- at the end, once every transfer has ended, every plane operation ended and every message
  (`released` among them) was delivered, no lease is left, no block is parked, the ledgers are
  empty, and every block in use belongs to an entry the store still has. Where a message was lost
  or a peer lied, a `released` may never come: the blocks wait for the peer's restart, which the
  end then emulates (`Side.restart`) before checking.

Reordering: ZeroMQ never reorders messages within a connection, so each direction of each
connection is delivered in order; the two directions and the two connections (A's link to B,
B's link to A) interleave at random. A lost connection drops what its ROUTER side had queued;
what its DEALER side had queued may be dropped or delivered after the loss (ZeroMQ may write
it on the connection that replaces it). Without faults no transfer may fail for the network's
sake (no protocol error, no lost peer, no checksum error), and every one ends by messages
alone, with no clock moving.
"""
from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvd import errors
from kvd.daemon.store.entries import State
from kvd.daemon.transfer.states import (
    Cancel,
    ChannelLost,
    Commit,
    Connected,
    ConnectFailed,
    EntryMissing,
    EntryReady,
    Finished,
    Inbound,
    Kind,
    Outbound,
    Published,
    Tick,
    WaitForEntry,
    Written,
)
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec, physical_segments

from .pair import BLOCK, CHUNK, FIRST, SECOND, TIMEOUT, data_of, pair

NAMES = ("r0", "r1", "r2")  # few, so that pushes and pulls of one id meet
NETWORK_FAULTS = (errors.ProtocolError, errors.PeerUnavailable, errors.ChecksumMismatch, errors.InternalError)
SIZES = st.lists(st.sampled_from([0, 1, 300, CHUNK, CHUNK + 1, 2 * CHUNK, 3 * CHUNK + 5, 6 * CHUNK]),
                 min_size=1, max_size=3)  # (a sealed put takes the sum)
MAX_LIVE = 6  # transfers at a time, both sides together (more only fill the pools)
SETTINGS = settings(max_examples=120, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


class TransferPair(RuleBasedStateMachine):
    faults = True

    @initialize(inline=st.booleans(), plane=st.booleans())
    def setup(self, inline: bool, plane: bool = False) -> None:
        a, b, self.clock = pair((p.INLINE_OFFER,) if inline else (), plane=plane)
        self.plane = plane
        self.sides = {"A": a, "B": b}
        self.link = {"A": b.channel, "B": a.back}  # how each side reaches the other: on its own link
        self.queues = [(a, FIRST), (a, SECOND), (b, FIRST), (b, SECOND)]  # (receiving side, connection)
        self.seeds = itertools.count(1)
        self.streams: list[list] = []  # [side, entry, tensors written so far, pushed?] of local streams
        self.connecting: list[tuple] = []  # (side, push) waiting for their link
        self.waits: list[tuple] = []  # (holder, WaitForEntry) of served pulls whose entry is not here
        self.woken: list[tuple] = []  # (holder, WaitForEntry, entry) found, not yet told
        self.consumed: set[int] = set()  # the entries a sender consumed
        self.last: dict[int, p.Message] = {}  # the last message delivered from each queue
        self.lied = False  # a peer broke the protocol: its word (a done) proves nothing
        # on a plane, what may leave blocks parked for a `released` that never comes, until the peer
        # restarts: a message lost (a released, or an abort, so that the released came too early), a
        # lie, or a holder that failed its lent pull as its puller had it all (test_plane_failures' xfail)
        self.lost = False
        self.raced = False
        self.read = {side: 0 for side in self.sides.values()}  # events checked so far
        self.live = {side: {} for side in self.sides.values()}  # id(transfer) -> transfer, at the last step
        self.ended: set[int] = set()
        self.errors: list[errors.KvdError] = []

    # --- what the local side does -------------------------------------------------------------------

    @precondition(lambda self: self._busy() < MAX_LIVE)
    @rule(side=st.sampled_from("AB"), name=st.sampled_from(NAMES), stream=st.booleans(), sizes=SIZES,
          send=st.booleans(), linked=st.booleans())
    def put(self, side: str, name: str, stream: bool, sizes: list[int], send: bool, linked: bool) -> None:
        """A local put: complete at once, or a stream written tensor by tensor (`write`, `commit`);
        pushed to the other side (send: over a link that is up, or comes up later), or kept here
        for a pull."""
        s = self.sides[side]
        sizes = sizes if stream else [sum(sizes)]
        specs = [TensorSpec(f"t{i}", "uint8", (n,)) for i, n in enumerate(sizes)]
        try:
            entry = s.store.reserve(name, specs, None, {"seed": next(self.seeds)}, State.WRITING, None)
        except (errors.AlreadyExists, errors.PoolFull):
            return
        if stream:
            self.streams.append([s, entry, 0, send])
        else:
            self._write(s, entry, 0, entry.total_bytes)
            s.store.publish(entry)
        if send:
            self._push(s, entry, sealed=not stream, linked=linked)

    def _push(self, s, entry, sealed: bool, linked: bool = True) -> None:
        lease = s.store.lease(entry, consume=True, deadline=None, incomplete=True)
        out, actions = s.machine.start_push(entry, lease.token, self.link[s.name], sealed=sealed)
        s.run(actions)
        if linked:  # (the usual case: the link is up, the offer goes at once)
            s.handle(Connected(out.xfer))
        else:
            self.connecting.append((s, out))

    @precondition(lambda self: self.connecting)
    @rule(pick=st.integers(0, 100), up=st.booleans())
    def link_up(self, pick: int, up: bool) -> None:
        s, out = self.connecting.pop(pick % len(self.connecting))
        if up or not self.faults:
            s.handle(Connected(out.xfer))
        else:
            s.handle(ConnectFailed(out.xfer, errors.PeerUnavailable("the link's handshake failed")))

    @precondition(lambda self: self.streams)
    @rule(pick=st.integers(0, 100))
    def write(self, pick: int) -> None:
        stream = self.streams[pick % len(self.streams)]
        s, entry, index, _ = stream
        if index == len(entry.specs):
            return
        stream[2] += 1
        lo, hi = entry.tensor_ranges()[index]
        self._write(s, entry, lo, hi)
        self._tell_senders(s, entry, Written, entry.mark_tensors([index]))

    @precondition(lambda self: self.streams)
    @rule(pick=st.integers(0, 100), dest=st.booleans())
    def commit(self, pick: int, dest: bool) -> None:
        """The stream's writer commits; with dest (and no push yet), the put goes to the peer now."""
        self._commit(*self.streams.pop(pick % len(self.streams)), dest)

    def _commit(self, s, entry, written: int, pushed: bool, dest: bool = False) -> None:
        if entry.removed:  # (its push failed, or it was called off: the commit fails, the writer lets go)
            s.store.release_writer(entry)
            return
        # the writer's last copies land before its commit; then, as the local handlers do: a push
        # to dest starts, every sender is told of the rest and of the commit, it is published
        for lo, hi in entry.written.gaps(0, entry.total_bytes):
            self._write(s, entry, lo, hi)
        if dest and not pushed and not s.store.claimed(entry):
            self._push(s, entry, sealed=True)
        self._tell_senders(s, entry, Written, entry.mark_rest()[0])
        self._tell_senders(s, entry, Commit)
        s.store.publish(entry)

    @precondition(lambda self: self._busy() < MAX_LIVE)
    @rule(side=st.sampled_from("AB"), name=st.sampled_from(NAMES), keep=st.booleans(),
          timeout=st.sampled_from([0.0, 1.0, 3.0]))
    def pull(self, side: str, name: str, keep: bool, timeout: float) -> None:
        s = self.sides[side]
        if not s.peer.store.entries:
            return  # (mostly pulls of what may be there: a pull of nothing is one kind of many)
        _inbound, actions = s.machine.start_pull(name, self.link[side], timeout, keep)
        s.run(actions)

    @precondition(lambda self: self.waits)
    @rule(pick=st.integers(0, 100), here=st.booleans())
    def answer_pull(self, pick: int, here: bool) -> None:
        """The entry watch answers a served pull that waits: its entry is here now (here), or the
        pull's timeout passed."""
        self._answer(*self.waits.pop(pick % len(self.waits)), here)

    def _answer(self, holder, wait: WaitForEntry, here: bool) -> None:
        entry = self._pullable(holder, wait.transfer.request_id)
        if here and entry is not None:
            self.woken.append((holder, wait, entry))
        else:
            holder.handle(EntryMissing(wait.transfer.xfer, errors.Timeout(f"{wait.transfer.request_id!r} never came")))

    @precondition(lambda self: self.woken)
    @rule(pick=st.integers(0, 100))
    def wake(self, pick: int) -> None:
        """A served pull's entry, found by the watch, reaches the machine (a turn of the loop later:
        whatever happened meanwhile has happened)."""
        holder, wait, entry = self.woken.pop(pick % len(self.woken))
        holder.handle(EntryReady(wait.transfer.xfer, entry))

    @staticmethod
    def _pullable(holder, request_id: str):
        """What the watch's wait_pullable gives a served pull: a complete entry, or a local put
        still being written that no push owns."""
        entry = holder.store.entries.get(request_id)
        if entry is not None and (entry.state is State.READY
                                  or (entry.state is State.WRITING and not holder.store.claimed(entry))):
            return entry
        return None

    # --- what the plane does ------------------------------------------------------------------------

    @precondition(lambda self: self.plane and any(side.ops.pending for side in self.sides.values()))
    @rule(side=st.sampled_from("AB"), pick=st.integers(0, 100), fails=st.sampled_from([None, 0, 1, 99]))
    def end_op(self, side: str, pick: int, fails: int | None) -> None:
        """One of a side's plane operations ends, any of them, in any order (fails: it failed, having
        landed that many of its pieces first)."""
        s = self.sides[side]
        if not s.ops.pending:
            return
        op = s.ops.pending[pick % len(s.ops.pending)]
        if fails is None or not self.faults:
            s.complete(op)
        else:
            s.complete(op, errors.PeerUnavailable("the plane's operation failed"), landed=fails)

    # --- what the network does ----------------------------------------------------------------------

    @rule(queue=st.integers(0, 3), count=st.integers(1, 3))
    def deliver(self, queue: int, count: int) -> None:
        side, key = self.queues[queue]
        for _ in range(min(count, len(side.inboxes[key]))):
            self.last[queue] = side.receive(key)

    @precondition(lambda self: self.faults and self.last)
    @rule(queue=st.integers(0, 3))
    def replay(self, queue: int) -> None:
        """A peer that breaks the protocol sends the last message again (a chunk twice, an offer
        or a pull under an id in use, a second done...)."""
        if queue in self.last:
            side, key = self.queues[queue]
            side.inboxes[key].appendleft(self.last[queue])
            self.lied = side.lied_to = True

    @precondition(lambda self: self.faults)
    @rule(queue=st.integers(0, 3))
    def drop(self, queue: int) -> None:
        side, key = self.queues[queue]
        if side.inboxes[key]:
            side.inboxes[key].popleft()
            self.lost = True

    @precondition(lambda self: self.faults)
    @rule(key=st.sampled_from([FIRST, SECOND]), keep_dealer_queue=st.booleans())
    def lose_connection(self, key: tuple, keep_dealer_queue: bool) -> None:
        a, b = self.sides["A"], self.sides["B"]
        connector, listener = (a, b) if key == FIRST else (b, a)
        self.lost |= bool(connector.inboxes[key] or (listener.inboxes[key] and not keep_dealer_queue))
        connector.inboxes[key].clear()  # what the listener's ROUTER had queued for it
        if not keep_dealer_queue:
            listener.inboxes[key].clear()
        for side in (a, b):
            side.handle(ChannelLost(key, "connection lost"))

    @precondition(lambda self: self.faults)
    @rule(seconds=st.floats(0, TIMEOUT))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds
        for side in self.sides.values():
            side.handle(Tick(self.clock.now))

    @precondition(lambda self: self.faults)
    @rule(side=st.sampled_from("AB"), pick=st.integers(0, 100))
    def cancel(self, side: str, pick: int) -> None:
        transfers = list(self.sides[side].machine.transfers.values())
        if transfers:
            self.sides[side].handle(Cancel(transfers[pick % len(transfers)].xfer, errors.NotFound("called off")))

    @precondition(lambda self: self.faults)
    @rule(side=st.sampled_from("AB"), kind=st.integers(0, 3))
    def forge(self, side: str, kind: int) -> None:
        """A peer that breaks the protocol names one of our live transfers: a done before its
        time, an offer or a pull under its id."""
        s = self.sides[side]
        if not s.machine.transfers:
            return
        transfer = list(s.machine.transfers.values())[kind % len(s.machine.transfers)]
        msg = (p.Done(xfer=transfer.xfer),
               p.Pull(xfer=transfer.xfer, request_id="r0", timeout=1.0),
               p.Offer(xfer=transfer.xfer, request_id=transfer.request_id, tensors=[["x", "uint8", [10]]],
                       total_bytes=10, chunk_size=CHUNK, checksum="none"),
               p.Seal(xfer=transfer.xfer))[kind]
        s.inboxes[transfer.channel.key].appendleft(msg)
        self.lied = s.lied_to = True

    # --- checks -------------------------------------------------------------------------------------

    @invariant()
    def machines_are_consistent(self) -> None:
        if not hasattr(self, "sides"):
            return
        for side in self.sides.values():
            self._follow(side)  # (which may act as the local handlers would: more events)
        for side in self.sides.values():
            side.machine.validate()
            # the harness takes no lease but a push's, and gives an ended sender's back at once (on a
            # plane, one that failed once its plane can no longer touch its blocks: the ledger holds it)
            held = {t.lease_token for t in side.machine.transfers.values() if isinstance(t, Outbound)}
            ledger = side.plane.ledger
            holds = [*ledger.draining.values(), *[hold for each in ledger.parked.values() for hold in each]]
            held |= {hold.lease_token for hold in [*holds, *side.overwritten] if hold.lease_token}
            assert {token for e in side.store.entries.values() for token in e.leases} <= held, \
                f"a lease on {side.name} that no transfer holds"
            self._check_plane(side)
            live = {id(t): t for t in side.machine.transfers.values()}
            for key, transfer in self.live[side].items():
                assert key in live or key in self.ended, f"{transfer} left {side.name} without a Finished"
            self.live[side] = live

    def _check_plane(self, side) -> None:
        """The plane's ledger agrees with the machine and with what the plane runs: every operation
        posted and not ended is counted under its transfer's id, and by its transfer if that still
        runs, else its transfer ended and is draining (a lying peer may meanwhile have started another
        under that id); what is parked is a removed entry still pinned, or a lease still held."""
        ledger, transfers = side.plane.ledger, side.machine.transfers
        running: dict[int, int] = {}
        by_transfer: dict[int, int] = {}
        for op in side.ops.pending:
            running[op.transfer.xfer] = running.get(op.transfer.xfer, 0) + 1
            if transfers.get(op.transfer.xfer) is op.transfer:
                by_transfer[id(op.transfer)] = by_transfer.get(id(op.transfer), 0) + 1
            else:
                assert op.transfer.xfer in ledger.draining, f"{side.name}: an operation of an ended transfer undrained"
        assert ledger.running == running, f"{side.name}'s ledger counts {ledger.running}, its plane runs {running}"
        for transfer in transfers.values():
            ours = transfer.ops if isinstance(transfer, Outbound) else len(transfer.reads.in_flight) \
                if transfer.reads is not None else 0
            theirs = by_transfer.get(id(transfer), 0)
            assert ours == theirs, f"{side.name}: {transfer.xfer:x} counts {ours} operations, its plane runs {theirs}"
        for xfer in ledger.draining:
            assert running.get(xfer), f"{side.name} drains {xfer:x}, which runs nothing"
        for hold in [hold for each in ledger.parked.values() for hold in each]:
            if hold.entry is not None:
                assert hold.entry.removed and hold.entry.writer and hold.entry.extents, "a parked entry let go"
            else:
                assert side.store.lease_of(hold.lease_token) is not None, "a parked lease let go"

    def _follow(self, side) -> None:
        while self.read[side] < len(side.events):
            event = side.events[self.read[side]]
            self.read[side] += 1
            if isinstance(event, WaitForEntry):
                entry = self._pullable(side, event.transfer.request_id)
                if entry is not None:
                    self.woken.append((side, event, entry))  # (the watch finds it at once)
                else:
                    self.waits.append((side, event))
            elif isinstance(event, Published):
                entry = event.entry
                whole = b"".join(bytes(side.pool[o:o + n]) for o, n in
                                 physical_segments(entry.extents, BLOCK, 0, entry.total_bytes))
                assert whole == data_of(entry.total_bytes, entry.meta["seed"]), f"{entry.request_id}'s bytes"
            elif isinstance(event, Finished):
                self._finished(side, event.transfer, event.error)

    def _finished(self, side, transfer, error) -> None:
        assert id(transfer) not in self.ended, f"{transfer} finished twice"
        # a lent pull that failed on its holder while its puller had it all (either may be told first)
        lent = isinstance(transfer, Outbound) and transfer.plane is not None and error is not None
        pulled = isinstance(transfer, Inbound) and transfer.kind is Kind.PULL and error is None
        if (lent or pulled) and any(isinstance(e, Finished) and e.transfer.xfer == transfer.xfer
                                    and (e.error is None) == lent for e in side.peer.events):
            self.raced = True
        assert side.machine.transfers.get(transfer.xfer) is not transfer, f"{transfer} finished but is held"
        self.ended.add(id(transfer))
        if error is not None:
            self.errors.append(error)
            if not self.faults:
                assert not isinstance(error, NETWORK_FAULTS), f"{transfer.kind.value} failed without a fault: {error}"
        if isinstance(transfer, Outbound) and error is None:
            consumed = transfer.kind is Kind.PUSH or not transfer.pull.keep
            assert transfer.entry.removed == consumed, f"{transfer.request_id} sent: consumed {consumed}"
            if consumed:
                assert id(transfer.entry) not in self.consumed, f"{transfer.request_id} consumed twice"
                self.consumed.add(id(transfer.entry))
            seed = transfer.entry.meta["seed"]
            assert self.lied or any(isinstance(e, Published) and e.entry.meta["seed"] == seed
                                    for e in side.peer.events), \
                f"{transfer.request_id} was sent, but {side.peer.name} never published it"
        if transfer.kind is Kind.PUSH and error is not None and transfer.entry.state is State.WRITING:
            # as the local handlers do: a stream whose push failed can never be delivered; its
            # entry goes, and whatever else carries it is aborted
            entry = transfer.entry
            self.streams = [stream for stream in self.streams if stream[1] is not entry]
            side.store.remove(entry)
            side.store.release_writer(entry)  # (its writer hears of it, and stops)
            self._tell_senders(side, entry, Cancel, errors.NotFound("its push failed"))

    def teardown(self) -> None:
        if not hasattr(self, "sides"):
            return
        for _ in range(100):
            if self._settle():
                continue
            if not any(side.machine.transfers for side in self.sides.values()):
                break
            # nothing left to do but wait: only a fault may leave a transfer to its timeout
            assert self.faults, "without faults, transfers that never end: " + repr(
                [t for side in self.sides.values() for t in side.machine.transfers.values()])
            self.tick(2 * TIMEOUT + 1)
        if self.lost or self.lied or self.raced:
            for side in self.sides.values():  # a released that never came: the peer's restart frees it
                side.restart()
        for side in self.sides.values():
            for hold in side.overwritten:  # (what a ledger that kept both holds would release now)
                if hold.entry is not None:
                    side.store.release_writer(hold.entry)
                if side.store.lease_of(hold.lease_token) is not None:
                    side.store.release(hold.lease_token, success=False)
            side.overwritten.clear()
        for side in self.sides.values():
            assert not side.machine.transfers, f"{side.name} never ended {list(side.machine.transfers.values())}"
            assert not side.ops.pending and side.plane.summary()["draining"] == 0
            assert not side.plane.ledger.parked, f"{side.name} waits for released: {side.plane.summary()}"
            store = side.store
            assert all(not e.leases for e in store.entries.values()), f"a lease left on {side.name}"
            assert store.parked_bytes == 0, f"blocks parked on {side.name}"
            in_entries = sum(n for e in store.entries.values() for _, n in e.extents)
            assert store.allocator.used_blocks == in_entries, f"blocks on {side.name} that no entry has"
            assert all(e.state is not State.RECEIVING for e in store.entries.values()), "a receipt left behind"

    # --- helpers ------------------------------------------------------------------------------------

    def _busy(self) -> int:
        return sum(len(side.machine.transfers) for side in self.sides.values())

    def _settle(self) -> bool:
        """Do whatever is left to do without the clock: links come up, streams commit, served
        pulls are answered, every message is delivered. False if there was nothing."""
        busy = bool(self.connecting or self.streams or self.waits or self.woken
                    or any(side.inboxes[key] for side, key in self.queues)
                    or any(side.ops.pending for side in self.sides.values()))
        while self.connecting:
            self.link_up(0, up=True)
        while self.streams:
            self._commit(*self.streams.pop())
        while self.waits:
            self._answer(*self.waits.pop(), here=True)
        while self.woken:
            self.wake(0)
        for side, key in self.queues:
            while side.inboxes[key]:
                side.receive(key)
        for side in self.sides.values():
            side.complete_all()  # (what it posts meanwhile too)
        self.machines_are_consistent()
        return busy

    def _write(self, s, entry, lo: int, hi: int) -> None:
        data = data_of(entry.total_bytes, entry.meta["seed"])
        pos = lo
        for offset, length in physical_segments(entry.extents, BLOCK, lo, hi - lo):
            s.pool[offset:offset + length] = data[pos:pos + length]
            pos += length

    def _tell_senders(self, s, entry, event, *args) -> None:
        if event is Written and not args[0]:
            return  # (the shell tells nothing of an empty write)
        for transfer in s.machine.carrying(entry):
            if isinstance(transfer, Outbound) or event is Cancel:
                s.handle(event(transfer.xfer, *args))


class TransferPairWithoutFaults(TransferPair):
    faults = False


TestTransferPair = TransferPair.TestCase
TestTransferPair.settings = SETTINGS
TestTransferPairWithoutFaults = TransferPairWithoutFaults.TestCase
TestTransferPairWithoutFaults.settings = SETTINGS



# --- one transfer at a time, through a random schedule of faults ------------------------------------

# what happens between two messages, weighted towards delivering (a schedule mostly of faults
# ends every transfer at its first step)
STEPS = ("deliver",) * 8 + ("op",) * 4 + ("link", "drop", "lose", "lose_keeping", "tick", "cancel", "replay",
                                          "forge", "write", "commit", "op_fails")


def _scheduled(pair_: TransferPair, step: str, arg: int) -> None:
    """One step of a schedule of faults (STEPS), where it can apply; else nothing."""
    busy = [i for i, (side, key) in enumerate(pair_.queues) if side.inboxes[key]]
    if step == "deliver" and busy:
        pair_.deliver(busy[arg % len(busy)], 1)
    elif step == "link" and pair_.connecting:
        pair_.link_up(arg, up=arg % 2 == 0)
    elif step == "drop" and busy:
        pair_.drop(busy[arg % len(busy)])
    elif step in ("lose", "lose_keeping"):
        pair_.lose_connection((FIRST, SECOND)[arg % 2], step == "lose_keeping")
    elif step == "tick":
        pair_.tick(TIMEOUT * arg / 6)
    elif step == "cancel":
        pair_.cancel("AB"[arg % 2], arg)
    elif step == "replay":
        pair_.replay(arg % 4)
    elif step == "forge":
        pair_.forge("AB"[arg % 2], arg // 2)
    elif step == "write" and pair_.streams:
        pair_.write(arg)
    elif step == "commit" and pair_.streams:
        pair_.commit(arg, dest=False)
    elif step in ("op", "op_fails") and any(side.ops.pending for side in pair_.sides.values()):
        pair_.end_op("AB"[arg % 2] if pair_.sides["AB"[arg % 2]].ops.pending else "BA"[arg % 2], arg // 2,
                     None if step == "op" else arg % 3)


@settings(SETTINGS, max_examples=1000)  # (a few milliseconds each)
@given(inline=st.booleans(), plane=st.booleans(), pull=st.booleans(), stream=st.booleans(), keep=st.booleans(),
       linked=st.booleans(), sizes=SIZES, progress=st.lists(st.integers(0, 15), max_size=24),
       schedule=st.lists(st.tuples(st.sampled_from(STEPS), st.integers(0, 7)), max_size=40))
def test_one_transfer_through_any_schedule_of_faults(inline, plane, pull, stream, keep, linked, sizes, progress,
                                                     schedule):
    """The same checks, on one push (or pull, of an entry put on the holder) at a time: most of a
    schedule then falls in the middle of a transfer, in every state it passes through (progress: so
    many steps of it first, each a message delivered, a link up, a stream's tensor written or a plane
    operation ended, so that the faults find it further on its way)."""
    pair_ = TransferPair()
    pair_.setup(inline, plane)
    pair_.put("A", "r0", stream, sizes, send=not pull, linked=linked)
    if pull:
        pair_.pull("B", "r0", keep, 3.0)
    pair_.machines_are_consistent()
    for arg in progress:
        steps = [("deliver", i) for i, (side, key) in enumerate(pair_.queues) if side.inboxes[key]]
        steps += [("op", name) for name, side in pair_.sides.items() if side.ops.pending]
        steps += [("link", 0)] * bool(pair_.connecting) + [("write", 0)] * bool(pair_.streams)
        if not steps:
            break
        step, which = steps[arg % len(steps)]
        if step == "deliver":
            pair_.deliver(which, 1)
        elif step == "op":
            pair_.end_op(which, arg, None)
        elif step == "link":
            pair_.link_up(0, up=True)
        else:
            pair_.write(0)
        while pair_.woken:
            pair_.wake(0)
        pair_.machines_are_consistent()
    for step, arg in schedule:
        _scheduled(pair_, step, arg)
        while pair_.woken:
            pair_.wake(0)
        pair_.machines_are_consistent()
    pair_.teardown()

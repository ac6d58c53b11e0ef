"""kvd.daemon.peer.transfers: who hears that a transfer ended (its client's reply hangs on it), and
what the I/O layer counts and keeps of it. Real Transfers, store, pool and an event loop; a
link that is up at once and a channel that records what is sent, so no sockets."""
from __future__ import annotations

import asyncio

from kvd.daemon.config import Config
from kvd.daemon.metrics import Metrics
from kvd.daemon.peer.transfers import Transfers, TransferSettings
from kvd.daemon.store.allocator import BlockAllocator
from kvd.daemon.store.entries import State, Store
from kvd.daemon.transfer.channel import Channel
from kvd.errors import AlreadyExists, PeerUnavailable
from kvd.memory.io import HostPoolIO
from kvd.wire import protocol as p
from kvd.wire.layout import TensorSpec


class _Tracker:
    done = True


class _Link:
    def __init__(self, sent: list) -> None:
        def send(frames, track):
            sent.append(p.decode([bytes(f) for f in frames]))
            done = asyncio.get_running_loop().create_future()
            done.set_result(_Tracker() if track else None)  # (ZeroMQ let go of the frames at once)
            return done

        self.channel = Channel(("dealer", "tcp://B"), "B", send, lambda: False)

    def ready(self, timeout: float) -> asyncio.Future:
        up = asyncio.get_running_loop().create_future()
        up.set_result(None)
        return up


class _Peers:
    def __init__(self) -> None:
        self.sent: list[p.Message] = []
        self.link = _Link(self.sent)

    def link_for(self, dest: str) -> _Link:
        return self.link


class _Watch:
    def __init__(self) -> None:
        self.told: list[tuple] = []

    def __getattr__(self, name: str):
        return lambda *args: self.told.append((name, *args))


def _transfers() -> tuple[Transfers, _Peers, Store]:
    store = Store(BlockAllocator(16), 4096, None)
    peers = _Peers()
    pool = HostPoolIO(memoryview(bytearray(16 * 4096)))
    return Transfers(TransferSettings.of(Config(node_id="A")), store, pool, Metrics(), events=_Watch(),
                     peers=peers), peers, store


def _push(transfers: Transfers, store: Store, request_id: str, sealed: bool):
    entry = store.reserve(request_id, [TensorSpec("x", "uint8", (100,))], None, None, State.WRITING, None)
    if sealed:
        store.publish(entry)
    lease = store.lease(entry, consume=True, deadline=None, incomplete=True)
    return transfers.push(entry, lease.token, "B", sealed=sealed)


def test_a_push_that_ended_before_anyone_asked_still_tells_them():
    # a streamed push the peer refused (AlreadyExists) ends before its writer commits; the commit's
    # reply waits on the push: it must hear the error at once, not wait for an end that has passed
    async def scenario() -> None:
        transfers, peers, store = _transfers()
        heard = []
        refused = _push(transfers, store, "r", sealed=False)
        offer = peers.sent[-1]
        assert isinstance(offer, p.Offer) and not offer.sealed
        transfers.on_message(peers.link.channel, p.Abort(xfer=offer.xfer, code=AlreadyExists.code,
                                                         message="'r' already exists on B"))
        transfers.when_ended(refused, heard.append)
        assert len(heard) == 1 and isinstance(heard[0], AlreadyExists)
        assert refused.outcome.done() and isinstance(refused.outcome.exception(), AlreadyExists)
        running = _push(transfers, store, "s", sealed=True)
        transfers.when_ended(running, heard.append)
        assert len(heard) == 1  # not yet
        transfers.on_message(peers.link.channel, p.Done(xfer=peers.sent[-2].xfer))
        assert heard[1] is None  # as it ends, in the same turn of the loop
        transfers.on_message(peers.link.channel, p.Done(xfer=peers.sent[-2].xfer))  # (an end is told once)
        assert len(heard) == 2 and running.outcome.result() is None

    asyncio.run(scenario())


def test_what_ended_is_counted_from_the_machines_word_and_nothing_is_kept_of_it():
    async def scenario() -> None:
        transfers, peers, store = _transfers()
        transfers.metrics.transfer_done = lambda *args: done.append(args)
        done: list = []
        _push(transfers, store, "ok", sealed=True)  # 100 bytes: one chunk after the offer
        assert transfers.metrics.tally["sent_bytes"] == 100
        transfers.on_message(peers.link.channel, p.Done(xfer=peers.sent[-1].xfer))
        failed = _push(transfers, store, "no", sealed=True)
        transfers.abort(failed.transfer, AlreadyExists("no"))
        assert [(d[2], d[1]) for d in done] == [("ok", "sent"), ("failed", "sent")]
        assert transfers.metrics.tally["pushes"] == 1 and transfers.metrics.tally["failures"] == 1
        assert not transfers.busy() and not transfers._pushes and not transfers._sends
        assert store.allocator.free_blocks == 16 - 1  # the failed push's entry is back, the pushed one gone

    asyncio.run(scenario())


def test_a_granted_entry_whose_push_failed_is_freed_by_the_senders_released():
    async def scenario() -> None:
        transfers, peers, store = _transfers()
        channel = peers.link.channel
        channel.plane, channel.plane_agent = "nixl", "agent-B"
        size = 5 * 4096
        transfers.on_message(channel, p.Offer(xfer=77, request_id="r", tensors=[["x", "uint8", [size]]],
                                              total_bytes=size, chunk_size=1 << 20, checksum="xxh3_64", sealed=True,
                                              plane="nixl"))
        assert [m.TYPE for m in peers.sent] == ["grant"]
        transfers.on_message(channel, p.Abort(xfer=77, code=PeerUnavailable.code, message="its write failed"))
        assert store.parked_bytes == size and transfers.plane.summary()["parked"] == 1  # until B's word
        transfers.on_message(channel, p.Released(xfer=77))
        assert store.parked_bytes == 0 and store.allocator.free_blocks == 16

    asyncio.run(scenario())

"""kvd.daemon.peer.transfers: who hears that a push ended (its client's reply hangs on it). Real
Transfers, store, pool and an event loop; no sockets: nothing here sends."""
from __future__ import annotations

import asyncio

from kvd.daemon.config import Config
from kvd.daemon.metrics import Metrics
from kvd.daemon.peer.channel import Channel
from kvd.daemon.peer.states import Outbound, SenderState
from kvd.daemon.peer.transfers import Transfers
from kvd.daemon.store.allocator import BlockAllocator
from kvd.daemon.store.entries import Store
from kvd.errors import AlreadyExists
from kvd.memory.io import HostPoolIO


def _transfers() -> Transfers:
    store = Store(BlockAllocator(16), 4096, None)
    return Transfers(Config(node_id="A"), store, HostPoolIO(memoryview(bytearray(16 * 4096))), Metrics(),
                     events=None, peers=None)


def _push(xfer: int) -> Outbound:
    out = Outbound(xfer, Channel(("dealer", "tcp://B"), "B", None, lambda: False), "r", SenderState.OFFERED)
    out.outcome = asyncio.get_running_loop().create_future()
    return out


def test_a_push_that_ended_before_anyone_asked_still_tells_them():
    # a streamed push the peer refused (AlreadyExists) ends before its writer commits; the commit's
    # reply waits on the push: it must hear the error at once, not wait for an end that has passed
    async def scenario() -> None:
        transfers, heard = _transfers(), []
        refused = _push(1)
        transfers._finished(refused, AlreadyExists("'r' already exists on B"))
        transfers.when_ended(refused, heard.append)
        assert len(heard) == 1 and isinstance(heard[0], AlreadyExists)
        running = _push(2)
        transfers.when_ended(running, heard.append)
        assert len(heard) == 1  # not yet
        transfers._finished(running, None)
        assert heard[1] is None  # as it ends, in the same turn of the loop
        transfers._finished(running, None)  # (an end is told once)
        assert len(heard) == 2

    asyncio.run(scenario())

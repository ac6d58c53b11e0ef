"""kvd.daemon.peer.peers: the set of links, without a daemon (real ZeroMQ sockets, no peer needed)."""
from __future__ import annotations

import time

from kvd.testing.daemons import free_port


def test_idle_links_to_ad_hoc_endpoints_are_closed():
    # decode pods' addresses come and go: a daemon must not keep a socket (and reconnect
    # attempts) for every address it was ever asked to push to
    import asyncio

    import zmq

    from kvd.daemon.config import Config
    from kvd.daemon.peer.peers import ADHOC_IDLE, PeerSet, PeerSettings

    async def scenario() -> None:
        ctx = zmq.Context()
        peers = PeerSet(PeerSettings.of(Config(peers={"B": f"tcp://127.0.0.1:{free_port()}"})), ctx, 1, curve=None)
        peers.start(on_message=lambda link, msg: None, on_lost=lambda key, why: None)
        try:
            idle, in_use = (peers.link_for(f"tcp://127.0.0.1:{free_port()}") for _ in range(2))
            later = time.monotonic() + ADHOC_IDLE + 1
            peers.heartbeat(later, busy={in_use.channel.key})
            assert set(peers.links) == {"B", in_use.name}  # configured peers stay, whatever their use
            assert idle.socket.sock.closed
            peers.heartbeat(later, busy=set())
            assert set(peers.links) == {"B"}
            again = peers.link_for(idle.name)  # asked for again: a fresh link
            assert again is not idle and not again.socket.sock.closed
        finally:
            peers.close()
            ctx.term()

    asyncio.run(scenario())

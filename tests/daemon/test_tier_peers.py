"""The tier's questions to other homes (kvd.daemon.tier.homes), socket-free: a real CacheStore on a
real pool buffer, and links that record what they are given to send, so a test plays the homes
and says exactly what comes back. An answer counts only if it comes from the home that was asked
and is the kind of answer the question wants; anything else is refused and counted, and the
question goes on waiting for the real answer (or its deadline: a miss, never an error)."""
from __future__ import annotations

import asyncio

import pytest

from kvd.daemon.store.page_store import CacheStore, SharedPool
from kvd.daemon.tier.homes import TierPeers
from kvd.errors import ProtocolError
from kvd.wire import protocol as p
from kvd.wire.checksum import digest

BLOCK = 4096


class RecordingChannel:
    def __init__(self, peer_name: str) -> None:
        self.peer_name = peer_name
        self.sent: list[p.Message] = []

    def send(self, msg: p.Message) -> None:
        self.sent.append(msg)


class Link:
    connected = True

    def __init__(self, name: str) -> None:
        self.channel = RecordingChannel(name)


def tier() -> tuple[TierPeers, dict[str, Link]]:
    links = {name: Link(name) for name in ("B", "C")}
    pool = memoryview(bytearray(64 * BLOCK))
    cache = CacheStore(SharedPool(64), BLOCK, 32 * BLOCK)
    peers = TierPeers("A", cache, pool, BLOCK, links.__getitem__, lambda: ["A", "B", "C"], "xxh3_64")
    return peers, links


def pages_answer(xfer: int, data: list[bytes]) -> p.TierPages:
    return p.TierPages(xfer=xfer, seq=0, offset=0, lengths=[len(d) for d in data], digest=digest("xxh3_64", data),
                       payload=data, checksum="xxh3_64", found=list(range(len(data))),
                       pages=[["uint8", [len(d)]] for d in data])


async def first_sent(link: Link) -> p.Message:
    while not link.channel.sent:
        await asyncio.sleep(0)
    return link.channel.sent[0]


def test_an_answer_from_another_node_or_of_another_kind_is_refused_and_the_question_waits():
    async def main() -> None:
        peers, links = tier()
        on_message = peers.wrap(lambda source, msg: pytest.fail(f"{msg} is the tier's"))
        asking = asyncio.ensure_future(peers.held("ns", ["k1", "k2"], {"B": [0, 1]}))
        question = await first_sent(links["B"])
        assert isinstance(question, p.TierAsk)
        # C answers B's question; B answers it with pages, not with what it holds: both refused
        on_message(links["C"], p.TierHeld(xfer=question.xfer, held=[True, True]))
        on_message(links["B"], pages_answer(question.xfer, [b"x" * 8]))
        assert peers.counts["bad"] == 2 and not asking.done()
        on_message(links["B"], p.TierHeld(xfer=question.xfer, held=[False, True]))
        assert await asking == {1}

    asyncio.run(main())


def test_forged_pages_from_another_node_never_land_and_the_real_ones_do():
    async def main() -> None:
        peers, links = tier()
        on_message = peers.wrap(lambda source, msg: None)
        real, forged = bytes(range(16)), b"\xee" * 16
        fetching = asyncio.ensure_future(peers.fetch("ns", ["k"], [16], {"B": [0]}))
        question = await first_sent(links["B"])
        on_message(links["C"], pages_answer(question.xfer, [forged]))  # a valid digest, the wrong node
        on_message(links["B"], pages_answer(question.xfer, [real]))
        assert await fetching == []
        token, [page] = peers.cache.lease("ns", ["k"], [16])
        try:
            assert peers.read(page) == real
        finally:
            peers.cache.release(token)
        assert (peers.counts["bad"], peers.counts["fetched"]) == (1, 1)

    asyncio.run(main())


def test_a_home_that_answers_only_in_the_wrong_kind_costs_a_miss_at_the_deadline():
    async def main() -> None:
        peers, links = tier()
        on_message = peers.wrap(lambda source, msg: None)
        fetching = asyncio.ensure_future(peers.fetch("ns", ["k"], [16], {"B": [0]}))
        question = await first_sent(links["B"])
        on_message(links["B"], p.TierHeld(xfer=question.xfer, held=[True]))  # a fetch wants pages
        assert await fetching == [] and peers.counts["fetched"] == 0 and peers.counts["timeouts"] == 1
        assert peers.cache.exists("ns", ["k"]) == 0

    asyncio.run(main())


def test_every_tier_peer_message_has_a_route_and_nothing_else_does():
    peers, _ = tier()
    assert set(peers.routes()) == set(p.TIER_PEER)
    passed: list[p.Message] = []
    on_message = peers.wrap(lambda source, msg: passed.append(msg))
    other = p.Ping(nonce=1)
    on_message(Link("B"), other)
    assert passed == [other]  # (the rest are the transfers')
    with pytest.raises(ProtocolError, match="not a tier message"):
        peers.on_peer(Link("B").channel, other)


def test_a_malformed_tier_answer_is_a_protocol_error():
    peers, links = tier()
    good = pages_answer(7, [b"a" * 8, b"b" * 8])
    short = p.TierPages(xfer=7, seq=0, offset=0, lengths=[8], digest=good.digest, payload=good.payload[:1],
                        checksum="xxh3_64", found=[0, 1], pages=good.pages)
    with pytest.raises(ProtocolError, match="2 pages named, 1 sent"):
        peers._checked(short, 2)
    forged = p.TierPages(xfer=7, seq=0, offset=0, lengths=[8, 8], digest=good.digest, payload=[b"a" * 8, b"c" * 8],
                         checksum="xxh3_64", found=[0, 1], pages=good.pages)
    with pytest.raises(ProtocolError, match="digest"):
        peers._checked(forged, 2)

    async def main() -> None:  # an answer of the wrong kind, from the home asked: refused as a protocol error
        asking = asyncio.ensure_future(peers.held("ns", ["k1"], {"B": [0]}))
        question = await first_sent(links["B"])
        with pytest.raises(ProtocolError, match="asked of B"):
            peers.on_peer(links["B"].channel, pages_answer(question.xfer, [b"x" * 8]))
        peers.on_peer(links["B"].channel, p.TierHeld(xfer=question.xfer, held=[True]))
        assert await asking == {0}

    asyncio.run(main())

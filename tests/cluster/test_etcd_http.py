"""The etcd gateway client's HTTP framing against a server that does not play by the rules (a local
asyncio server standing in for a compromised or broken etcd endpoint): an answer is capped in total,
however it is chunked, and the connection it came on is dropped.
"""
from __future__ import annotations

import asyncio

import pytest

from kvd.cluster.backends.etcd_http import BodyTooLarge, GatewayClient, GatewayError

from .conftest import run

CAP = 1 << 20


class EvilServer:
    """Answers every request with `head` and then `body_chunks()` pieces, counting what it sent."""

    def __init__(self, head: bytes, piece: bytes, pieces: int) -> None:
        self.head, self.piece, self.pieces = head, piece, pieces
        self.sent = 0
        self.server: asyncio.Server | None = None
        self.served = asyncio.Event()  # an answer ended (the client hung up, or it was all sent)

    async def __aenter__(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[:2]

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(self.head)
            for _ in range(self.pieces):
                writer.write(self.piece)
                self.sent += len(self.piece)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client hung up: what we want
        finally:
            writer.close()
            self.served.set()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"


def _serve_and_call(head: bytes, piece: bytes, pieces: int):
    @run
    async def go():
        evil = EvilServer(head, piece, pieces)
        async with evil as (host, port):
            client = GatewayClient([(host, port)], max_body=CAP)
            try:
                async with asyncio.timeout(10):
                    with pytest.raises(BodyTooLarge):
                        await client.call("/v3/kv/range", {})
                assert client._idle == []  # the connection it came on is not reused
            finally:
                await client.close()
            await asyncio.wait_for(evil.served.wait(), 10)  # the server saw the hang-up: sent is final
        return evil.sent

    return go()


def test_a_chunked_answer_is_capped_in_total_not_per_chunk():
    # 64 KiB chunks, each far under the cap, without end (4 GiB if the client kept reading)
    sent = _serve_and_call(CHUNKED, chunk(b" " * (64 << 10)), 1 << 16)
    assert sent < 8 * CAP, f"the client read {sent} bytes of an answer capped at {CAP}"


def test_a_declared_length_over_the_cap_is_refused_before_reading():
    head = f"HTTP/1.1 200 OK\r\nContent-Length: {4 * CAP}\r\n\r\n".encode()
    sent = _serve_and_call(head, b" " * (64 << 10), 64)
    assert sent < 8 * CAP


@run
async def _garbage_framing():
    async with EvilServer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", b"", 0) as (host, port):
        client = GatewayClient([(host, port)], max_body=CAP)
        try:
            with pytest.raises(ConnectionError):
                await client.call("/v3/kv/range", {})
        finally:
            await client.close()
    body = b'{"error":"etcdserver: permission denied","message":"etcdserver: permission denied","code":7}'
    head = f"HTTP/1.1 403 Forbidden\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    async with EvilServer(head + body, b"", 0) as (host, port):
        client = GatewayClient([(host, port)], max_body=CAP)
        try:
            with pytest.raises(GatewayError) as e:
                await client.call("/v3/kv/range", {})
            assert e.value.code == 7 and "permission denied" in e.value.message
        finally:
            await client.close()


def test_bad_framing_is_a_connection_error_and_an_etcd_error_keeps_its_code():
    _garbage_framing()

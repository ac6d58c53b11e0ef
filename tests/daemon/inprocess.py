"""A whole daemon in the test's own process and event loop, for mid-level tests of the local side
(the test process; the daemon's parts are the real ones, nothing is mocked).

`serving()` starts a real `Daemon` (pool, store, local server, handlers, transfers, router) on
a unix socket in a temp directory and a free loopback port, with no metrics endpoint; `Conn` is
a raw client connection on that socket speaking the protocol message by message, so a test says
exactly what a client sends and sees every reply, while it can also read the daemon's parts
(`node.store`, `node.handlers`, ...) between two messages. Tests run it with `run(...)`.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from kvd.daemon.config import Config
from kvd.daemon.daemon import Daemon
from kvd.memory.host import map_pool
from kvd.testing.daemons import free_port
from kvd.wire import protocol as p
from kvd.wire.framing import MessageReader, encode_message

BLOCK = 4096
WAIT = 5.0  # seconds a test waits for a reply that must come


class Conn:
    """One client connection, raw: send a message, read the next one."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._frames = MessageReader()
        self._inbox: list[p.Message] = []
        self.reqs = itertools.count(1)

    def req(self) -> int:
        return next(self.reqs)

    async def send(self, msg: p.Message) -> None:
        self.writer.write(encode_message(p.encode(msg)))
        await self.writer.drain()

    async def recv(self, timeout: float = WAIT) -> p.Message:
        while not self._inbox:
            data = await asyncio.wait_for(self.reader.read(1 << 16), timeout)
            if not data:
                raise ConnectionError("the daemon closed the connection")
            self._inbox += [p.decode(frames) for frames in self._frames.feed(data)]
        return self._inbox.pop(0)

    async def nothing(self, within: float = 0.2) -> None:
        """No message comes within `within` seconds."""
        try:
            msg = await self.recv(within)
        except TimeoutError:
            return
        raise AssertionError(f"unexpected {msg}")

    async def ask(self, msg: p.Message, timeout: float = WAIT) -> p.Message:
        await self.send(msg)
        return await self.recv(timeout)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


class Node:
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.store, self.handlers, self.watch = daemon.parts.store, daemon.parts.handlers, daemon.parts.watch
        self.pool = None  # the pool as a client maps it (after hello)

    async def connect(self, hello: bool = True) -> Conn:
        path = self.daemon.config.socket.removeprefix("unix://")
        conn = Conn(*await asyncio.open_unix_connection(path))
        if hello:
            ok = await conn.ask(p.Hello(req=conn.req(), client="test"))
            assert isinstance(ok, p.HelloOk), ok
            if self.pool is None:
                self.pool, self._view = map_pool(ok.pool_path, ok.pool_size)
        return conn

    def write(self, segments: list[list[tuple[int, int]]], data: list[bytes]) -> None:
        """Copy each tensor's bytes into its segments of the pool, as a client does."""
        for tensor_segments, payload in zip(segments, data):
            done = 0
            for offset, length in tensor_segments:
                self.pool[offset:offset + length] = payload[done:done + length]
                done += length

    def read(self, segments: list[list[tuple[int, int]]]) -> list[bytes]:
        return [b"".join(bytes(self.pool[o:o + n]) for o, n in tensor) for tensor in segments]

    def blocks_in_use(self) -> int:
        allocator = self.store.allocator
        return allocator.num_blocks - allocator.free_blocks


@contextlib.asynccontextmanager
async def serving(workdir: Path, **config) -> AsyncIterator[Node]:
    settings = dict(node_id="A", listen=f"tcp://127.0.0.1:{free_port()}", socket=f"unix://{workdir}/kvd.sock",
                    pool_size=64 * BLOCK, block_size=BLOCK, chunk_size=16 * BLOCK, pool_prefault=False,
                    pool_overcommit=True,  # (256 KiB: whatever else this host is running)
                    metrics_port=0, scratch_max=0, log_level="warning")
    settings.update(config)
    daemon, node = Daemon(Config(**settings)), None
    try:
        await daemon.start()
        node = Node(daemon)
        yield node
    finally:
        await daemon.stop()
        if node is not None and node.pool is not None:
            node._view.release()
            node.pool.close()


def run(workdir: Path, scenario: Callable[[Node], Awaitable[None]], **config) -> None:
    """Run scenario(node) against a daemon in this process, on a fresh event loop."""
    async def main() -> None:
        async with serving(workdir, **config) as node:
            await asyncio.wait_for(scenario(node), 30)

    asyncio.run(main())


async def until(condition: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    """Yield to the daemon's loop until condition() holds (what it does after a reply, or on a
    message that has no reply); fails the test naming `what` after timeout."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {timeout} s"
        await asyncio.sleep(0.005)


def tensor(name: str, nbytes: int) -> list:
    """A tensor spec as the wire has it: [name, dtype, shape]."""
    return [name, "uint8", [nbytes]]


def run_pair(workdir: Path, scenario: Callable[[Node, Node], Awaitable[None]], **config) -> None:
    """Run scenario(a, b) against daemons A and B in this process, each the other's peer."""
    ports = {"A": free_port(), "B": free_port()}
    peers = {name: f"tcp://127.0.0.1:{port}" for name, port in ports.items()}

    async def main() -> None:
        (workdir / "A").mkdir()
        (workdir / "B").mkdir()
        async with serving(workdir / "A", node_id="A", listen=peers["A"], peers={"B": peers["B"]}, **config) as a:
            async with serving(workdir / "B", node_id="B", listen=peers["B"], peers={"A": peers["A"]},
                               **config) as b:
                await asyncio.wait_for(scenario(a, b), 30)

    asyncio.run(main())

"""LoopSocket: a ZeroMQ socket drained from the event loop, a bounded amount per turn."""
from __future__ import annotations

import asyncio

import zmq

from kvd.zsock import MAX_BATCH, MAX_BATCH_BYTES, LoopSocket


async def _pair(on_message) -> tuple[zmq.Context, zmq.Socket, LoopSocket]:
    ctx = zmq.Context()
    receiver = ctx.socket(zmq.PULL)
    receiver.bind("inproc://loopsocket-test")
    sender = ctx.socket(zmq.PUSH)
    sender.connect("inproc://loopsocket-test")
    return ctx, sender, LoopSocket(receiver, on_message)


def _close(ctx: zmq.Context, sender: zmq.Socket, loop_socket: LoopSocket) -> None:
    loop_socket.close(0)
    sender.close(0)
    ctx.term()


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_big_messages_are_handled_one_loop_turn_at_a_time():
    """A drain stops after MAX_BATCH_BYTES of payload, so other callbacks (local clients) run
    between big chunks instead of after a whole window of them."""
    async def main() -> list[str]:
        order: list[str] = []
        ctx, sender, sock = await _pair(lambda frames: order.append("chunk"))
        try:
            for _ in range(4):
                sender.send_multipart([b"h", bytes(MAX_BATCH_BYTES)])
            await _until(lambda: sock.sock.poll(0) or order)  # queued on the receiving side

            def other_work() -> None:
                order.append("other")

            loop = asyncio.get_running_loop()
            sock._on_fd()  # what the loop calls when the descriptor is readable
            loop.call_soon(other_work)  # scheduled after the drain, like an I/O callback would be
            await _until(lambda: order.count("chunk") == 4)
            return order
        finally:
            _close(ctx, sender, sock)

    order = asyncio.run(main())
    assert order[0] == "chunk" and "other" in order[1:3], order
    assert order.count("chunk") == 4


def test_small_messages_are_drained_in_one_turn():
    async def main() -> int:
        got: list[int] = []
        ctx, sender, sock = await _pair(lambda frames: got.append(1))
        try:
            for _ in range(50):
                sender.send_multipart([b"h", b"x" * 100])
            await _until(lambda: sock.sock.poll(0) or got)
            sock._on_fd()
            handled_in_one_turn = len(got)
            await _until(lambda: len(got) == 50)
            return handled_in_one_turn
        finally:
            _close(ctx, sender, sock)

    assert asyncio.run(main()) == 50 <= MAX_BATCH

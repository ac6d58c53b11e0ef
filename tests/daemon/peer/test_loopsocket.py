"""The pyzmq API under the sugar layer that kvd.daemon.peer.loopsocket calls directly
(`zmq.backend.Socket.send(sock, frame, flags, copy, track)`): pyproject pins pyzmq to the releases
it was tested with, and this fails first, with the version in the message, on one that changed it."""
from __future__ import annotations

import pytest
import zmq

from kvd.daemon.peer import loopsocket


def test_the_sugar_socket_is_a_backend_socket():
    assert issubclass(zmq.Socket, zmq.backend.Socket), f"pyzmq {zmq.__version__}"
    assert loopsocket._send_frame is zmq.backend.Socket.send


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    b.bind("inproc://lint-send-parts")
    a.connect("inproc://lint-send-parts")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


BIG = bytes(range(256)) * 300  # over pyzmq's copy threshold (64 KiB): copy=False lends it to ZeroMQ


@pytest.mark.parametrize("copy", [True, False])
def test_send_parts_sends_a_whole_message_in_order(pair, copy):
    a, b = pair
    loopsocket.send_parts(a, [b"head", memoryview(BIG), b"", b"tail"], copy, False)
    assert b.poll(5000), f"pyzmq {zmq.__version__}: nothing arrived"
    assert b.recv_multipart() == [b"head", BIG, b"", b"tail"]


def test_a_zero_copy_send_returns_a_tracker_that_ends(pair):
    """The chunk path (copy=False, track=True): a block stays held until this tracker is done."""
    a, b = pair
    tracker = loopsocket.send_parts(a, [b"head", memoryview(BIG)], False, True)
    assert isinstance(tracker, zmq.MessageTracker), f"pyzmq {zmq.__version__}: {tracker!r}"
    assert b.recv_multipart() == [b"head", BIG]
    tracker.wait(5)
    assert tracker.done


def test_a_send_that_cannot_go_raises_again():
    """LoopSocket queues on zmq.Again: a DEALER with IMMEDIATE and no peer must raise it."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IMMEDIATE, 1)
        with pytest.raises(zmq.Again):
            loopsocket.send_parts(s, [b"x", b"y"], True, False)
    finally:
        s.close(0)
        ctx.term()

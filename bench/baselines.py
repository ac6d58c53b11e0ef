"""Raw baselines on the same machine, in the same run: memcpy, TCP loopback, pyzmq."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct

import numpy as np
import zmq

from .measure import Sample, repeat

CHUNK = 4 << 20


def checksum(nbytes: int, repeats: int) -> Sample:
    """kvd's chunk checksum (xxh3_64, one thread) over nbytes, 4 MiB at a time as chunks are."""
    from kvd.wire.checksum import digest

    data = memoryview(np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8))
    return repeat(lambda: [digest("xxh3_64", [data[off:off + CHUNK]]) for off in range(0, nbytes, CHUNK)], repeats)


def memcpy(nbytes: int, repeats: int) -> Sample:
    """Single-thread memcpy (numpy.copyto) between two touched buffers."""
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.ones(nbytes, dtype=np.uint8)
    return repeat(lambda: np.copyto(dst, src), repeats)


# --- raw TCP -------------------------------------------------------------------------------------

def _tcp_sink(port_queue, nbytes: int, runs: int) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(nbytes)
    view = memoryview(buf)
    for _ in range(runs):
        got = 0
        while got < nbytes:
            got += conn.recv_into(view[got:], nbytes - got)
        conn.sendall(b"k")
    conn.close()


def tcp_throughput(nbytes: int, repeats: int) -> Sample:
    """sendall of nbytes to another process, recv_into a preallocated buffer, 1-byte ack."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    sink = ctx.Process(target=_tcp_sink, args=(ports, nbytes, repeats + 1))
    sink.start()
    sock = socket.create_connection(("127.0.0.1", ports.get(timeout=30)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8).tobytes()

    def once() -> None:
        sock.sendall(payload)
        sock.recv(1)

    sample = repeat(once, repeats, pids=(sink.pid,))
    sock.close()
    sink.join(30)
    return sample


def _stream_echo(address_queue, unix: bool, size: int, rounds: int) -> None:
    if unix:
        import tempfile

        path = os.path.join(tempfile.mkdtemp(), "echo.sock")
        server = socket.socket(socket.AF_UNIX)
        server.bind(path)
        server.listen()
        address_queue.put(path)
    else:
        server = socket.create_server(("127.0.0.1", 0))
        address_queue.put(("127.0.0.1", server.getsockname()[1]))
    conn, _ = server.accept()
    if not unix:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(size)
    view = memoryview(buf)
    for _ in range(rounds):
        got = 0
        while got < size:
            got += conn.recv_into(view[got:], size - got)
        conn.sendall(buf)
    conn.close()


def tcp_pingpong(size: int, rounds: int) -> float:
    """Median seconds for size bytes there and size bytes back over loopback TCP."""
    return _stream_pingpong(False, size, rounds)


def unix_pingpong(size: int, rounds: int) -> float:
    """Median seconds for size bytes there and back over a unix stream socket (kvd's local link)."""
    return _stream_pingpong(True, size, rounds)


def _stream_pingpong(unix: bool, size: int, rounds: int) -> float:
    ctx = mp.get_context("spawn")
    addresses = ctx.Queue()
    echo = ctx.Process(target=_stream_echo, args=(addresses, unix, size, rounds + 20))
    echo.start()
    if unix:
        sock = socket.socket(socket.AF_UNIX)
        sock.connect(addresses.get(timeout=30))
    else:
        sock = socket.create_connection(addresses.get(timeout=30))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = bytes(size)
    buf = bytearray(size)
    view = memoryview(buf)

    def once() -> None:
        sock.sendall(payload)
        got = 0
        while got < size:
            got += sock.recv_into(view[got:], size - got)

    sample = repeat(once, rounds, warmup=20)
    sock.close()
    echo.join(30)
    return sample.median


# --- raw pyzmq -----------------------------------------------------------------------------------

def _bind(sock: zmq.Socket, transport: str) -> str:
    """Bind to a fresh loopback port or ipc path; returns the endpoint to connect to."""
    if transport == "tcp":
        return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    import tempfile

    endpoint = f"ipc://{os.path.join(tempfile.mkdtemp(), 'z.sock')}"
    sock.bind(endpoint)
    return endpoint


def _zmq_sink(endpoint_queue, transport: str, nbytes: int, runs: int) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 0)
    endpoint_queue.put(_bind(router, transport))
    for _ in range(runs):
        got = 0
        while got < nbytes:
            frames = router.recv_multipart(copy=False)
            got += len(frames[2])
        router.send_multipart([frames[0].bytes, b"k"])
    router.close(linger=5000)  # linger 0 could drop the last ack, and the sender would wait forever
    ctx.term()


def zmq_throughput(nbytes: int, repeats: int, chunk: int = CHUNK) -> Sample:
    """DEALER -> ROUTER over tcp, header frame + payload frame per chunk, zero-copy send."""
    mpctx = mp.get_context("spawn")
    endpoints = mpctx.Queue()
    sink = mpctx.Process(target=_zmq_sink, args=(endpoints, "tcp", nbytes, repeats + 1))
    sink.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 0)
    dealer.connect(endpoints.get(timeout=30))
    payload = np.random.default_rng(2).integers(0, 256, nbytes, dtype=np.uint8)
    view = memoryview(payload)
    header = struct.pack("<QQ", 1, 2)

    def once() -> None:
        for off in range(0, nbytes, chunk):
            dealer.send_multipart([header, view[off:off + chunk]], copy=False)
        dealer.recv_multipart()

    sample = repeat(once, repeats, pids=(sink.pid,))
    dealer.close(0)
    ctx.term()
    sink.join(30)
    return sample


def _zmq_echo(endpoint_queue, transport: str, rounds: int) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    endpoint_queue.put(_bind(router, transport))
    for _ in range(rounds):
        router.send_multipart(router.recv_multipart(copy=False), copy=False)
    router.close(linger=5000)  # linger 0 could drop the last reply, and the client would wait forever
    ctx.term()


def zmq_pingpong(size: int, rounds: int, transport: str = "ipc") -> float:
    """Median seconds for a header + size-byte payload there and back over pyzmq (ipc or tcp)."""
    mpctx = mp.get_context("spawn")
    endpoints = mpctx.Queue()
    echo = mpctx.Process(target=_zmq_echo, args=(endpoints, transport, rounds + 20))
    echo.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoints.get(timeout=30))
    payload = bytes(size)

    def once() -> None:
        dealer.send_multipart([b"h" * 32, payload])
        dealer.recv_multipart()

    sample = repeat(once, rounds, warmup=20)
    dealer.close(0)
    ctx.term()
    echo.join(30)
    return sample.median

"""Faults must hurt only the operation they hit: everyone else keeps being served, exactly.

Three fault scenarios of test_faults.py / test_ops.py are re-run with a background workload on
a daemon that is not faulted: a thread doing local put/get round trips of random bytes (and,
where the test has a healthy peer, pushes to it, read back there), counting operations, errors
and mismatches. Each test asserts that the background load made progress with no error and no
mismatch, that the faulted operation failed with the right kvd error class, and that every pool
returns to its baseline.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time

import pytest
import torch

import kvd
from kvd.testing.daemons import DaemonProc, eventually, free_port, raw_connection, wait_ready
from kvd.wire import protocol as p

from .relay import PausingRelay

SIZES = [1, 4 << 10, 64 << 10, 300 << 10, 1 << 20, 2 << 20]  # bytes per background round trip


class BackgroundLoad(threading.Thread):
    """Round trips on `daemon` until stopped: put then get (consuming) locally; every third one is a
    push to `peer` (a name in daemon's config) read back on `peer_daemon` instead."""

    def __init__(self, daemon: DaemonProc, peer: str | None = None, peer_daemon: DaemonProc | None = None,
                 seed: int = 0) -> None:
        super().__init__(daemon=True, name=f"background-{daemon.node_id}")
        self.d, self.peer, self.peer_daemon = daemon, peer, peer_daemon
        self.rng = random.Random(seed)
        self.ops = self.pushes = self.mismatches = 0
        self.errors: list[str] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        c = self.d.client()
        cp = self.peer_daemon.client() if self.peer_daemon is not None else None
        try:
            i = 0
            while not self._stop_event.is_set():
                size = self.rng.choice(SIZES)
                data = torch.randint(0, 256, (size,), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(self.rng.getrandbits(31)))
                rid = f"bg-{self.d.node_id}-{i}"
                push = cp is not None and i % 3 == 2
                try:
                    if push:
                        c.put(rid, {"x": data}, dest=self.peer)
                        got = cp.get(rid, timeout=10)["x"]
                        self.pushes += 1
                    else:
                        c.put(rid, {"x": data})
                        got = c.get(rid, timeout=5)["x"]
                    if not torch.equal(got, data):
                        self.mismatches += 1
                    self.ops += 1
                except Exception as exc:
                    self.errors.append(f"{'push' if push else 'local'} {rid}: {type(exc).__name__}: {exc}")
                i += 1
        finally:
            c.close()
            if cp is not None:
                cp.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)
        assert not self.is_alive(), "background load did not stop"

    def check(self, min_ops: int = 1) -> None:
        print(f"background load on {self.d.node_id}: {self.ops} round trips ({self.pushes} pushes), "
              f"{len(self.errors)} errors, {self.mismatches} mismatches")
        assert self.ops >= min_ops, f"background load made {self.ops} round trips"
        assert not self.errors, f"{len(self.errors)} background errors: {self.errors[:5]}"
        assert self.mismatches == 0, f"{self.mismatches} background round trips returned other bytes"


@pytest.fixture
def background():
    """background(daemon, peer=None, peer_daemon=None) starts a BackgroundLoad; all are stopped at the end."""
    loads: list[BackgroundLoad] = []

    def start(daemon: DaemonProc, peer: str | None = None, peer_daemon: DaemonProc | None = None) -> BackgroundLoad:
        load = BackgroundLoad(daemon, peer, peer_daemon, seed=len(loads))
        load.start()
        loads.append(load)
        return load

    yield start
    for load in loads:
        if load.is_alive():
            load.stop()


def used_bytes(daemon: DaemonProc) -> int:
    with daemon.client() as c:
        return c.stats()["pool"]["used_bytes"]


def wait_used(daemon: DaemonProc, expected: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (used := used_bytes(daemon)) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"{daemon.node_id}: {used} pool bytes used, baseline {expected}")
        time.sleep(0.05)


def trio(daemons, extra: list[str], relay: PausingRelay | None = None) -> tuple[DaemonProc, DaemonProc, DaemonProc]:
    """A (the sender) with peers B (to be faulted; through `relay` if given) and C (healthy); B and
    C know A."""
    port_a, port_c = free_port(), free_port()
    port_b = relay.target_port if relay is not None else free_port()
    peer_a = {"A": f"tcp://127.0.0.1:{port_a}"}
    to_b = relay.endpoint if relay is not None else f"tcp://127.0.0.1:{port_b}"
    a = daemons.start("A", port=port_a, pool_size="192MiB", extra=extra, wait=False,
                      peers={"B": to_b, "C": f"tcp://127.0.0.1:{port_c}"})
    b = daemons.start("B", port=port_b, pool_size="320MiB", extra=extra, wait=False, peers=peer_a)
    c = daemons.start("C", port=port_c, pool_size="64MiB", extra=extra, wait=False, peers=peer_a)
    for d in (a, b, c):
        wait_ready(d)
    return a, b, c


class Push(threading.Thread):
    def __init__(self, daemon: DaemonProc, request_id: str, data: torch.Tensor, dest: str) -> None:
        super().__init__(daemon=True)
        self.d, self.request_id, self.data, self.dest = daemon, request_id, data, dest
        self.error: BaseException | None = None
        self.finished = 0.0

    def run(self) -> None:
        with self.d.client() as c:
            try:
                c.put(self.request_id, {"x": self.data}, dest=self.dest)
            except kvd.KvdError as exc:
                self.error = exc
            self.finished = time.monotonic()


@pytest.fixture
def relay():
    """A relay to B's port that lets 16 MiB through and then holds the rest: the push under test
    is still under way whenever its fault lands."""
    relay = PausingRelay(free_port(), 16 << 20)
    relay.start()
    yield relay
    relay.stop()


def wait_received(receiver: DaemonProc, nbytes: int, push: Push, relay: PausingRelay | None = None,
                  timeout: float = 20.0) -> None:
    """Until the receiver has taken in nbytes of the push (and the relay, if any, holds the rest:
    the fault lands mid-transfer)."""
    deadline = time.monotonic() + timeout
    if relay is not None:
        assert relay.paused.wait(timeout), f"the relay forwarded only {relay.forwarded} bytes"
    with receiver.client() as c:
        while c.stats()["counters"]["received_bytes"] < nbytes:
            assert push.is_alive(), f"the push ended before the fault: {push.error!r}"
            assert time.monotonic() < deadline, "the push made no progress"
            time.sleep(0.002)


def test_receiver_killed_mid_push_under_background_load(daemons, background, relay):
    a, b, c = trio(daemons, ["--transfer-timeout", "2s"], relay)
    baseline = {d.node_id: used_bytes(d) for d in (a, c)}
    load = background(a, peer="C", peer_daemon=c)
    time.sleep(0.3)
    big = torch.randint(0, 256, (128 << 20,), dtype=torch.uint8)
    push = Push(a, "doomed", big, "B")
    push.start()
    wait_received(b, 8 << 20, push, relay)
    b.kill(signal.SIGKILL)
    killed = time.monotonic()
    push.join(30)
    assert not push.is_alive()
    assert isinstance(push.error, kvd.PeerUnavailable), repr(push.error)
    assert push.finished - killed < 15
    print(f"push failed {push.finished - killed:.2f}s after the kill: {push.error!r}")
    time.sleep(0.5)  # the load keeps running after the fault, too
    load.stop()
    load.check()
    assert load.pushes > 0
    for d in (a, c):
        wait_used(d, baseline[d.node_id])
    with a.client() as ca:
        assert ca.stats()["entries"] == 0


FREEZE_FLAGS = ["--heartbeat-interval", "0.3s", "--heartbeat-timeout", "1.5s", "--transfer-timeout", "6s"]


def test_receiver_frozen_past_heartbeat_under_background_load(daemons, background, relay):
    a, b, c = trio(daemons, FREEZE_FLAGS, relay)
    baseline = {d.node_id: used_bytes(d) for d in (a, b, c)}
    load = background(a, peer="C", peer_daemon=c)
    time.sleep(0.3)
    big = torch.zeros(128 << 20, dtype=torch.uint8)
    push = Push(a, "frozen", big, "B")
    push.start()
    wait_received(b, 8 << 20, push, relay)
    b.kill(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        push.join(30)
    finally:
        b.kill(signal.SIGCONT)
    assert not push.is_alive()
    assert isinstance(push.error, kvd.PeerUnavailable), repr(push.error)
    assert push.finished - stopped < 1.5 + 2  # the heartbeat timeout, not the 6 s transfer timeout
    relay.release()  # (B runs again: what was held reaches it, and a new connection goes through)
    time.sleep(0.5)
    load.stop()
    load.check()
    assert load.pushes > 0
    for d in (a, c):
        wait_used(d, baseline[d.node_id])
    # B drops its half-received entry once it runs again: at once if it notices A's silence too,
    # else at its transfer timeout (see test_retry_after_a_receiver_stall_is_accepted)
    wait_used(b, baseline["B"], timeout=6 + 3)
    with a.client() as ca, b.client() as cb:
        ca.put("after-freeze", {"x": torch.arange(1000)}, dest="B")
        assert torch.equal(cb.get("after-freeze", timeout=5)["x"], torch.arange(1000))


def _die_after_put_alloc(endpoint: str, conn) -> None:
    local = raw_connection(endpoint)
    local.send(p.encode(p.PutAlloc(req=1, request_id="orphan", tensors=[["x", "uint8", [16 << 20]]])))
    slots = p.decode(local.receive(5))
    conn.send(getattr(slots, "token", None))  # a pipe send is done when it returns, unlike a Queue's
    conn.recv()  # wait until the test has seen the reservation
    os._exit(0)  # crash between reserve and commit


def test_client_killed_mid_put_under_background_load(daemons, background):
    a, b = daemons.pair(pool_size="128MiB")  # the default 30 s lease: the crash itself frees the blocks
    baseline = {d.node_id: used_bytes(d) for d in (a, b)}
    load = background(a, peer="B", peer_daemon=b)
    time.sleep(0.3)
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    proc = ctx.Process(target=_die_after_put_alloc, args=(a.socket, child_end))
    proc.start()
    assert parent_end.poll(30), "the client process did not report its reservation"
    token = parent_end.recv()
    assert token is not None
    with a.client() as ca:
        assert any(e["request_id"] == "orphan" and e["state"] == "writing" for e in ca.list())
        with pytest.raises(kvd.NotFound):
            ca.get("orphan", timeout=0)  # never committed: not visible
        parent_end.send("die")
        proc.join(20)
        assert proc.exitcode == 0
        deadline = time.monotonic() + 3
        while any(e["request_id"] == "orphan" for e in ca.list()):  # freed on the disconnect
            assert time.monotonic() < deadline, "the dead client's reservation was not freed"
            time.sleep(0.05)
        with pytest.raises(kvd.NotFound):
            ca.get("orphan", timeout=0)
    # the dead client's commit, had it been sent late, is refused with NotFound (its token is gone)
    local = raw_connection(a.socket)
    try:
        local.send(p.encode(p.PutCommit(req=2, request_id="orphan", token=token)))
        reply = p.decode(local.receive(5))
    finally:
        local.close()
    assert isinstance(reply, p.Error) and reply.code == kvd.NotFound.code, reply
    load.stop()
    load.check()
    assert load.pushes > 0
    for d in (a, b):
        wait_used(d, baseline[d.node_id])


def test_retry_after_a_receiver_stall_is_accepted(daemons, relay):
    port_a = free_port()
    a = daemons.start("A", port=port_a, pool_size="192MiB", extra=FREEZE_FLAGS, peers={"B": relay.endpoint})
    b = daemons.start("B", port=relay.target_port, pool_size="192MiB", extra=FREEZE_FLAGS,
                      peers={"A": f"tcp://127.0.0.1:{port_a}"})
    big = torch.randint(0, 256, (128 << 20,), dtype=torch.uint8)
    push = Push(a, "stalled", big, "B")
    push.start()
    wait_received(b, 8 << 20, push, relay)
    b.kill(signal.SIGSTOP)
    try:
        push.join(30)
    finally:
        b.kill(signal.SIGCONT)
    assert isinstance(push.error, kvd.PeerUnavailable), repr(push.error)
    relay.release()  # the retry's connection goes through
    with a.client() as ca, b.client() as cb:
        eventually(lambda: ca.stats()["peers"]["B"]["connected"], timeout=10)  # B runs again, and answers
        ca.put("stalled", {"x": big}, dest="B")  # the client retries its failed push
        assert torch.equal(cb.get("stalled", timeout=5)["x"], big)

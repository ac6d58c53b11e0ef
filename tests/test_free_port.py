"""The test harness's port picker: two daemons started by one test never get the same port.

CI once failed six tests at once because free_port() (then bind to port 0, read, close) returned the
same port twice in a row and both daemons of a pair were told to listen on it."""
from __future__ import annotations

import socket

from kvd.testing import daemons as testing


def test_no_port_is_handed_out_twice_and_none_is_from_the_ephemeral_range():
    ports = [testing.free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
    assert max(ports) < testing._ephemeral_low()


def test_a_port_in_use_is_never_handed_out(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        draws = iter([busy, busy])  # the busy port is drawn twice, then anything
        fresh = testing.random.SystemRandom()
        monkeypatch.setattr(testing._pick, "randrange", lambda a, b: next(draws, None) or fresh.randrange(a, b))
        monkeypatch.setattr(testing, "_ephemeral_low", lambda: 65536)
        port = testing.free_port()
    assert port != busy



def test_xdist_workers_draw_from_disjoint_slices(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    slices = []
    for worker in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
        slices.append(range(*testing.port_range()))
    assert all(len(s) > 1000 for s in slices)
    assert slices[0].stop <= slices[1].start and slices[1].stop <= slices[2].start
    assert slices[2].stop <= testing._ephemeral_low()

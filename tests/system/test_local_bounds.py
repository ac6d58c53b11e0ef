"""What local client connections can hold of a daemon: waiting gets are capped per connection and go
with a client that hangs up; idle connections cannot lock a new client out. Real daemons, real
sockets."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
import torch

import kvd
from kvd.client.connection import ask
from kvd.daemon.local.get_side import MAX_WAITS_PER_CONNECTION
from kvd.daemon.local.server import IDLE_GRACE
from kvd.testing.daemons import eventually, raw_connection
from kvd.wire import protocol as p
from kvd.wire.endpoints import unix_path
from kvd.wire.framing import encode_message


def rss_anon_mb(pid: int) -> float:
    """The daemon's anonymous resident memory (its heap; the pool's shared pages are not in it)."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssAnon")) / 1024


def waiting_reads(daemon) -> int:
    return ask(p.Stats(req=1), daemon.socket)["waiting_reads"]


def hello(conn) -> None:
    conn.send(p.encode(p.Hello(req=1, client="test")))
    assert isinstance(p.decode(conn.receive(10)), p.HelloOk)


def send_gets(conn, prefix: str, count: int, first_req: int = 2) -> None:
    """count gets of ids nobody has (an hour's timeout each), in one write."""
    conn._sock.sendall(b"".join(
        encode_message(p.encode(p.Get(req=first_req + i, request_id=f"{prefix}-{i}", timeout=3600.0)))
        for i in range(count)))


def test_one_connection_holds_a_bounded_number_of_waiting_gets(daemon):
    conn = raw_connection(daemon.socket)
    hello(conn)
    extra = 300
    send_gets(conn, "missing", MAX_WAITS_PER_CONNECTION + extra)
    refused = []
    for _ in range(extra):
        frames = conn.receive(10)
        assert frames is not None, "gets past the bound were not refused"
        refused.append(p.decode(frames))
    assert all(isinstance(r, p.Error) and r.code == 7 and "too many gets in flight on this connection" in r.message
               for r in refused), refused[0]
    # the first ones wait, the ones past the bound were refused (each on its own req)
    assert sorted(r.req for r in refused) == list(range(2 + MAX_WAITS_PER_CONNECTION,
                                                        2 + MAX_WAITS_PER_CONNECTION + extra))
    assert waiting_reads(daemon) == MAX_WAITS_PER_CONNECTION
    # a wait still ends as a get should: the entry arrives and the get has it
    with daemon.client() as c:
        c.put("missing-7", {"x": torch.arange(10)})
    slots = p.decode(conn.receive(10))
    assert isinstance(slots, p.GetSlots) and slots.req == 2 + 7
    conn.send(p.encode(p.GetDone(req=99_999, request_id="missing-7", token=slots.token, consume=True, reply=True)))
    assert isinstance(p.decode(conn.receive(10)), p.Ok)
    assert waiting_reads(daemon) == MAX_WAITS_PER_CONNECTION - 1
    # room for one more
    conn.send(p.encode(p.Get(req=100_000, request_id="one-more", timeout=3600.0)))
    eventually(lambda: waiting_reads(daemon) == MAX_WAITS_PER_CONNECTION)
    conn.close()
    eventually(lambda: waiting_reads(daemon) == 0, timeout=5)


def test_the_waits_of_clients_that_hang_up_go_with_them(daemon):
    # three clients each send 50,000 gets that would wait an hour, and hang up: nothing of them stays
    before = rss_anon_mb(daemon.pid)
    for k in range(3):
        conn = raw_connection(daemon.socket)
        hello(conn)
        send_gets(conn, f"never-{k}", 50_000)
        conn.close()
        eventually(lambda: waiting_reads(daemon) == 0, timeout=5)
    grown = rss_anon_mb(daemon.pid) - before
    assert grown < 48, f"the daemon's heap grew by {grown:.0f} MB"
    with daemon.client() as c:
        c.put("still-served", {"x": torch.arange(100)})
        assert torch.equal(c.get("still-served", timeout=5)["x"], torch.arange(100))


def test_idle_connections_do_not_lock_a_new_client_out(daemons):
    d = daemons.start("A", extra=["--max-clients", "32"])
    busy = raw_connection(d.socket)  # the oldest, but it waits for an entry: never evicted
    hello(busy)
    busy.send(p.encode(p.Get(req=2, request_id="awaited", timeout=60.0)))
    eventually(lambda: waiting_reads(d) == 1)
    old = d.client().connect()  # a client that said hello and has done nothing since
    idle = []
    for _ in range(30):  # 32 connections in all: the cap
        conn = raw_connection(d.socket)
        hello(conn)
        idle.append(conn)
    time.sleep(IDLE_GRACE + 0.5)  # (a connection is evicted only once it has been idle that long)
    with d.client() as c:  # a new worker works (in the place of the connection idle longest)...
        c.put("fresh", {"x": torch.arange(10)})
        assert torch.equal(c.get("fresh")["x"], torch.arange(10))
        status = subprocess.run([sys.executable, "-m", "kvd", "status", "--socket", d.socket, "--json"],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr  # ...and so does kvd status (in the next one's)
        assert json.loads(status.stdout)["local_clients"] == 32
        # the raw connection evicted was told why, then closed
        error = p.decode(idle[0].receive(5))
        assert isinstance(error, p.Error) and "--max-clients" in error.message and "idle" in error.message, error
        with pytest.raises(kvd.KvdError, match="lost"):
            idle[0].receive(5)
        # the evicted client reconnects by itself at its next call
        assert old.stats()["local_clients"] == 32
    old.close()
    # the busy connection kept its wait, and has its entry once it comes
    assert waiting_reads(d) == 1
    with d.client() as c:
        c.put("awaited", {"x": torch.arange(3)})
    slots = p.decode(busy.receive(10))
    assert isinstance(slots, p.GetSlots) and slots.req == 2
    for conn in [busy, *idle]:
        conn.close()


def test_connections_that_never_speak_or_only_wait_cannot_lock_a_client_out(daemons):
    # a leaky process fills --max-clients: first with connections that never say a word, then
    # with connections that each park a get for an hour. A client of the same uid is told why
    # while none can make room yet, and gets in within a second or so: the silent ones go first,
    # then the ones that only wait (their gets end, and they are told why). Before, it waited 10 s
    # for the silent ones and was refused for good by the waiting ones.
    d = daemons.start("A", extra=["--max-clients", "32"])
    silent = []
    for _ in range(32):
        s = socket.socket(socket.AF_UNIX)
        s.connect(unix_path(d.socket))
        silent.append(s)
    with pytest.raises(kvd.BadRequest, match=r"--max-clients.*none can make room now"):
        d.client().connect()  # (told why, not "connection lost")
    started = time.monotonic()
    eventually(lambda: served(d), timeout=5)
    print(f"a client got in {time.monotonic() - started:.1f}s after 32 silent connections filled the cap")
    for s in silent:
        s.close()
    waiting = []
    for i in range(32):
        conn = raw_connection(d.socket)
        hello(conn)
        conn.send(p.encode(p.Get(req=2, request_id=f"never-{i}", timeout=3600.0)))
        waiting.append(conn)
    started = time.monotonic()
    eventually(lambda: served(d), timeout=5)
    print(f"a client got in {time.monotonic() - started:.1f}s after 32 waiting connections filled the cap")
    evicted = [conn for conn in waiting if not conn.alive()]
    assert evicted, "no waiting connection made room"
    error = p.decode(evicted[0].receive(5))
    assert isinstance(error, p.Error) and "--max-clients" in error.message and "gets waiting" in error.message
    # the evicted ones' gets ended with them (each ask may evict one more while the last client's
    # close is still on its way: hence eventually)
    eventually(lambda: waiting_reads(d) == sum(conn.alive() for conn in waiting), timeout=5)
    for conn in waiting:
        conn.close()


def served(daemon) -> bool:
    try:
        with daemon.client() as c:
            c.put("still-served", {"x": torch.arange(100)})
            return torch.equal(c.get("still-served")["x"], torch.arange(100))
    except kvd.KvdError:  # (refused while none can make room)
        return False

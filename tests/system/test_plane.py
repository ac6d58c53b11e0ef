"""The NIXL data plane between real daemons (issue 40): bytes by one-sided NIXL writes (push) and
reads (pull) over UCX, under kvd's ZeroMQ control plane, on TCP (as between hosts) and on shared
memory (as two daemons of one host: UCX's cma moves the bytes, TCP only sets it up).

Every test checks the bytes and that the plane, not ZeroMQ, moved them (its operations counted),
and ends with nothing parked and no operation left (`kvd status`'s plane section)."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import kvd
from kvd.daemon.plane.nixl import available
from kvd.testing.daemons import eventually, free_port, wait_ready
from kvd.trust.keygen import keygen_ca, keygen_node

if not available():
    if os.environ.get("CI") == "true":
        raise RuntimeError("NIXL is not installed (./dev test installs it)")
    pytest.skip("NIXL is not installed (./dev setup installs it)", allow_module_level=True)

TRANSPORTS = {"tcp": {"UCX_TLS": "tcp"}, "shm": {"UCX_TLS": "sm,tcp"}}
NIXL = ["--data-plane", "nixl"]
MiB = 1 << 20
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8,
          torch.uint8, torch.int32, torch.int64]


def plane_pair(daemons, transport: str = "tcp", extra=(), extra_a=(), extra_b=(), env_a=None, env_b=None,
               pool_size: str = "256MiB"):
    """A and B, each the other's peer, both on the NIXL plane over `transport`."""
    env = TRANSPORTS[transport]
    port_a, port_b = free_port(), free_port()
    a = daemons.start("A", port=port_a, pool_size=pool_size, extra=[*NIXL, *extra, *extra_a], wait=False,
                      env={**env, **(env_a or {})}, peers={"B": f"tcp://127.0.0.1:{port_b}"})
    b = daemons.start("B", port=port_b, pool_size=pool_size, extra=[*NIXL, *extra, *extra_b], wait=False,
                      env={**env, **(env_b or {})}, peers={"A": f"tcp://127.0.0.1:{port_a}"})
    wait_ready(a)
    wait_ready(b)
    return a, b


def plane(daemon) -> dict:
    with daemon.client() as c:
        return c.stats()["plane"]


def settled(*daemons) -> None:
    """Nothing parked for a peer, no plane operation left, no pool byte held but by entries."""
    for daemon in daemons:
        eventually(lambda d=daemon: plane(d)["parked"] == 0 and plane(d)["ops_running"] == 0
                   and plane(d)["draining"] == 0, timeout=10)


def tensors(total: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every dtype, `total` bytes in all (over the plane's 1 MiB floor)."""
    g = torch.Generator().manual_seed(seed)
    per = total // len(DTYPES)
    kv = {}
    for dtype in DTYPES:
        raw = torch.randint(0, 256, (per - per % 8,), dtype=torch.uint8, generator=g)
        kv[f"t.{str(dtype).removeprefix('torch.')}"] = raw.view(dtype)
    return kv


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_dtype_is_pushed_and_pulled_bit_exact_over_the_plane(daemons, transport):
    a, b = plane_pair(daemons, transport)
    kv = tensors(40 * MiB)
    with a.client() as ca, b.client() as cb:
        ca.put("pushed", kv, dest="B")
        assert same(cb.get("pushed", timeout=10), kv)
        writes = plane(a)["done"]
        assert writes >= 3 and plane(a)["failed"] == 0  # 40 MiB in 16 MiB slices, written by A's plane
        ca.put("pulled", kv)
        assert same(cb.get("pulled", source="A", timeout=10), kv)
        assert plane(b)["done"] >= 3  # read by B's plane
        assert ca.stats()["pool"]["used_bytes"] == 0 and cb.stats()["pool"]["used_bytes"] == 0
    settled(a, b)


def test_a_small_entry_goes_as_frames_even_on_a_plane_link(daemons):
    a, b = plane_pair(daemons)
    small = {"x": torch.arange(1000, dtype=torch.int64)}  # 8 KB: under the 1 MiB floor
    with a.client() as ca, b.client() as cb:
        ca.put("small", small, dest="B")
        assert same(cb.get("small", timeout=5), small)
    assert plane(a)["posted"] == 0 and plane(b)["posted"] == 0


def test_the_bench_knobs_move_the_cut_over_and_the_slices(daemons):
    # bench/planes.py's --plane-cutover: a 64 KiB entry forced onto the plane, 16 MiB in 4 MiB slices
    knobs = {"KVD_TEST_PLANE_MIN_BYTES": str(64 << 10), "KVD_TEST_PLANE_SLICE_BYTES": str(4 * MiB),
             "KVD_TEST_PLANE_IN_FLIGHT": "4"}
    a, b = plane_pair(daemons, env_a=knobs, env_b=knobs)
    small, big = ({"x": torch.randint(0, 256, (n,), dtype=torch.uint8)} for n in (64 << 10, 16 * MiB))
    with a.client() as ca, b.client() as cb:
        ca.put("small", small, dest="B")
        assert same(cb.get("small", timeout=5), small)
        assert plane(a)["posted"] == 1  # written by A's plane, not sent as a frame
        ca.put("big", big, dest="B")
        assert same(cb.get("big", timeout=10), big)
        assert plane(a)["posted"] == 1 + 4  # 16 MiB in 4 MiB slices
        ca.put("pulled", small)
        assert same(cb.get("pulled", source="A", timeout=5), small)
        assert plane(b)["posted"] == 1  # read by B's plane
    settled(a, b)


def test_a_bad_bench_knob_stops_the_daemon_saying_why(daemons):
    with pytest.raises(AssertionError, match="KVD_TEST_PLANE_SLICE_BYTES='4MiB': a whole number"):
        daemons.start("A", extra=NIXL, env={"KVD_TEST_PLANE_SLICE_BYTES": "4MiB"})


def test_a_stream_and_paged_blocks_ride_the_plane(daemons):
    a, b = plane_pair(daemons)
    layers = {f"layer.{i}": torch.randn(1 << 18) for i in range(8)}  # 1 MiB a layer
    paged = torch.randn(64, 16, 32, 128, dtype=torch.bfloat16)  # 128 KiB a block
    ids = [40, 3, 17, 9, 60, 22, 31, 5, 44, 12, 57, 1, 33, 28, 50, 19]  # 2 MiB in all, scattered
    with a.client() as ca, b.client() as cb:
        with ca.put_stream("streamed", {n: t for n, t in layers.items()}, dest="B") as stream:
            for name, tensor in layers.items():  # layer by layer, as a prefill writes them
                stream.write({name: tensor})
        assert same(cb.get("streamed", timeout=10), layers)
        streamed = plane(a)["posted"]
        assert streamed >= 1
        ca.put_blocks("paged", {"k": paged}, ids, dest="B")
        out = torch.zeros_like(paged)
        cb.get_blocks("paged", {"k": out}, list(range(16)))
        assert torch.equal(out[:16].view(torch.int16), paged[ids].view(torch.int16))
    assert plane(a)["posted"] > streamed
    settled(a, b)


def test_sixteen_transfers_at_once(daemons):
    a, b = plane_pair(daemons, pool_size="512MiB")
    payloads = {f"r{i}": {"x": torch.randint(0, 256, ((1 + i % 4) * 4 * MiB,), dtype=torch.uint8)}
                for i in range(16)}
    errors = []

    def push(name: str) -> None:
        try:
            with a.client() as c:
                c.put(name, payloads[name], dest="B")
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(name,)) for name in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    with b.client() as cb:
        for name, kv in payloads.items():
            assert same(cb.get(name, timeout=10), kv)
    assert plane(a)["failed"] == 0
    settled(a, b)


def test_the_plane_under_curve_and_the_cluster_ca(daemons, tmp_path):
    keys = tmp_path / "keys"
    keygen_ca(str(keys))
    flags = {}
    for node in ("A", "B"):
        keygen_node(str(keys), node, ca_secret=str(keys / "ca.key_secret"), cluster="kvd")
        flags[node] = ["--curve-secret-key", str(keys / f"{node}.key_secret"), "--curve-ca", str(keys / "ca.key"),
                       "--curve-allow", str(keys)]
    a, b = plane_pair(daemons, extra_a=flags["A"], extra_b=flags["B"])
    kv = {"x": torch.randint(0, 256, (24 * MiB,), dtype=torch.uint8)}
    with a.client() as ca, b.client() as cb:
        assert ca.stats()["peers"]  # (CURVE on)
        ca.put("curve", kv, dest="B")
        assert same(cb.get("curve", timeout=10), kv)
        ca.put("curve-pull", kv)
        assert same(cb.get("curve-pull", source="A", timeout=10), kv)
    assert plane(a)["done"] >= 2 and plane(b)["done"] >= 2
    settled(a, b)


def test_a_peer_without_the_plane_is_refused_by_nixl_and_served_over_frames_by_auto(daemons):
    port_b = free_port()
    b = daemons.start("B", port=port_b, extra=["--data-plane", "zmq"])
    strict = daemons.start("S", extra=NIXL, peers={"B": f"tcp://127.0.0.1:{port_b}"})
    lenient = daemons.start("L", extra=["--data-plane", "auto"], peers={"B": f"tcp://127.0.0.1:{port_b}"})
    kv = {"x": torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8)}
    with strict.client() as cs, pytest.raises(kvd.KvdError, match=r"cannot use the NIXL plane.*--data-plane zmq"):
        cs.put("strict", kv, dest="B")
    with lenient.client() as cl, b.client() as cb:
        cl.put("lenient", kv, dest="B")
        assert same(cb.get("lenient", timeout=10), kv)
    assert plane(lenient)["posted"] == 0  # (its link to B rides frames)
    assert b.client().stats()["plane"] is None


# --- faults: nothing lands in blocks given to someone else, nothing is left behind ----------------------

SLOW = {"KVD_TEST_PLANE_POST_DELAY": "0.4"}  # A posts each slice 0.4 s after it is due: faults land mid-push


def push_in_background(daemon, name: str, kv: dict) -> tuple[threading.Thread, list]:
    outcome: list = []

    def run() -> None:
        try:
            with daemon.client() as c:
                c.put(name, kv, dest="B")
            outcome.append(None)
        except kvd.KvdError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def received(daemon) -> int:
    with daemon.client() as c:
        return c.stats()["counters"]["received_bytes"]


def test_a_writer_frozen_mid_push_never_writes_into_blocks_given_to_another(daemons):
    # B's pool holds the push and nothing else: blocks it gave up too early would be the victim's
    flags = ["--transfer-timeout", "1s", "--heartbeat-interval", "0.2s", "--heartbeat-timeout", "1s"]
    a, b = plane_pair(daemons, extra=flags, env_a=SLOW, pool_size="64MiB")
    kv = {"x": torch.full((48 * MiB,), 0xAA, dtype=torch.uint8)}
    thread, outcome = push_in_background(a, "doomed", kv)
    eventually(lambda: received(b) >= 16 * MiB, timeout=20)  # slice 0 is in; slices 1, 2 are still due
    assert thread.is_alive()
    a.kill(signal.SIGSTOP)
    try:
        eventually(lambda: plane(b)["parked"] == 1, timeout=15)  # B gave up on it: its grant is parked
        victim = {"x": torch.randint(0, 255, (48 * MiB,), dtype=torch.uint8)}
        with b.client() as cb:
            with pytest.raises(kvd.PoolFull):  # the 48 MiB grant is not anyone else's yet
                cb.put("victim", victim)
            small = {"x": torch.randint(0, 255, (16 * MiB,), dtype=torch.uint8)}
            cb.put("small-victim", small)
    finally:
        a.kill(signal.SIGCONT)
    thread.join(30)
    assert isinstance(outcome[0], kvd.KvdError), outcome  # its put failed, and it knows
    settled(a, b)  # A's late writes landed, then A said released: B's grant is free
    with b.client() as cb:
        assert same(cb.get("small-victim", keep=True, timeout=5), small)
        cb.put("victim", victim)  # (the grant's blocks are free now)
        assert same(cb.get("victim", timeout=5), victim)


def test_a_writer_killed_mid_push_leaves_its_grant_parked_until_it_restarts(daemons):
    flags = ["--transfer-timeout", "2s"]
    a, b = plane_pair(daemons, extra=flags, env_a=SLOW, pool_size="64MiB")
    kv = {"x": torch.full((48 * MiB,), 0xAA, dtype=torch.uint8)}
    thread, _ = push_in_background(a, "doomed", kv)
    eventually(lambda: received(b) >= 16 * MiB, timeout=20)
    assert thread.is_alive()
    a.kill(signal.SIGKILL)
    eventually(lambda: plane(b)["parked"] == 1, timeout=15)
    with b.client() as cb:
        assert cb.stats()["entries"] == 0 and cb.stats()["pool"]["parked_bytes"] == 48 * MiB
    # A comes back (a new incarnation): the old agent, and whatever it had posted, is gone
    again = daemons.start("A", port=int(a.listen.rsplit(":", 1)[1]), pool_size="64MiB", extra=[*NIXL, *flags],
                          env=TRANSPORTS["tcp"], peers={"B": b.listen})
    with again.client() as c:
        c.put("again", {"x": torch.ones(4 * MiB, dtype=torch.uint8)}, dest="B")  # (its hello reaches B)
    settled(b)
    with b.client() as cb:
        assert cb.stats()["pool"]["parked_bytes"] == 0


def test_a_receiver_killed_mid_push_fails_the_push_and_frees_the_sender(daemons):
    a, b = plane_pair(daemons, extra=["--transfer-timeout", "2s"], env_a=SLOW)
    kv = {"x": torch.randint(0, 256, (48 * MiB,), dtype=torch.uint8)}
    thread, outcome = push_in_background(a, "doomed", kv)
    eventually(lambda: received(b) >= 16 * MiB, timeout=20)
    assert thread.is_alive()
    b.kill(signal.SIGKILL)
    thread.join(30)
    assert isinstance(outcome[0], kvd.PeerUnavailable), outcome
    settled(a)
    with a.client() as ca:
        eventually(lambda: ca.stats()["pool"]["used_bytes"] == 0, timeout=20)
        ca.put("alive", {"x": torch.arange(10)})
        assert same(ca.get("alive"), {"x": torch.arange(10)})


def test_a_slice_changed_after_its_digest_is_refused(daemons):
    a, b = plane_pair(daemons, env_a={"KVD_TEST_CORRUPT_AFTER_EVERY_NTH_DIGEST": "2"})
    kv = {"x": torch.randint(0, 256, (40 * MiB,), dtype=torch.uint8)}
    with a.client() as ca, b.client() as cb:
        with pytest.raises(kvd.ChecksumMismatch):
            ca.put("corrupt", kv, dest="B")
        assert cb.stats()["entries"] == 0
    settled(a, b)
    with b.client() as cb:
        assert cb.stats()["pool"]["used_bytes"] == 0


def listening_addresses(pid: int) -> set[str]:
    """The addresses of the TCP sockets a process listens on (its fds' inodes in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address = fields[1].split(":")[0]
                found.add(address)
    return found


def test_the_plane_listens_on_the_listen_address_only(daemons):
    a, b = plane_pair(daemons)
    with a.client() as ca, b.client() as cb:  # (UCX's listeners are up once a transfer went)
        ca.put("x", {"x": torch.ones(2 * MiB, dtype=torch.uint8)}, dest="B")
        cb.get("x", timeout=10)
    for daemon in (a, b):
        assert listening_addresses(daemon.pid) == {"0100007F"}, "a listener beyond 127.0.0.1"  # (little-endian)


def test_without_nixl_installed_nixl_says_how_to_install_it_and_auto_runs_on_zeromq(daemons, tmp_path):
    # every NIXL build shadowed by a module that cannot be imported, as on a machine without the extra
    shadow = tmp_path / "shadow"
    for build in ("nixl_cu12", "nixl_cu13", "nixl_rocm"):
        (shadow / build).mkdir(parents=True)
        (shadow / build / "__init__.py").write_text("raise ImportError('not installed here')\n")
    env = {"PYTHONPATH": f"{shadow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    strict = daemons.start("S", extra=["--data-plane", "nixl"], env=env, wait=False)
    assert strict.proc.wait(30) != 0
    assert "pip install '.[nixl]'" in strict.log() and "Traceback" not in strict.log()
    lenient = daemons.start("L", extra=["--data-plane", "auto"], env=env)
    with lenient.client() as c:
        assert c.stats()["plane"] is None
    assert "NIXL" in lenient.log()


def test_kvd_status_shows_the_plane(daemons):
    import subprocess
    import sys

    a, _b = plane_pair(daemons)
    with a.client() as ca:
        ca.put("x", {"x": torch.ones(2 * MiB, dtype=torch.uint8)}, dest="B")
    out = subprocess.run([sys.executable, "-m", "kvd", "status", "--socket", a.socket], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if line.startswith("data plane"))
    assert "nixl (nixl)" in line and "DRAM pool registered" in line and "kvd/B/" in line and "1 posted" in line

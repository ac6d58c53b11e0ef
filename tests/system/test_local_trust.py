"""Another user of this host gets nothing: a squatted socket directory is refused, a client never
hands its cache to another user's process on the socket, the uid check covers the host's own
addresses (not only loopback), and a peer cannot pin an entry beyond our ttl. Real daemons."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import zmq

import kvd
from kvd.testing.daemons import free_port
from kvd.wire import protocol as p

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
NOBODY = 65534


def start_refused(tmp_path, directory) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd", "serve", "--socket", f"unix://{directory}/kvd.sock",
                           "--listen", f"tcp://127.0.0.1:{free_port()}", "--metrics-port", "0", "--pool-size", "4MiB"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


def test_a_socket_directory_others_can_write_is_refused(tmp_path):
    squat = tmp_path / "kvd-squat"
    squat.mkdir()
    os.chmod(squat, 0o777)  # as another user would leave /tmp/kvd-UID for us to use
    refused = start_refused(tmp_path, squat)
    assert refused.returncode == 1
    assert "refusing the socket directory" in refused.stderr and "writable by others (mode 777)" in refused.stderr
    assert not (squat / "kvd.sock").exists()


@needs_root
def test_a_socket_directory_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "kvd-theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    refused = start_refused(tmp_path, theirs)
    assert refused.returncode == 1 and f"owned by uid {NOBODY}" in refused.stderr


def _fake_daemon(path: str, ready) -> None:
    """In a forked child: another user listening on the socket path a worker will use."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    ready.send(True)
    conn, _ = server.accept()
    ready.send(conn.recv(4096))  # what the worker sent it, if anything
    time.sleep(1)


@needs_root
def test_a_client_never_talks_to_another_users_process_on_its_socket():
    import shutil
    import tempfile

    directory = tempfile.mkdtemp(prefix="kvd-shared-", dir="/tmp")  # (the test's own tmp dir is root's, 0700)
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "kvd.sock")
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    fake = ctx.Process(target=_fake_daemon, args=(path, theirs))
    fake.start()
    try:
        assert ours.poll(20) and ours.recv()
        with pytest.raises(kvd.Unauthorized, match=f"runs as uid {NOBODY}"), kvd.Client(f"unix://{path}") as c:
            c.put("secret", {"x": torch.arange(10)})
        assert ours.poll(5) and ours.recv() == b""  # it never got a byte: the connection was dropped at once
    finally:
        fake.kill()
        fake.join(5)
        shutil.rmtree(directory, ignore_errors=True)


def _pull_as(endpoint: str, report) -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(p.encode(p.PeerHello(node_id="intruder", incarnation=1)))
    sock.send_multipart(p.encode(p.Pull(xfer=5, request_id="private", timeout=1.0)))
    lines = []
    while sock.poll(3000):
        msg = p.decode(sock.recv_multipart())
        lines.append(f"{msg.TYPE} {getattr(msg, 'code', '')} {getattr(msg, 'message', '')}")
    report.send(lines)


def host_address() -> str | None:
    """One of this host's own addresses beyond loopback (the kernel picks it to reach the outside)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET: nothing is sent on a UDP connect
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


@needs_root
def test_another_user_is_refused_through_the_hosts_own_address(daemons):
    address = host_address()
    if address is None:
        pytest.skip("this host has no address beyond loopback")
    port = free_port()
    a = daemons.start("A", extra=["--listen", f"tcp://0.0.0.0:{port}", "--insecure"])
    with a.client() as c:
        c.put("private", {"x": torch.arange(100)})
        ctx = mp.get_context("fork")
        ours, theirs = ctx.Pipe()
        intruder = ctx.Process(target=_pull_as, args=(f"tcp://{address}:{port}", theirs))
        intruder.start()
        assert ours.poll(30)
        lines = ours.recv()
        intruder.join(10)
        assert lines and lines[0].startswith(f"abort {kvd.Unauthorized.code}") and f"uid {NOBODY}" in lines[0], lines
        assert torch.equal(c.get("private", timeout=0)["x"], torch.arange(100))


def test_a_peer_cannot_pin_an_entry_beyond_our_ttl(daemons):
    a = daemons.start("A", extra=["--default-ttl", "60s"])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(a.listen)
    sock.send_multipart(p.encode(p.PeerHello(node_id="pinner", incarnation=1)))
    for xfer, ttl in ((1, 0.0), (2, 1e9), (3, 5.0)):  # "forever", a century, and a shorter one it may ask
        sock.send_multipart(p.encode(p.Offer(xfer=xfer, request_id=f"pinned-{xfer}", tensors=[["x", "uint8", [0]]],
                                             total_bytes=0, chunk_size=1 << 20, checksum="none", ttl=ttl)))
    with a.client() as c:
        deadline = time.monotonic() + 10
        while len(c.list()) < 3:
            assert time.monotonic() < deadline, c.list()
            time.sleep(0.05)
        ttls = {e["request_id"]: e["ttl_s"] for e in c.list()}
    sock.close()
    assert 50 < ttls["pinned-1"] <= 60 and 50 < ttls["pinned-2"] <= 60 and 0 < ttls["pinned-3"] <= 5, ttls


def test_a_socket_in_tmp_itself_is_fine(daemons):
    """/tmp is world-writable but sticky and root's: others may add names there, never take ours."""
    import uuid

    path = f"/tmp/kvd-test-{uuid.uuid4().hex[:8]}.sock"
    a = daemons.start("A", extra=["--socket", f"unix://{path}"], wait=False)
    a.socket = f"unix://{path}"
    from kvd.testing.daemons import wait_ready
    wait_ready(a)
    with a.client() as c:
        c.put("x", {"x": torch.arange(3)})
        assert torch.equal(c.get("x")["x"], torch.arange(3))


@needs_root
def test_a_socket_name_another_user_took_first_is_refused(tmp_path):
    import uuid

    path = f"/tmp/kvd-test-{uuid.uuid4().hex[:8]}.sock"
    open(path, "w").close()
    os.chown(path, NOBODY, NOBODY)
    try:
        refused = subprocess.run([sys.executable, "-m", "kvd", "serve", "--socket", f"unix://{path}", "--listen",
                                  f"tcp://127.0.0.1:{free_port()}", "--metrics-port", "0", "--pool-size", "4MiB"],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and f"belongs to uid {NOBODY}" in refused.stderr
    finally:
        os.unlink(path)

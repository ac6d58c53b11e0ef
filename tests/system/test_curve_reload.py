"""CURVE that works with endpoints and reload: a configured peer reached by its tcp:// endpoint is
that peer (its key is used), an unknown endpoint is refused saying what to do, and SIGHUP
re-reads the allow list (adding a node or rotating a key needs no restart). Real daemons."""
from __future__ import annotations

import shutil
import signal
import time

import pytest
import torch

import kvd
from kvd.testing.daemons import eventually, free_port, wait_ready
from tests.system.test_security import keygen


@pytest.fixture
def keys(tmp_path):
    secrets = tmp_path / "secrets"
    made = {name: keygen(secrets, name) for name in ("A", "B", "C")}
    for node in "ABC":  # each node's allow directory: its own copy, to change one at a time
        allow = tmp_path / f"allow-{node}"
        allow.mkdir()
        for name in "AB":
            shutil.copy(made[name][0], allow / f"{name}.key")
    return made, tmp_path


def start(daemons, node: str, keys, port: int, peers: dict[str, int], wait: bool = True):
    made, root = keys
    return daemons.start(node, port=port, peers={n: f"tcp://127.0.0.1:{p}" for n, p in peers.items()}, wait=wait,
                         extra=["--curve-secret-key", str(made[node][1]), "--curve-allow", str(root / f"allow-{node}"),
                                "--connect-timeout", "2s"])


def test_a_configured_peers_endpoint_is_that_peer_and_an_unknown_one_is_explained(daemons, keys):
    pa, pb = free_port(), free_port()
    a = start(daemons, "A", keys, pa, {"B": pb}, wait=False)
    b = start(daemons, "B", keys, pb, {"A": pa})
    wait_ready(a)
    with a.client() as ca, b.client() as cb:
        ca.put("by-endpoint", {"x": torch.arange(100)}, dest=f"tcp://127.0.0.1:{pb}")  # what vLLM's kvd_dest gives
        assert torch.equal(cb.get("by-endpoint")["x"], torch.arange(100))
        with pytest.raises(kvd.BadRequest, match=r"not the endpoint of a configured peer.*--peer NAME="):
            ca.put("nowhere", {"x": torch.ones(1)}, dest=f"tcp://127.0.0.1:{free_port()}")


def test_sighup_reloads_the_allow_list(daemons, keys):
    made, root = keys
    pa, pc = free_port(), free_port()
    a = start(daemons, "A", keys, pa, {}, wait=False)
    c = start(daemons, "C", keys, pc, {"A": pa})  # C's key is not in A's allow list yet
    wait_ready(a)
    shutil.copy(made["C"][0], root / "allow-C" / "C.key")  # (C dials A with A's key: that it has)
    with c.client() as cc, pytest.raises(kvd.Unauthorized):
        cc.put("knock", {"x": torch.ones(1)}, dest="A")
    shutil.copy(made["C"][0], root / "allow-A" / "C.key")  # the operator adds the new node...
    a.proc.send_signal(signal.SIGHUP)  # ...and reloads, without a restart
    eventually(lambda: "CURVE keys reloaded: 1 key(s) added" in a.log(), timeout=5)
    with c.client() as cc, a.client() as ca:
        deadline = time.monotonic() + 10
        while True:  # C's refused link dials again by itself (every 2 s)
            try:
                cc.put("welcome", {"x": torch.arange(10)}, dest="A")
                break
            except (kvd.Unauthorized, kvd.PeerUnavailable):
                assert time.monotonic() < deadline, "the reloaded allow list did not let C in"
                time.sleep(0.5)
        assert torch.equal(ca.get("welcome")["x"], torch.arange(10))
    (root / "allow-A" / "C.key").unlink()  # and a key taken away is refused from the next handshake
    a.proc.send_signal(signal.SIGHUP)
    eventually(lambda: "1 removed" in a.log(), timeout=5)
    # ...and its live connection is cut at once: C's next push is refused, not carried on the old link
    assert "peer C is no longer admitted" in a.log()
    with c.client() as cc:
        started = time.monotonic()
        with pytest.raises(kvd.Unauthorized):
            cc.put("after-revocation", {"x": torch.ones(1)}, dest="A")
        assert time.monotonic() - started < 5
    with a.client() as ca:
        assert "after-revocation" not in {e["request_id"] for e in ca.list()}


@pytest.mark.parametrize("kind", ["cert", "key"])
def test_a_peer_taken_out_of_the_allow_list_is_cut_under_a_ca_too(daemons, tmp_path, kind):
    # the CA recipe with static peers: each node's allow directory holds the other's NAME.cert (or
    # NAME.key). Taking C's out of A's and reloading cuts C both ways at once, though the CA still
    # vouches for C: a push from C is refused, not carried (it landed 3 s later before), and so is
    # one from A to C; putting it back lets C in again
    from kvd.trust.keygen import keygen_ca, keygen_node

    ca = tmp_path / "ca"
    ca.mkdir()
    keygen_ca(str(ca))
    for name in "AC":
        keygen_node(str(ca), name, ca_secret=str(ca / "ca.key_secret"), cluster="kvd")
    for name in "AC":
        allow = tmp_path / f"ca-allow-{name}"
        allow.mkdir()
        other = "C" if name == "A" else "A"
        shutil.copy(ca / f"{other}.{kind}", allow / f"{other}.{kind}")
    pa, pc = free_port(), free_port()

    def start_ca(node: str, port: int, peer: str, peer_port: int, wait: bool = True):
        return daemons.start(node, port=port, peers={peer: f"tcp://127.0.0.1:{peer_port}"}, wait=wait,
                             extra=["--curve-secret-key", str(ca / f"{node}.key_secret"), "--curve-ca",
                                    str(ca / "ca.key"), "--curve-allow", str(tmp_path / f"ca-allow-{node}"),
                                    "--connect-timeout", "2s"])

    a = start_ca("A", pa, "C", pc, wait=False)
    c = start_ca("C", pc, "A", pa)
    wait_ready(a)
    with c.client() as cc, a.client() as ca_client:
        cc.put("before", {"x": torch.arange(10)}, dest="A")
        ca_client.put("to-c", {"x": torch.arange(10)}, dest="C")
    (tmp_path / "ca-allow-A" / f"C.{kind}").unlink()
    a.proc.send_signal(signal.SIGHUP)
    eventually(lambda: "SIGHUP: configuration reloaded" in a.log(), timeout=5)
    with c.client() as cc, pytest.raises((kvd.Unauthorized, kvd.PeerUnavailable)):
        cc.put("after-revocation", {"x": torch.ones(1)}, dest="A")
    with a.client() as ca_client:
        assert "after-revocation" not in {e["request_id"] for e in ca_client.list()}
        with pytest.raises(kvd.KvdError, match="C"):  # and A's own link to C is gone too
            ca_client.put("to-c-after", {"x": torch.ones(1)}, dest="C")
    log = a.log()
    assert "peer C is no longer admitted" in log  # its connection to A was cut at the reload
    assert "taken out of --curve-allow are refused from now on" in log and "--curve-deny" in log
    shutil.copy(ca / f"C.{kind}", tmp_path / "ca-allow-A" / f"C.{kind}")  # put back: C is let in again
    a.proc.send_signal(signal.SIGHUP)
    eventually(lambda: a.log().count("SIGHUP: configuration reloaded") == 2, timeout=5)
    with c.client() as cc, a.client() as ca_client:
        deadline = time.monotonic() + 10
        while True:  # (C's refused link dials again by itself)
            try:
                cc.put("welcome-back", {"x": torch.arange(5)}, dest="A")
                break
            except (kvd.Unauthorized, kvd.PeerUnavailable):
                assert time.monotonic() < deadline, "C was not let in again"
                time.sleep(0.2)
        assert torch.equal(ca_client.get("welcome-back")["x"], torch.arange(5))

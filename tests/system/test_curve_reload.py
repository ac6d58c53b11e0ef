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
from kvd.testing import eventually, free_port, wait_ready
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
    with c.client() as cc:
        with pytest.raises(kvd.Unauthorized):
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

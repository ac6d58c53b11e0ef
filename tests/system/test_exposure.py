"""Every listener under the loopback rule: a tcp:// client socket beyond loopback, which nothing
authenticates, starts only under --insecure (as a --listen beyond loopback without CURVE does), and
the refusal names the safe choice. Real daemons."""
from __future__ import annotations

import socket

import torch

import kvd
from kvd.testing.daemons import free_port, wait_ready


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def test_a_client_socket_beyond_loopback_is_refused_without_insecure(daemons):
    port = free_port()
    wide = f"tcp://0.0.0.0:{port}"
    refused = daemons.start("A", extra=["--socket", wide], wait=False)
    assert refused.proc.wait(30) != 0
    log = refused.log()
    assert f"refusing to serve clients on {wide}" in log, log[-2000:]
    assert "unix socket" in log and "unix:///run/kvd/kvd.sock" in log and "--insecure" in log
    assert "Traceback" not in log
    assert port_is_free(port)  # it refused before binding anything


def test_a_client_socket_beyond_loopback_starts_under_insecure_with_a_warning(daemons):
    port = free_port()
    wide = f"tcp://0.0.0.0:{port}"
    d = daemons.start("A", extra=["--socket", wide, "--insecure"], wait=False)
    d.socket = f"tcp://127.0.0.1:{port}"
    wait_ready(d)
    assert "--insecure: clients are not authenticated" in d.log() and wide in d.log()
    with kvd.Client(d.socket) as c:
        c.put("wide", {"x": torch.arange(10)})
        assert torch.equal(c.get("wide")["x"], torch.arange(10))


def test_a_loopback_client_socket_needs_no_flag(daemons):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    d = daemons.start("A", extra=["--socket", endpoint], wait=False)
    d.socket = endpoint
    wait_ready(d)
    assert "--insecure" not in d.log()

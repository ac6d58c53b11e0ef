"""What a newcomer meets at the keyboard: every mistake gets one clear line, cheap checks come
before the pool is allocated, and a failed start leaves nothing behind. Real `kvd` processes."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from kvd.memory.host import ram_available
from kvd.testing.daemons import free_port


def kvd(*args: str, cwd=None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


def serve(tmp_path, *args: str, **kw) -> subprocess.CompletedProcess:
    return kvd("serve", "--listen", f"tcp://127.0.0.1:{free_port()}", "--metrics-port", "0",
               "--socket", f"unix://{tmp_path}/s/k.sock", "--pool-size", "4MiB", *args, **kw)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


def test_a_malformed_peer_is_one_line(tmp_path):
    err = one_line_error(serve(tmp_path, "--peer", "B"))
    assert err.strip() == "kvd: peer must be NAME=tcp://HOST:PORT, got 'B'"


def test_a_bad_flag_is_shown_with_its_own_commands_usage():
    err = one_line_error(kvd("status", "--bogus"))
    assert "usage: kvd status" in err and "unrecognized arguments: --bogus" in err


@pytest.mark.parametrize("socket, words", [
    ("unix://relative/kvd.sock", "must be absolute"),
    ("unix:///tmp/" + "x" * 120 + "/kvd.sock", "a unix socket path has at most 107"),
    ("unix:///etc/hostname/kvd.sock", "/etc/hostname is not a directory"),
])
def test_a_bad_socket_path_says_what_is_wrong_and_leaves_nothing(tmp_path, socket, words):
    result = kvd("serve", "--socket", socket, "--listen", f"tcp://127.0.0.1:{free_port()}", "--metrics-port", "0",
                 "--pool-size", "4MiB", cwd=tmp_path)
    err = one_line_error(result)
    assert words in err, err
    assert not (tmp_path / "relative").exists() and not os.path.exists("/tmp/" + "x" * 120)


def test_a_failed_start_says_why_first_and_leaves_no_directory(tmp_path):
    first = subprocess.Popen([sys.executable, "-m", "kvd", "serve", "--listen", f"tcp://127.0.0.1:{free_port()}",
                              "--metrics-port", "0", "--socket", f"unix://{tmp_path}/s/k.sock", "--pool-size", "4MiB"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "s" / "k.sock").exists():
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        started = time.monotonic()
        second = serve(tmp_path, "--pool-size", "2GiB")  # a big pool: the socket check must come first
        assert time.monotonic() - started < 5
        err = one_line_error(second)
        assert "is in use by another daemon" in err
        assert "shutting down" not in err and "stopped" not in err  # the reason, not a drain that never began
    finally:
        first.terminate()
        first.wait(15)
    gone = kvd("serve", "--listen", f"tcp://127.0.0.1:{free_port()}", "--metrics-port", "0", "--pool-size", "4MiB",
               "--socket", f"unix://{tmp_path}/new/deeper/k.sock", "--curve-secret-key", "/nonexistent")
    one_line_error(gone)
    assert not (tmp_path / "new").exists()  # the directories it made went with the failed start


def test_a_pool_bigger_than_ram_is_refused_unless_overcommitted(tmp_path):
    available = ram_available()
    if available is None:
        pytest.skip("no MemAvailable in /proc/meminfo")
    too_big = f"{(available >> 30) + 8}GiB"
    for extra in ((), ("--no-prefault",)):
        err = one_line_error(serve(tmp_path, "--pool-size", too_big, *extra))
        assert f"the {too_big}".replace("GiB", ".0GiB") in err and "available RAM" in err and "--pool-overcommit" in err
    proc = subprocess.Popen([sys.executable, "-m", "kvd", "serve", "--listen", f"tcp://127.0.0.1:{free_port()}",
                             "--metrics-port", "0", "--socket", f"unix://{tmp_path}/o/k.sock", "--pool-size", too_big,
                             "--no-prefault", "--pool-overcommit"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "o" / "k.sock").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.05)
    finally:
        proc.terminate()
        out = proc.communicate(timeout=15)[0]
    assert "starting anyway (--pool-overcommit)" in out


def test_an_unreachable_registry_is_said_at_start_and_in_the_errors_it_causes(daemons):
    import torch

    import kvd

    nowhere = f"etcd://127.0.0.1:{free_port()}"  # nothing listens there
    a = daemons.start("A", extra=["--registry", nowhere, "--registry-ttl", "1s"])
    assert f"registry {nowhere} (registering in the background)" in a.log()
    deadline = time.monotonic() + 10
    while "cannot reach the cluster registry" not in a.log():
        assert time.monotonic() < deadline, a.log()[-2000:]
        time.sleep(0.1)
    with a.client() as c, pytest.raises(kvd.PeerUnavailable, match=f"the cluster registry {nowhere} is unreachable"):
        c.put("x", {"x": torch.ones(4)}, dest="decode-7")
    b = daemons.start("B")
    with b.client() as c, pytest.raises(kvd.PeerUnavailable, match="no cluster registry"):
        c.put("x", {"x": torch.ones(4)}, dest="decode-7")


def last_line(result: subprocess.CompletedProcess) -> str:
    """The one line that says why a start failed (the log's "starting with configuration" may precede it)."""
    err = one_line_error(result)
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("flag, value, words", [
    ("--listen", "tcp://127.0.0.1:99999", "listen 'tcp://127.0.0.1:99999': port 99999 is out of range (1-65535)"),
    ("--listen", "tcp://127.0.0.1", "listen 'tcp://127.0.0.1' has no port"),
    ("--peer", "B=tcp://10.0.0.2:99999", "peer 'B': 'tcp://10.0.0.2:99999': port 99999 is out of range"),
    ("--socket", "tcp://127.0.0.1:70000", "socket 'tcp://127.0.0.1:70000': port 70000 is out of range"),
])
def test_a_port_out_of_range_or_missing_is_refused_by_name(tmp_path, flag, value, words):
    args = ["serve", "--metrics-port", "0", "--pool-size", "4MiB", flag, value]
    if flag != "--listen":
        args += ["--listen", f"tcp://127.0.0.1:{free_port()}"]
    if flag != "--socket":
        args += ["--socket", f"unix://{tmp_path}/k.sock"]
    result = kvd(*args)
    assert result.returncode == 2
    line = last_line(result)
    assert words in line and "cluster CA" not in result.stderr, result.stderr


def test_a_port_another_program_holds_says_in_use_and_which_option(tmp_path):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        peer = serve(tmp_path, "--listen", f"tcp://127.0.0.1:{port}")
        metrics = kvd("serve", "--listen", f"tcp://127.0.0.1:{free_port()}", "--metrics-port", str(port),
                      "--socket", f"unix://{tmp_path}/m.sock", "--pool-size", "4MiB")
    assert peer.returncode == 1 and metrics.returncode == 1
    line = last_line(peer)
    assert line.endswith(f"cannot listen for peers on tcp://127.0.0.1:{port}: the port is in use (by another kvd or "
                         "another program): choose another port for --listen"), line
    line = last_line(metrics)
    assert "the port is in use (by another kvd or another program): choose another port for --metrics-port" in line
    assert "another kvd on this host?" not in peer.stderr + metrics.stderr


def test_a_peer_refusing_this_nodes_cert_is_logged_once_a_minute(daemons, tmp_path):
    """B's CA did not sign A's cert: B refuses A's hello, and A's link says hello again every
    second. A's log says so once, not once a second (observed over 3 s of puts that fail)."""
    import torch

    import kvd
    from kvd.trust.keygen import keygen_ca, keygen_node

    dirs = {name: tmp_path / name for name in "AB"}
    for name, d in dirs.items():
        keygen_ca(str(d))
        keygen_node(str(d), name, ca_secret=str(d / "ca.key_secret"))
    (dirs["A"] / "peers").mkdir()
    (dirs["A"] / "peers" / "B.key").write_bytes((dirs["B"] / "B.key").read_bytes())  # A may dial B
    port_a, port_b = free_port(), free_port()
    b = daemons.start("B", port=port_b, extra=["--curve-secret-key", str(dirs["B"] / "B.key_secret"),
                                               "--curve-ca", str(dirs["B"] / "ca.key")])
    a = daemons.start("A", port=port_a, peers={"B": f"tcp://127.0.0.1:{port_b}"},
                      extra=["--curve-secret-key", str(dirs["A"] / "A.key_secret"), "--curve-ca",
                             str(dirs["A"] / "ca.key"), "--curve-allow", str(dirs["A"] / "peers")])
    refused = 0
    started = time.monotonic()
    with a.client() as c:
        while time.monotonic() - started < 3.5:
            with pytest.raises(kvd.Unauthorized, match="refused this daemon"):
                c.put(f"r{refused}", {"x": torch.ones(4)}, dest="B")
            refused += 1
            time.sleep(0.5)  # (paced puts over the window: the link's own redials go on between them)
    lines = [line for line in a.log().splitlines() if "refused this daemon" in line and "WARNING" in line]
    assert refused >= 3 and len(lines) == 1, lines
    assert lines[0].endswith("(again at most once a minute)")
    assert b.proc.poll() is None


def test_a_redis_registry_starts_without_a_python_warning(daemons):
    """redis-py's asyncio client converted the synchronous Retry kvd gave it, with a UserWarning
    on every daemon's stderr at start."""
    nowhere = f"redis://127.0.0.1:{free_port()}"  # (the warning came at construction: no server needed)
    a = daemons.start("A", extra=["--registry", nowhere, "--registry-ttl", "1s"])
    assert f"registry {nowhere}" in a.log()
    assert "Warning" not in a.log(), a.log()[-2000:]


@pytest.mark.parametrize("value", ["2", "1.5"])
def test_a_cache_size_above_one_without_a_unit_is_refused(tmp_path, value):
    """It read as bytes: `--cache-size 2` gave the tier 2 bytes, and every page was refused."""
    result = serve(tmp_path, "--cache-size", value, timeout=20)
    assert result.returncode == 2
    assert last_line(result) == (f"kvd: --cache-size: cache_size '{value}' has no unit: a bare number is a fraction "
                                 "of the pool (0-1, e.g. 0.5); give a size with its unit (e.g. 2GiB, or "
                                 f"{int(float(value))}B for bytes)")


def test_a_client_pointed_at_the_peer_port_is_told_so(daemons):
    """ZeroMQ greets first (0xFF ... 0x7F), which a client read as 'message declares 255 frames',
    or ZeroMQ reset the connection first: 'connection lost'. Either way: say it is a peer port."""
    import asyncio

    import torch

    import kvd as kvdlib

    a = daemons.start("A")
    wanted = f"{a.listen}: the other end speaks ZeroMQ: this is a kvd peer port (--listen), not a client socket"
    for _ in range(3):  # (which of the two ways ZeroMQ ends it is up to timing: each try may meet either)
        result = kvd("status", "--socket", a.listen, timeout=20)
        assert result.returncode == 1 and "Traceback" not in result.stderr
        assert result.stderr.strip().splitlines() == [f"kvd: {wanted} (give the daemon's --socket, e.g. "
                                                      "unix:///run/kvd/kvd.sock)"], result.stderr
        with pytest.raises(kvdlib.ProtocolError, match=wanted.replace("(", r"\(").replace(")", r"\)")):
            kvdlib.Client(a.listen).put("x", {"x": torch.ones(4)})

    async def async_put():
        await kvdlib.AsyncClient(a.listen).put("x", {"x": torch.ones(4)})

    with pytest.raises(kvdlib.ProtocolError, match="this is a kvd peer port"):
        asyncio.run(async_put())
    with a.client() as c:  # the daemon serves on
        c.put("y", {"x": torch.ones(4)})


@pytest.mark.parametrize("kind", ["etcd", "redis"])
def test_a_plain_registry_url_against_a_tls_server_says_which_scheme(daemons, tmp_path, kind):
    from tests.cluster.conftest import _missing
    from tests.cluster.servers import (
        EtcdServer,
        RedisServer,
        find_etcd,
        find_redis,
        make_certs,
        start_server,
        stop_server,
    )

    binary = find_etcd() if kind == "etcd" else find_redis()
    if binary is None:
        _missing(kind)
    server = start_server(EtcdServer if kind == "etcd" else RedisServer, binary, certs=make_certs(tmp_path / "certs"))
    try:
        plain = server.url.replace(f"{kind}s://", f"{kind}://")
        a = daemons.start("A", extra=["--registry", plain, "--registry-ttl", "1s"])
        deadline = time.monotonic() + 15
        while "cannot reach the cluster registry" not in a.log():
            assert time.monotonic() < deadline, a.log()[-2000:]
            time.sleep(0.1)
        line = next(line for line in a.log().splitlines() if "cannot reach the cluster registry" in line)
        assert f"use {kind}s://" in line, line
    finally:
        stop_server(server)


def test_a_big_pool_says_it_is_prefaulting_and_how_long_it_took(daemons):
    """An 8 GiB pool took 27 s to prefault, and the log said nothing until 'ready'."""
    a = daemons.start("A", pool_size="1GiB")
    log = a.log()
    assert "prefaulting the 1.0GiB pool: every page is allocated now" in log and "--no-prefault skips it" in log
    said, done, ready = (log.index(words) for words in ("prefaulting the", "pool of 1.0GiB prefaulted in",
                                                         "ready: pool"))
    assert said < done < ready


def _odd_tensors():
    import warnings

    import torch

    with warnings.catch_warnings():  # (torch warns that sparse CSR and nested tensors are in beta)
        warnings.simplefilter("ignore")
        return {
            "sparse": (torch.ones(4, 4).to_sparse(), "is a torch.sparse_coo tensor, not a dense one"),
            "csr": (torch.ones(4, 4).to_sparse_csr(), "is a torch.sparse_csr tensor, not a dense one"),
            "meta": (torch.empty(4, 4, device="meta"), "is a meta tensor; give one with memory"),
            "nested": (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "is a nested tensor"),
        }


@pytest.mark.parametrize("kind", ["sparse", "csr", "meta", "nested"])
def test_sparse_meta_and_nested_tensors_are_a_bad_request_naming_the_tensor(daemons, kind):
    """They raised torch's own RuntimeError (or NotImplementedError) from deep in a copy."""
    import torch

    import kvd as kvdlib

    odd, words = _odd_tensors()[kind]
    a = daemons.start("A", pool_size="16MiB", extra=["--block-size", "4KiB"])
    with a.client() as c:
        with pytest.raises(kvdlib.BadRequest, match=f"tensor 'k' {words}"):
            c.put("r1", {"v": torch.ones(4, 4), "k": odd})
        c.put("r2", {"k": torch.ones(4, 4)})
        with pytest.raises(kvdlib.BadRequest, match=rf"out\['k'\] {words}"):
            c.get("r2", out={"k": odd}, timeout=5)
        assert torch.equal(c.get("r2", timeout=5)["k"], torch.ones(4, 4))  # the bad get gave it back
        with pytest.raises(kvdlib.BadRequest, match=rf"pages\[1\] {words}"):
            c.cache_put(["p0", "p1"], [torch.ones(4, 4), odd], namespace="ns")
        assert c.cache_put(["p2"], [torch.ones(4, 4)], namespace="ns") == [True]
        with pytest.raises(kvdlib.BadRequest, match=rf"outs\[0\] {words}"):
            c.cache_get(["p2"], [odd], namespace="ns")
        assert c.stats()["pool"]["used_bytes"] == 4096  # p2's block: the refused calls took nothing


def test_too_many_tensors_says_so_with_the_limit(daemon):
    """Past about 60k tensors the error was the header's size ('header of 1368965 bytes exceeds
    the 1048576-byte limit'), which names neither the cause nor the limit."""
    import torch

    import kvd as kvdlib
    from kvd.wire.layout import MAX_TENSORS

    many = {f"layer.{i}": torch.ones(1) for i in range(60_000)}
    with daemon.client() as c:
        said = f"too many tensors: 60000 in one request, at most {MAX_TENSORS}"
        for call in (lambda: c.put("r", many), lambda: c.put_stream("s", many)):
            with pytest.raises(kvdlib.BadRequest, match=said):
                call()
        c.put("ok", {f"layer.{i}": torch.ones(1) for i in range(MAX_TENSORS)})  # the limit itself is fine


def test_cache_get_into_an_out_of_the_wrong_size_is_a_bad_request_naming_the_page(daemons):
    """It answered False, as a miss would: the caller's bug looked like an empty cache."""
    import torch

    import kvd as kvdlib

    a = daemons.start("A", pool_size="16MiB", extra=["--block-size", "4KiB"])
    with a.client() as c:
        assert c.cache_put(["p0", "p1"], [torch.ones(1024), torch.ones(512)], namespace="ns") == [True, True]
        with pytest.raises(kvdlib.BadRequest, match="page 'p1' of namespace 'ns' holds 2048 bytes, and the out "
                                                    "given for it has 4096: give an out of the page's size"):
            c.cache_get(["p0", "p1"], [torch.empty(1024), torch.empty(1024)], namespace="ns")
        outs = [torch.empty(1024), torch.empty(512)]
        assert c.cache_get(["p0", "p1", "absent"], [*outs, torch.empty(4)], namespace="ns") == [True, True, False]
        assert torch.equal(outs[1], torch.ones(512))
        c.cache_clear("ns")  # the refused get pinned nothing: every block comes back
        assert c.stats()["pool"]["used_bytes"] == 0


def test_status_shows_a_peer_that_cannot_link_and_prints_no_python_reprs(daemons, tmp_path):
    """A configured peer with no CURVE key was missing from `kvd status`; entries and counters
    printed as Python dicts."""
    from kvd.trust.keygen import keygen_ca, keygen_node

    keygen_ca(str(tmp_path / "k"))
    keygen_node(str(tmp_path / "k"), "A", ca_secret=str(tmp_path / "k" / "ca.key_secret"))
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    a = daemons.start("A", peers={"B": nowhere}, extra=["--curve-secret-key", str(tmp_path / "k" / "A.key_secret"),
                                                        "--curve-ca", str(tmp_path / "k" / "ca.key")])
    result = kvd("status", "--socket", a.socket, timeout=20)
    assert result.returncode == 0, result.stderr
    peer_lines = [line for line in result.stdout.splitlines() if line.startswith("peer ")]
    assert len(peer_lines) == 1 and peer_lines[0].startswith(f"peer       B {nowhere} not linked: CURVE is on and no "
                                                             "key of peer 'B' is known"), result.stdout
    assert "{" not in result.stdout and "'" not in result.stdout.replace(peer_lines[0], ""), result.stdout
    assert "entries    0  (writing 0, receiving 0, ready 0, claimed 0)" in result.stdout
    assert "counters   puts 0, gets 0, errors 0, sent 0B, received 0B" in result.stdout


@pytest.mark.parametrize("where, words", [
    ("env", "kvd: KVD_POOL_SIZE: not a size: 'abc'"),
    ("flag", "kvd: --pool-size: not a size: 'abc'"),
    ("file", "kvd: pool_size in {file}: not a size: 'abc'"),
    ("file-list", "kvd: pool_size in {file}: [1] is not a valid pool_size"),
    ("file-invalid", "kvd: invalid configuration: window must be at least 1 (set by window in {file})"),
    ("file-typo", "kvd: {file}: unknown option(s) pool_sise (did you mean pool_size?)"),
    ("file-toml", "kvd: {file}: not valid TOML: "),
    ("file-missing", "kvd: cannot read the config file {file}: No such file or directory"),
])
def test_a_config_error_names_the_variable_flag_file_and_key(tmp_path, where, words):
    file = tmp_path / "kvd.toml"
    contents = {"file": 'pool_size = "abc"\n', "file-list": "pool_size = [1]\n", "file-invalid": "window = 0\n",
                "file-typo": "pool_sise = 3\n", "file-toml": "pool_size = \n"}
    if where in contents:
        file.write_text(contents[where])
    args = ["serve", "--socket", f"unix://{tmp_path}/k.sock", "--listen", f"tcp://127.0.0.1:{free_port()}"]
    env = dict(os.environ)
    if where == "env":
        env["KVD_POOL_SIZE"] = "abc"
    elif where == "flag":
        args += ["--pool-size", "abc"]
    else:
        args += ["--config", str(file)]
    result = subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().startswith(words.format(file=file)), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_misspelt_kvd_variable_is_warned_of_with_the_closest_name(daemons):
    a = daemons.start("A", env={"KVD_POOL_SZE": "1GiB", "KVD_DEFAULT_TTLL": "5s", "KVD_VENV": "/nowhere"})
    log = a.log()
    assert "WARNING kvd: environment variable KVD_POOL_SZE (did you mean KVD_POOL_SIZE?) is not a kvd setting: " \
           "ignored" in log
    assert "KVD_DEFAULT_TTLL (did you mean KVD_DEFAULT_TTL?)" in log
    warnings = [line for line in log.splitlines() if "is not a kvd setting" in line]
    assert len(warnings) == 2 and "KVD_VENV" not in log  # (./dev's own variable is known: no warning)


def test_the_three_commands_of_a_cluster_ca_are_enough_for_static_peers(daemons, tmp_path):
    """docs: `kvd keygen --ca`, `kvd keygen NODE --ca-secret`, `kvd serve --curve-ca`. Static peers
    also needed each other's certs in a --curve-allow directory; now the CA-verified certs beside
    this node's own give the keys to dial them by. A cert the CA did not sign gives none, and the
    error says so."""
    import torch

    import kvd as kvdlib

    keys = tmp_path / "keys"
    assert kvd("keygen", "--ca", "--dir", str(keys)).returncode == 0
    for node in ("A", "B"):
        assert kvd("keygen", node, "--dir", str(keys), "--ca-secret", str(keys / "ca.key_secret")).returncode == 0
    other = tmp_path / "other"  # C's cert is from another CA, laid beside ours
    assert kvd("keygen", "--ca", "--dir", str(other)).returncode == 0
    assert kvd("keygen", "C", "--dir", str(other), "--ca-secret", str(other / "ca.key_secret")).returncode == 0
    (keys / "C.cert").write_bytes((other / "C.cert").read_bytes())

    def trust(node: str) -> list[str]:
        return ["--curve-secret-key", str(keys / f"{node}.key_secret"), "--curve-ca", str(keys / "ca.key")]

    port_a, port_b, port_c = free_port(), free_port(), free_port()
    a = daemons.start("A", port=port_a, peers={"B": f"tcp://127.0.0.1:{port_b}", "C": f"tcp://127.0.0.1:{port_c}"},
                      extra=trust("A"))
    b = daemons.start("B", port=port_b, peers={"A": f"tcp://127.0.0.1:{port_a}"}, extra=trust("B"))
    kv = {"x": torch.arange(16, dtype=torch.float32)}
    with a.client() as ca, b.client() as cb:
        ca.put("pushed", kv, dest="B")
        assert torch.equal(cb.get("pushed", timeout=10)["x"], kv["x"])
        cb.put("pulled", kv)
        assert torch.equal(ca.get("pulled", source="B", timeout=10)["x"], kv["x"])
        with pytest.raises(kvdlib.BadRequest, match=r"C\.cert gives no key \(the cert of 'C' is not signed by this "
                                                     r"cluster's CA\)"):
            ca.put("nope", kv, dest="C")


def test_keygen_if_missing_keeps_an_existing_ca_or_pair_and_exits_0(tmp_path):
    """`kvd keygen --ca` over an existing CA exits 1 (rightly: it would orphan every cert); a
    script that sets up a host wants a form it can run every time."""
    d = tmp_path / "keys"
    assert kvd("keygen", "--ca", "--dir", str(d), "--if-missing").returncode == 0  # none there: made
    ca = (d / "ca.key").read_bytes(), (d / "ca.key_secret").read_bytes()
    again = kvd("keygen", "--ca", "--dir", str(d))
    assert again.returncode == 1 and "--if-missing keeps what is there and exits 0" in again.stderr
    kept = kvd("keygen", "--ca", "--dir", str(d), "--if-missing")
    assert kept.returncode == 0 and "already there: kept" in kept.stdout and kept.stderr == ""
    assert ((d / "ca.key").read_bytes(), (d / "ca.key_secret").read_bytes()) == ca
    assert kvd("keygen", "A", "--dir", str(d), "--if-missing").returncode == 0
    pair = (d / "A.key_secret").read_bytes()
    assert kvd("keygen", "A", "--dir", str(d)).returncode == 1
    assert kvd("keygen", "A", "--dir", str(d), "--if-missing").returncode == 0
    assert (d / "A.key_secret").read_bytes() == pair
    both = kvd("keygen", "--ca", "--dir", str(d), "--if-missing", "--force")
    assert both.returncode == 2 and "give one" in both.stderr
    other = tmp_path / "other"  # halves of two CAs, or one half alone: neither kept nor replaced
    assert kvd("keygen", "--ca", "--dir", str(other)).returncode == 0
    (d / "ca.key").write_bytes((other / "ca.key").read_bytes())
    mixed = kvd("keygen", "--ca", "--dir", str(d), "--if-missing")
    assert mixed.returncode == 1 and "halves of two different CAs" in mixed.stderr and "Traceback" not in mixed.stderr
    (d / "ca.key").unlink()
    half = kvd("keygen", "--ca", "--dir", str(d), "--if-missing")
    assert half.returncode == 1 and "only one half of a CA" in half.stderr
    assert (d / "ca.key_secret").read_bytes() == ca[1]


def test_a_batch_bigger_than_the_budget_keeps_its_first_pages_and_refuses_the_rest(daemons):
    """What docs/kv-tier.md now says of it (it said nothing: one could expect the batch's last
    pages to win, as LRU eviction would have it)."""
    import torch

    a = daemons.start("A", pool_size="16MiB", extra=["--cache-size", "1MiB"])  # 16 blocks of 64 KiB
    pages = [torch.full((16 << 10,), i, dtype=torch.float32) for i in range(24)]  # one block each
    with a.client() as c:
        assert c.cache_put([f"old{i}" for i in range(4)], pages[:4]) == [True] * 4
        assert c.cache_put([f"k{i}" for i in range(24)], pages) == [True] * 16 + [False] * 8
        stats = c.cache_stats()
        assert stats["entries"] == 16 and stats["evictions"] == 4 and stats["refused"] == 8
        outs = [torch.empty(16 << 10) for _ in range(24)]
        assert c.cache_get([f"k{i}" for i in range(24)], outs) == [True] * 16 + [False] * 8
        assert all(torch.equal(outs[i], pages[i]) for i in range(16))


@pytest.mark.parametrize("doc, heading", [("README.md", "## Using it from a worker"), ("docs/client.md", "## The API")])
def test_the_first_snippet_runs_as_written(daemon, doc, heading):
    """The README's snippet used k0 and v0 without defining them: a NameError for whoever pasted it."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / doc).read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S).group(1)
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "KVD_SOCKET": daemon.socket})
    assert ran.returncode == 0, ran.stderr[-2000:]


def test_a_peer_cert_copied_beside_ours_then_sighup_links_that_peer(daemons, tmp_path):
    """What the dial error says to do: copy B's cert beside this node's own, then SIGHUP."""
    import signal

    import torch

    import kvd as kvdlib
    from kvd.trust.keygen import keygen_ca, keygen_node

    ca, here, there = tmp_path / "ca", tmp_path / "a", tmp_path / "b"  # B's files on "another host"
    keygen_ca(str(ca))
    keygen_node(str(here), "A", ca_secret=str(ca / "ca.key_secret"))
    keygen_node(str(there), "B", ca_secret=str(ca / "ca.key_secret"))
    (there / "A.cert").write_bytes((here / "A.cert").read_bytes())  # B may dial A; A knows nothing of B yet
    port_a, port_b = free_port(), free_port()
    b = daemons.start("B", port=port_b, peers={"A": f"tcp://127.0.0.1:{port_a}"},
                      extra=["--curve-secret-key", str(there / "B.key_secret"), "--curve-ca", str(ca / "ca.key")])
    a = daemons.start("A", port=port_a, peers={"B": f"tcp://127.0.0.1:{port_b}"},
                      extra=["--curve-secret-key", str(here / "A.key_secret"), "--curve-ca", str(ca / "ca.key")])
    kv = {"x": torch.ones(8)}
    with a.client() as c:
        with pytest.raises(kvdlib.BadRequest, match=rf"there is no B\.cert beside this node's cert \(in {here}: copy "
                                                    r"B's cert there, then SIGHUP\)"):
            c.put("r1", kv, dest="B")
        (here / "B.cert").write_bytes((there / "B.cert").read_bytes())
        a.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while "SIGHUP: configuration reloaded" not in a.log():
            assert time.monotonic() < deadline, a.log()[-2000:]
            time.sleep(0.05)
        c.put("r2", kv, dest="B")
    with b.client() as c:
        assert torch.equal(c.get("r2", timeout=10)["x"], kv["x"])

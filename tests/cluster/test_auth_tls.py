"""Registry auth and TLS against real servers: etcd with auth on, over TLS (a self-signed certificate made
with openssl here) and mutual TLS; Redis with an ACL user, over TLS and mutual TLS. Wrong or missing
credentials and refused certificates are RegistryRefused, with a message that names the registry and
never the password (nor does any log line, str() or status).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest

from kvd.cluster import ClusterMember, Registry
from kvd.cluster.backends.backend import Added, Publish, Registered, RegistryRefused, RegistryUnavailable, Resync
from kvd.cluster.url import open_backend

from .conftest import _missing, run
from .servers import EtcdServer, RedisServer, Server, find_etcd, find_redis, make_certs, start_server, stop_server
from .test_contract import holder, next_event, node

PASSWORD = "kvd-S3cret-pw"
WRONG = "wrong-S3cret-pw"
# name -> (kind, certs, client certs, auth)
SETUPS = {
    "etcd-auth": ("etcd", False, False, True), "etcd-tls": ("etcd", True, False, False),
    "etcd-mtls-auth": ("etcd", True, True, True), "redis-acl": ("redis", False, False, True),
    "redis-tls": ("redis", True, False, False), "redis-mtls-acl": ("redis", True, True, True),
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def servers(certs):
    started: dict[str, Server] = {}

    def get(name: str) -> Server:
        if name not in started:
            kind, tls, client_certs, auth = SETUPS[name]
            started[name] = start_secured(kind, certs if tls else None, client_certs, auth)
        return started[name]

    yield get
    for server in started.values():
        stop_server(server)


def start_secured(kind: str, certs, client_certs: bool, auth: bool) -> Server:
    binary = find_etcd() if kind == "etcd" else find_redis()
    if binary is None:
        _missing(kind)
    if kind == "redis":
        try:
            import redis  # noqa: F401
        except ImportError:
            _missing("redis-py (pip install redis)")
    return start_server(EtcdServer if kind == "etcd" else RedisServer, binary, certs=certs,
                        client_certs=client_certs, auth=("kvd", PASSWORD) if auth else None)


def url_of(server: Server, user: str = "", password: str = "", host: str = "127.0.0.1") -> str:
    scheme, _, rest = server.url.partition("://")
    port = rest.rsplit(":", 1)[1]
    cred = f"{user}:{password}@" if user or password else ""
    return f"{scheme}://{cred}{host}:{port}"


def options(server: Server, client_cert: bool | None = None) -> dict[str, str]:
    """--registry-ca (and the client certificate where the server asks for one)."""
    if server.certs is None:
        return {}
    opts = {"ca_file": server.certs.server_cert}
    if server.client_certs if client_cert is None else client_cert:
        opts.update(cert_file=server.certs.client_cert, key_file=server.certs.client_key)
    return opts


def cluster() -> str:
    return f"auth-{uuid.uuid4().hex[:8]}"


@run
async def _round_trip(backend) -> None:
    it = backend.watch_nodes()
    try:
        assert isinstance(await next_event(it), Resync)  # the watch stream carries the token too
        s = await backend.open_session(30)
        assert isinstance(await backend.register_node(s, node("a")), Registered)
        ev = await next_event(it)
        assert isinstance(ev, Added) and ev.node == node("a")
        assert await backend.get_node("a") == node("a") and await backend.check_node(s, node("a"))
        await backend.publish_batch(s, [Publish(holder("r1"))])
        assert [h.node_id for h in (await backend.holders("r1"))[1]] == ["a"]
        await s.keepalive()
        await backend.update_node(s, node("a", labels={"zone": "z"}))
        assert (await backend.list_nodes())[1] == [node("a", labels={"zone": "z"})]
        await s.close()
    finally:
        await it.aclose()
        await backend.close()


@pytest.mark.parametrize("setup", list(SETUPS))
def test_a_session_works_over_auth_and_tls(servers, setup, tmp_path):
    server = servers(setup)
    if server.auth and setup.startswith("etcd"):  # the password from a file, the user from the URL
        (tmp_path / "pw").write_text(PASSWORD + "\n")
        backend = open_backend(url_of(server, "kvd"), cluster(), 2.0, password_file=str(tmp_path / "pw"),
                               **options(server))
    else:
        backend = open_backend(url_of(server, *(("kvd", PASSWORD) if server.auth else ())), cluster(), 2.0,
                               **options(server))
    _round_trip(backend)


async def refused(backend, call=None) -> RegistryRefused:
    try:
        with pytest.raises(RegistryRefused) as e:
            s = await backend.open_session(30)
            if call is not None:
                await call(s)
        return e.value
    finally:
        await backend.close()


@pytest.mark.parametrize("setup", ["etcd-auth", "redis-acl"])
def test_a_wrong_password_is_refused_and_shown_nowhere(servers, setup, caplog):
    caplog.set_level(logging.DEBUG)
    server = servers(setup)
    url = url_of(server, "kvd", WRONG)

    @run
    async def check():
        e = await refused(open_backend(url, cluster(), 2.0))
        assert "refused kvd's credentials" in str(e) and f"kvd:***@127.0.0.1:{url.rsplit(':', 1)[1]}" in str(e)
        # a daemon keeps running unregistered, and says why in its status; a router's calls fail as
        # an unavailable registry (its breaker counts them)
        member = ClusterMember(open_backend(url, cluster(), 1.0), node("a"), ttl=1.0)
        await member.start()
        assert not await member.wait_registered(0.5)
        status = member.status()
        assert not status["registered"] and "refused" in (status["last_error"] or "")
        assert all(not t.done() for t in member._tasks), "a refusal ended a member task"
        await member.stop()
        router = Registry(url, cluster=cluster(), op_timeout=1.0)
        with pytest.raises(RegistryRefused):
            await router.nodes()
        shown = [str(router.url), repr(router.url), str(router.backend.name), str(status)]
        await router.close()
        return shown

    shown = check()
    for text in [*shown, *(r.getMessage() for r in caplog.records), *(str(r.args) for r in caplog.records)]:
        assert WRONG not in text, text


@pytest.mark.parametrize("setup", ["etcd-auth", "redis-acl", "etcd-mtls-auth"])
def test_no_credentials_or_no_permission_is_refused_with_what_to_fix(servers, setup):
    server = servers(setup)

    @run
    async def check():
        register = lambda b: lambda s: b.register_node(s, node("a"))  # noqa: E731
        b = open_backend(url_of(server), cluster(), 2.0, **options(server))
        e = await refused(b, register(b))
        # etcd with client certificates takes the gateway's own for the user: no permission
        assert "gave none" in str(e) or "gave no credentials" in str(e) or "permission denied" in str(e), e
        b = open_backend(url_of(server, "stranger", PASSWORD), cluster(), 2.0, **options(server))
        e = await refused(b, register(b))
        assert "permission" in str(e).lower() and PASSWORD not in str(e), e

    check()


@pytest.mark.parametrize("setup, why", [
    ("etcd-tls", "wrong CA"), ("redis-tls", "wrong CA"), ("etcd-tls", "hostname"), ("redis-tls", "hostname"),
    ("etcd-mtls-auth", "no client certificate"), ("redis-mtls-acl", "no client certificate"),
])
def test_a_refused_certificate_is_refused_with_what_to_check(servers, setup, why):
    server = servers(setup)
    opts, host = options(server, client_cert=False), "127.0.0.1"
    if why == "wrong CA":
        opts["ca_file"] = server.certs.other_cert
    elif why == "hostname":  # the certificate names 127.0.0.1 only: verification stays on
        host = "localhost"
    user = ("kvd", PASSWORD) if server.auth else ()

    @run
    async def check():
        b = open_backend(url_of(server, *user, host=host), cluster(), 2.0, **opts)
        e = await refused(b, lambda s: b.list_nodes())
        assert "TLS failed" in str(e) and "--registry-ca" in str(e), e
        assert PASSWORD not in str(e)

    check()


def test_an_expired_or_forgotten_etcd_token_logs_in_again(certs):
    server = start_secured("etcd", None, False, True)  # its own: it is restarted
    url = url_of(server, "kvd", PASSWORD)

    @run
    async def check():
        a, b = open_backend(url, cluster(), 1.0), None
        try:
            s = await a.open_session(30)
            await a.register_node(s, node("a"))
            b = open_backend(url, a.keys.cluster, 1.0)
            assert [n.node_id for n in (await b.list_nodes())[1]] == ["a"]
            b._auth.token = "expired.1"  # what etcd answers for an expired token: "invalid auth token"
            assert [n.node_id for n in (await b.list_nodes())[1]] == ["a"] and b._auth.token != "expired.1"
            # a watch opened with an expired token: cancelled by etcd, logged in again, watched again
            rev, _ = await b.holders("r1")
            b._auth.token = "expired.2"
            later = asyncio.get_running_loop().call_later(
                0.2, lambda: asyncio.ensure_future(a.publish_batch(s, [Publish(holder("r1"))])))
            t0 = time.monotonic()
            _, found = await b.wait_holders("r1", rev, 3.0)
            later.cancel()
            assert [h.node_id for h in found] == ["a"] and time.monotonic() - t0 < 2.0
            # a wiped etcd forgets every token, and holds a call with one (until its raft index reaches the
            # token's): the call times out, and the next logs in again
            server.restart(wipe=True)
            deadline = time.monotonic() + 5
            while True:
                try:
                    assert (await b.list_nodes())[1] == []
                    break
                except RegistryUnavailable:
                    assert time.monotonic() < deadline, "still failing 5 s after the restart"
        finally:
            await a.close()
            if b is not None:
                await b.close()

    try:
        check()
    finally:
        stop_server(server)


def test_without_h11_the_etcd_backend_says_what_to_install(monkeypatch):
    import kvd.cluster.backends.etcd_http as etcd_http

    monkeypatch.setattr(etcd_http, "h11", None)
    with pytest.raises(RuntimeError, match=r"pip install 'kvd-daemon\[etcd\]'"):
        open_backend("etcd://127.0.0.1:1")


def test_a_tls_server_that_closes_on_a_client_without_a_certificate_is_a_refusal(tmp_path):
    # TLS 1.3: the client's handshake is over before the server has looked for a client certificate;
    # one that wants it may close without an alert kvd ever reads (seen once in CI beside Redis's
    # mTLS). A real TLS listener that does just that: the first command says what to check.
    import socket
    import ssl
    import threading

    certs = make_certs(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certs.server_cert, certs.server_key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def close_after_handshake() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                with server_ctx.wrap_socket(conn, server_side=True):
                    pass  # handshake done, then closed without an answer
            except (ssl.SSLError, OSError):
                pass

    threading.Thread(target=close_after_handshake, daemon=True).start()
    try:
        @run
        async def check():
            b = open_backend(f"rediss://127.0.0.1:{port}", cluster(), 2.0, ca_file=certs.server_cert)
            e = await refused(b)
            assert "TLS failed" in str(e) and "--registry-cert" in str(e) and "--registry-ca" in str(e), e
            # with a certificate of our own, the same close is what it seems: the registry is unavailable
            b = open_backend(f"rediss://127.0.0.1:{port}", cluster(), 2.0, ca_file=certs.server_cert,
                             cert_file=certs.client_cert, key_file=certs.client_key)
            try:
                with pytest.raises(RegistryUnavailable) as other:
                    await b.open_session(30)
                assert not isinstance(other.value, RegistryRefused), other.value
            finally:
                await b.close()

        check()
    finally:
        listener.close()


@pytest.mark.parametrize("setup, scheme", [("etcd-tls", "etcds"), ("redis-tls", "rediss")])
def test_a_plain_url_against_a_tls_server_suggests_the_tls_scheme(servers, setup, scheme):
    server = servers(setup)
    plain = url_of(server).replace(f"{scheme}://", f"{scheme[:-1]}://")

    @run
    async def check():
        b = open_backend(plain, cluster(), 2.0)
        try:
            with pytest.raises(RegistryUnavailable) as e:
                await b.open_session(30)
                await b.list_nodes()
        finally:
            await b.close()
        return str(e.value)

    assert f"use {scheme}://" in check()


def test_a_plain_url_that_meets_a_plain_server_going_away_suggests_no_tls(servers):
    server = servers("etcd-auth")  # (plain: an answer came, so a later hang-up is no TLS server's)

    @run
    async def check():
        b = open_backend(url_of(server, "kvd", PASSWORD), cluster(), 2.0)
        try:
            await b.list_nodes()
            return b._http._tls_hint(False)
        finally:
            await b.close()

    assert check() == ""


def test_etcd_with_auth_and_a_client_certificate_with_a_common_name_says_so(certs, tmp_path):
    """etcd takes the CN for the user (and ignores the password); its gateway refuses the request
    with an HTTP 400 that read as 'registry unavailable'."""
    import dataclasses
    import subprocess
    from pathlib import Path

    cn_cert, cn_key = tmp_path / "cn.pem", tmp_path / "cn-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-days", "2", "-subj", "/CN=kvd-client", "-keyout", str(cn_key), "-out", str(cn_cert)],
                   check=True, capture_output=True, timeout=30)
    bundle = tmp_path / "client-ca.pem"
    bundle.write_bytes(Path(certs.client_ca).read_bytes() + cn_cert.read_bytes())
    server = start_secured("etcd", dataclasses.replace(certs, client_ca=str(bundle)), True, True)
    try:
        @run
        async def check():
            b = open_backend(url_of(server, "kvd", PASSWORD), cluster(), 2.0, ca_file=certs.server_cert,
                             cert_file=str(cn_cert), key_file=str(cn_key))
            return await refused(b, lambda s: b.list_nodes())

        e = check()
        assert "has a CommonName" in str(e) and "no CommonName" in str(e) and PASSWORD not in str(e), e
    finally:
        stop_server(server)

"""Registry URL parsing, credentials and TLS options: pure (temp files, no server)."""
from __future__ import annotations

import pytest

from kvd.cluster.url import RegistryURL, open_backend, parse_url, redact, with_options


@pytest.mark.parametrize("url, want", [
    ("etcd://127.0.0.1:2379", RegistryURL("etcd", (("127.0.0.1", 2379),))),
    ("etcd://h1:1,h2:2,[::1]:3", RegistryURL("etcd", (("h1", 1), ("h2", 2), ("::1", 3)))),
    ("etcd://h1", RegistryURL("etcd", (("h1", 2379),))),
    ("redis://r:6380", RegistryURL("redis", (("r", 6380),))),
    ("redis://r:6380/3", RegistryURL("redis", (("r", 6380),), 3)),
    ("redis://r/", RegistryURL("redis", (("r", 6379),))),
    ("etcds://h1:1,h2:2", RegistryURL("etcd", (("h1", 1), ("h2", 2)), tls=True)),
    ("rediss://r/1", RegistryURL("redis", (("r", 6379),), 1, tls=True)),
    ("redis://kvd@r", RegistryURL("redis", (("r", 6379),), username="kvd")),
])
def test_good_urls(url, want):
    assert parse_url(url) == want
    assert parse_url(str(want)) == want


@pytest.mark.parametrize("url, user, password, shown", [
    ("etcd://kvd:s3cret@h:1,h2:2", "kvd", "s3cret", "etcd://kvd:***@h:1,h2:2"),
    ("etcds://k%40d:p%3Aw%2Fx@h:1", "k@d", "p:w/x", "etcds://k%40d:***@h:1"),  # percent-decoded
    ("redis://:s3cret@r:6380/2", "", "s3cret", "redis://:***@r:6380/2"),  # the default user
    ("rediss://kvd:a@b/c@r", "kvd", "a@b/c", "rediss://kvd:***@r:6379"),  # raw '@' and '/' in the password
])
def test_credentials_in_the_url_are_parsed_and_never_shown(url, user, password, shown):
    u = parse_url(url)
    assert (u.username, u.password) == (user, password)
    assert str(u) == shown and password not in repr(u)
    assert password not in redact(url) and "***" in redact(url)


@pytest.mark.parametrize("url, words", [
    ("etcd://:s3cret@h:1", "etcd needs a user name"), ("etcd://u:s3cret@h:x", "bad port"),
    ("redis://u:s3cret@a:1,b:2", "one server"), ("ftp://u:s3cret@h", "expected"), ("u:s3cret@h:1", "expected"),
])
def test_errors_about_a_url_with_a_password_do_not_show_it(url, words):
    with pytest.raises(ValueError, match=words) as e:
        parse_url(url)
    assert "s3cret" not in str(e.value)


def test_a_password_file_overrides_the_urls_and_needs_the_etcd_user(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("  fromfile  \nsecond line\n")
    u, tls = with_options(parse_url("etcd://kvd:inurl@h:1"), password_file=str(pw))
    assert (u.username, u.password, tls) == ("kvd", "fromfile", None)
    assert parse_url("redis://r").password == ""
    assert with_options(parse_url("redis://r"), password_file=str(pw))[0].password == "fromfile"
    with pytest.raises(ValueError, match="needs the etcd user"):
        with_options(parse_url("etcd://h:1"), password_file=str(pw))
    with pytest.raises(ValueError, match=r"--registry-password-file .*cannot read"):
        with_options(parse_url("etcd://kvd@h:1"), password_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="first line is empty"):
        with_options(parse_url("etcd://kvd@h:1"), password_file=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="without a password"):
        with_options(parse_url("etcd://kvd@h:1"))


def test_tls_options_are_checked_when_the_backend_opens(tmp_path):
    with pytest.raises(ValueError, match=r"--registry-ca .*missing.pem.*cannot read"):
        open_backend("etcds://h:1", ca_file=str(tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match=r"--registry-ca .*not a PEM CA bundle"):
        open_backend("rediss://h:1", ca_file=str(tmp_path / "junk.pem"))
    with pytest.raises(ValueError, match="--registry-cert and --registry-key go together"):
        open_backend("etcds://h:1", cert_file=str(tmp_path / "junk.pem"))
    with pytest.raises(ValueError, match=r"--registry-key .*cannot read"):
        open_backend("etcds://h:1", cert_file=str(tmp_path / "junk.pem"), key_file=str(tmp_path / "nokey"))
    with pytest.raises(ValueError, match=r"--registry-cert .*not a PEM certificate"):
        open_backend("etcds://h:1", cert_file=str(tmp_path / "junk.pem"), key_file=str(tmp_path / "junk.pem"))
    with pytest.raises(ValueError, match="need TLS: use etcds://"):
        open_backend("etcd://h:1", ca_file=str(tmp_path / "junk.pem"))
    _, ctx = with_options(parse_url("etcds://h:1"))
    assert ctx is not None and ctx.check_hostname  # the system's CAs, hostname verification on


@pytest.mark.parametrize("url, words", [
    ("http://h:1", r"expected etcd\[s\]://"), ("etcd:/h:1", r"expected etcd\[s\]://"), ("h:2379", "expected"),
    ("etcd://", "missing host"), ("etcd://h:1,", "missing host"), ("etcd://:1", "missing host"),
    ("etcd://h:x", "bad port"), ("etcd://h:0", "bad port"), ("etcd://h:70000", "bad port"),
    ("etcd://h:1/prod", "no path"), ("redis://a:1,b:2", "one server"), ("redis://h:1/x", "database number"),
    ("etcd://h:1?x=1", "query"), ("etcd://[::1:1", "IPv6"),
])
def test_bad_urls_raise_clear_value_errors(url, words):
    with pytest.raises(ValueError, match=words) as e:
        parse_url(url)
    assert repr(url) in str(e.value) or "expected" in str(e.value)


def test_open_backend_needs_no_io_and_checks_the_cluster():
    b = open_backend("etcd://127.0.0.1:1", cluster="c1")
    assert b.keys.prefix == "/kvd/c1/"
    with pytest.raises(ValueError, match="cluster name"):
        open_backend("etcd://127.0.0.1:1", cluster="a/b")


def test_import_needs_no_backend_libraries():
    import subprocess
    import sys
    code = ("import sys, kvd.cluster; from kvd.cluster import Registry, ClusterMember; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('redis', 'grpc', 'google', 'torch', 'zmq')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)

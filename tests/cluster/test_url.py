"""Registry URL parsing: pure."""
from __future__ import annotations

import pytest

from kvd.cluster.url import RegistryURL, open_backend, parse_url


@pytest.mark.parametrize("url, want", [
    ("etcd://127.0.0.1:2379", RegistryURL("etcd", (("127.0.0.1", 2379),))),
    ("etcd://h1:1,h2:2,[::1]:3", RegistryURL("etcd", (("h1", 1), ("h2", 2), ("::1", 3)))),
    ("etcd://h1", RegistryURL("etcd", (("h1", 2379),))),
    ("redis://r:6380", RegistryURL("redis", (("r", 6380),))),
    ("redis://r:6380/3", RegistryURL("redis", (("r", 6380),), 3)),
    ("redis://r/", RegistryURL("redis", (("r", 6379),))),
])
def test_good_urls(url, want):
    assert parse_url(url) == want
    assert parse_url(str(want)) == want


@pytest.mark.parametrize("url, words", [
    ("http://h:1", "expected etcd://"), ("etcd:/h:1", "expected etcd://"), ("h:2379", "expected"),
    ("etcd://", "missing host"), ("etcd://h:1,", "missing host"), ("etcd://:1", "missing host"),
    ("etcd://h:x", "bad port"), ("etcd://h:0", "bad port"), ("etcd://h:70000", "bad port"),
    ("etcd://h:1/prod", "no path"), ("redis://a:1,b:2", "one server"), ("redis://h:1/x", "database number"),
    ("redis://u:p@h:1", "credentials"), ("etcd://h:1?x=1", "query"), ("etcd://[::1:1", "IPv6"),
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

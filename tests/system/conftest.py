"""Fixtures that start real `kvd serve` daemons in subprocesses on loopback and temp ipc paths."""
from __future__ import annotations

import os

import pytest

from kvd.testing.daemons import DaemonFactory

# The transfer suite runs on both data planes: a module that sets BOTH_PLANES = True gets each of its
# tests twice, its daemons on ZeroMQ's frames and on NIXL (every entry on the plane, however small).
PLANES = {
    "zmq": ([], {}),
    "nixl": (["--data-plane", "nixl"], {"KVD_TEST_PLANE_MIN_BYTES": "1", "UCX_TLS": "tcp"}),
}


def pytest_generate_tests(metafunc):
    """A test marked frames_only checks the frames themselves (a raw ZeroMQ peer speaks to the daemon):
    it runs on zmq only."""
    if (getattr(metafunc.module, "BOTH_PLANES", False) and "daemons" in metafunc.fixturenames
            and metafunc.definition.get_closest_marker("frames_only") is None):
        metafunc.parametrize("daemons", list(PLANES), indirect=True)


@pytest.fixture
def daemons(tmp_path, request):
    plane = getattr(request, "param", "zmq")
    if plane == "nixl":
        from kvd.daemon.plane.nixl import available

        if not available():
            if os.environ.get("CI") == "true":
                pytest.fail("NIXL is not installed (./dev test installs it)")
            pytest.skip("NIXL is not installed (./dev setup installs it)")
    extra, env = PLANES[plane]
    factory = DaemonFactory(tmp_path, extra=extra, env=env)
    yield factory
    failures = factory.stop_all()
    assert not failures, "\n".join(failures)


@pytest.fixture
def daemon(daemons):
    return daemons.start("A")


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c


def pytest_collection_modifyitems(config, items):
    """`cuda` tests need a GPU: skip them cleanly without one."""
    import torch

    if torch.cuda.is_available():
        try:
            import cupy  # noqa: F401
            return
        except ImportError:
            from kvd.memory.cuda import cupy_hint

            reason = f"cupy is not installed ({cupy_hint()})"
    else:
        reason = "no CUDA GPU on this machine"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

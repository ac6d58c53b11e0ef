"""Fixtures that start real `kvd serve` daemons in subprocesses on loopback and temp ipc paths."""
from __future__ import annotations

import pytest

from kvd.testing import DaemonFactory


@pytest.fixture
def daemons(tmp_path):
    factory = DaemonFactory(tmp_path)
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

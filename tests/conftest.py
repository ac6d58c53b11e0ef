"""Fixtures that start real `kvd serve` daemons in subprocesses on loopback and temp ipc paths."""
from __future__ import annotations

import pytest

from kvd.testing import DaemonFactory, DaemonProc, free_port, wait_ready  # noqa: F401 (re-exported for tests)


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

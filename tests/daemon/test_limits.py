"""The connection caps the open-file limit can honour (kvd.daemon.daemon.fit_connection_caps): pure."""
from __future__ import annotations

import logging

from kvd.daemon.daemon import FD_HEADROOM, MIN_CAP, fit_connection_caps


def test_caps_that_fit_are_kept():
    assert fit_connection_caps(1 << 20, 1024, 1024) == (1024, 1024)
    assert fit_connection_caps(2048 + FD_HEADROOM, 1024, 1024) == (1024, 1024)


def test_caps_that_do_not_fit_are_cut_in_proportion_and_said(caplog):
    with caplog.at_level(logging.WARNING):
        clients, peers = fit_connection_caps(1024, 1024, 1024)  # the usual default soft limit
    assert clients + peers == 1024 - FD_HEADROOM and clients == peers == 256
    assert "serving at most 256 clients and 256 peer connections" in caplog.text
    clients, peers = fit_connection_caps(1024, 3000, 1000)
    assert clients + peers <= 1024 - FD_HEADROOM and clients == 384 and peers == 128


def test_however_few_descriptors_each_kind_keeps_a_floor():
    assert fit_connection_caps(100, 1024, 1024) == (MIN_CAP, MIN_CAP)

"""Intact or not at all, for the tier as for handoffs: a writer frozen past its lease never writes
into blocks that were given to someone else (issue 39, item 1).

A writer reserves room (a tier page or a handoff), then freezes before it copies. Its lease runs out
and the daemon ends its put; meanwhile another client stores a victim (a handoff, or a tier page in
another namespace) in a pool with room for both. The writer then runs again and copies into the
blocks it was given. The victim must come back bit-exact: the late writer's blocks stay parked until
it lets go (its commit, or its hang-up), whatever its lease says.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvd.testing.daemons import eventually

from .frozen_writer import PAGE_BYTES

WRITER = Path(__file__).with_name("frozen_writer.py")
# a pool with room for the writer's page and one victim, no more: a victim given the writer's freed
# blocks takes exactly those (best fit), so a late write lands in it if the blocks were not parked
FLAGS = ["--lease-timeout", "1s", "--scratch-max", "0", "--cache-size", "1"]


def process_state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def start_writer(daemon, kind: str) -> subprocess.Popen:
    writer = subprocess.Popen([sys.executable, str(WRITER), daemon.socket, kind], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    eventually(lambda: writer.poll() is not None or process_state(writer.pid) == "T", timeout=20)
    assert writer.poll() is None, writer.communicate()
    return writer


def wait_lease_ended(daemon, kind: str) -> None:
    """Until the daemon has ended the frozen writer's put (its lease ran out)."""
    line = "a cache put was not committed within" if kind == "tier" else "dropped late-req: its writer did not finish"
    eventually(lambda: line in daemon.log(), timeout=10)


def store_victim(daemon, kind: str) -> torch.Tensor:
    victim = torch.randint(0, 255, (PAGE_BYTES,), dtype=torch.uint8)  # never 0xAA... in every byte
    with daemon.client() as c:
        if kind == "tier":
            assert c.cache_put(["victim-page"], [victim], namespace="victim-ns") == [True]
        else:
            c.put("victim-req", {"x": victim})
    return victim


def read_victim(daemon, kind: str) -> torch.Tensor:
    with daemon.client() as c:
        if kind == "tier":
            out = torch.empty(PAGE_BYTES, dtype=torch.uint8)
            assert c.cache_get(["victim-page"], [out], namespace="victim-ns") == [True]
            return out
        return c.get("victim-req", timeout=5, keep=True)["x"]


@pytest.mark.parametrize("victim_kind", ["handoff", "tier"])
@pytest.mark.parametrize("writer_kind", ["handoff", "tier"])
def test_frozen_writer_past_its_lease_writes_into_no_one_elses_blocks(daemons, writer_kind, victim_kind):
    daemon = daemons.start("A", pool_size="512KiB", extra=FLAGS)
    writer = start_writer(daemon, writer_kind)
    try:
        wait_lease_ended(daemon, writer_kind)
        victim = store_victim(daemon, victim_kind)
    finally:
        writer.send_signal(subprocess.signal.SIGCONT)
    out, err = writer.communicate(timeout=20)
    assert writer.returncode == 0, err
    result = json.loads(out)["result"]
    got = read_victim(daemon, victim_kind)
    wrong = int((got != victim).sum())
    assert wrong == 0, f"{wrong} of {PAGE_BYTES} victim bytes were overwritten by the late writer ({result})"
    # the late writer learns its put failed, and gives its blocks back
    if writer_kind == "tier":
        assert result == [False]
    else:
        assert result.startswith("Timeout:") and "--lease-timeout" in result, result
    with daemon.client() as c:
        # the victim's blocks only: the late writer's came back once it let go
        eventually(lambda: c.stats()["pool"]["used_bytes"] == PAGE_BYTES, timeout=5)
        assert c.cache_stats()["parked_bytes"] == 0

"""TransferStats (kvd.integrations.paged.handoff): what a worker reports per step is never dropped."""
from __future__ import annotations

from kvd.integrations.paged.handoff import TransferStats


def test_a_step_with_only_bytes_saved_is_not_empty():
    # layers of a request whose save has not finished yet: bytes moved, no save counted; the vLLM
    # worker skips empty stats, so these bytes were thrown away before (saved_bytes=0 in the log)
    stats = TransferStats(saved_bytes=4096)
    assert not stats.empty()
    assert not TransferStats(loaded_bytes=1).empty()


def test_fresh_stats_are_empty():
    assert TransferStats().empty()

"""A writer that freezes itself mid-put, for tests/system/test_tier_integrity.py (runs in its own
process: `python frozen_writer.py SOCKET handoff|tier`).

It reserves room as any client does, then stops itself (SIGSTOP, as a GC pause, a debugger or swap
would stop it) just before it copies its bytes into the pool. The test lets the reservation's lease
run out and other clients allocate, then continues it: it copies 0xAA bytes into the blocks it was
given and commits. It prints one JSON line: what its put returned, or the error it raised.
"""
from __future__ import annotations

import json
import os
import signal
import sys

import torch

import kvd
import kvd.client.cache
import kvd.client.core

PAGE_BYTES = 256 << 10


def frozen_copy_in(original):
    def copy_in(pool, tensor, segments):
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen here until the test sends SIGCONT
        return original(pool, tensor, segments)
    return copy_in


def main() -> None:
    socket, kind = sys.argv[1], sys.argv[2]
    kvd.client.core.copy_in = frozen_copy_in(kvd.client.core.copy_in)
    kvd.client.cache.copy_in = frozen_copy_in(kvd.client.cache.copy_in)
    late = torch.full((PAGE_BYTES,), 0xAA, dtype=torch.uint8)
    with kvd.Client(socket) as client:
        try:
            if kind == "tier":
                result = client.cache_put(["late-page"], [late], namespace="writer-ns")
            else:
                client.put("late-req", {"x": late})
                result = "put returned"
        except kvd.KvdError as exc:
            result = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"result": result}), flush=True)


if __name__ == "__main__":
    main()

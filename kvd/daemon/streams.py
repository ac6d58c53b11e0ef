"""Bookkeeping for caches that move while they are being written (layer-wise streaming).

`Producer`: a put whose bytes go to a peer as they are written (or, for a plain put with
dest, all at commit). `StreamReader`: a local get_stream client that is told which tensors
are complete as they arrive. No sockets here; the daemon carries out what these record.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .peer.transfers import Outbound
from .store.entries import Entry


@dataclass(eq=False)
class Producer:
    entry: Entry
    lease_token: int  # the consuming lease the outbound transfer holds
    dest: str
    outbound: Outbound | None = None  # set once the peer accepted the connection
    pending: list[tuple[int, int]] = field(default_factory=list)  # ranges written before that
    task: asyncio.Task | None = None  # open_push + wait for done; its result is the push's outcome
    stream: bool = False  # opened before the bytes were written: the peer waits for a seal
    committed: bool = False  # the producer committed (seal as soon as the transfer is open)
    dropped: Exception | None = None  # the entry was deleted or expired before the transfer opened


@dataclass(eq=False)
class StreamReader:
    rid: bytes  # the client's routing id on the local socket
    req: int
    entry: Entry
    lease_token: int
    announced: set[int] = field(default_factory=set)

    def news(self, indices: list[int]) -> list[int]:
        """Indices not yet announced to this reader; records them as announced."""
        fresh = [i for i in indices if i not in self.announced]
        self.announced.update(fresh)
        return fresh

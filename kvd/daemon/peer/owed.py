"""What the daemon owes its peers (daemon process, peer side): the bytes ZeroMQ holds for them.

ZeroMQ bounds what it queues for a connection by a count of messages (SNDHWM), whatever their
size, and a peer that asks for data and never reads it makes the daemon hold whatever it asked
for. `Backlog` counts the bytes of one TCP connection instead, asking the kernel what ZeroMQ has
written so far; `Account` is one connection's count with the means to cut it (a connection to our
ROUTER, or our link to a peer); `Owed` holds every account and keeps three bounds:

- per connection, PEER_QUEUE_BYTES copied into ZeroMQ and not yet written to the kernel;
- over all connections, PEER_QUEUE_TOTAL (a peer may open many connections, each under the cap):
  past it the connections owed the most are cut until the rest fit;
- in time: a connection owed bytes that the kernel has not taken for `stall` seconds (the peer
  stopped reading, yet keeps its connection alive) is cut, however little it holds.

A cut connection's frames are dropped by ZeroMQ, its transfers fail as for a lost peer, and the
cut is logged (at most once a minute per peer). Frames ZeroMQ borrows from the pool instead of
copying (chunk payloads of 1 MiB and more) are not counted: they take no memory of ours, and the
transfer window bounds them.
"""
from __future__ import annotations

import collections
import fcntl
import logging
import os
import socket
import struct
import termios
import weakref
from collections.abc import Callable

from kvd.memory.heap import give_back_heap
from kvd.throttle import Throttle

from .tcpconn import TcpConnection

log = logging.getLogger(__name__)

# bytes copied into ZeroMQ for one peer connection and not yet written to the kernel; a peer past
# it does not read what it asked for, and is cut
PEER_QUEUE_BYTES = 64 << 20
PEER_QUEUE_TOTAL = 256 << 20  # the same, over all peer connections together
STALL_CHECK_EVERY = 1.0  # seconds between looks for connections whose queue does not move
# once cut connections held this much, the heap is given back to the kernel (the daemon keeps freed
# heap for ZeroMQ's receive buffers otherwise: kvd.memory.heap), so that a flood that was cut
# leaves no RSS behind
TRIM_AFTER = 16 << 20

# struct tcp_info (linux/tcp.h, since 4.1): tcpi_bytes_acked, a u64 at 120
_TCP_INFO_BYTES_ACKED, _TCP_INFO_LEN = 120, 128
_OUTQ = struct.Struct("i")
_MiB = 1 << 20


def kernel_written(fd: int) -> int | None:
    """Bytes written into TCP connection fd so far, by whoever holds it (ZeroMQ): those the peer
    acknowledged plus those still in the send queue (SIOCOUTQ). None if fd is no TCP connection."""
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            queued = _OUTQ.unpack(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(_OUTQ.size)))[0]
    except OSError:
        return None
    if len(info) < _TCP_INFO_LEN:
        return None
    return struct.unpack_from("=Q", info, _TCP_INFO_BYTES_ACKED)[0] + queued


class Backlog:
    """The bytes handed to ZeroMQ for one TCP connection that it has not written to the kernel
    yet, for a cap on them: `add` counts each message ZeroMQ takes and says when to look, `settle`
    is given what the kernel says ZeroMQ wrote so far (`kernel_written`) and returns the bytes
    still queued in frames ZeroMQ copied.

    ZeroMQ writes a connection's messages in order, framed: a frame of n bytes takes n + 2 bytes
    on the wire up to 255, n + 9 above (ZMTP 3), and under CURVE n + 35 up to 222, n + 42 above
    (its MESSAGE command: name, nonce, MAC, flags). What it writes of its own (greeting, handshake,
    heartbeats) also counts as written; that is at least the largest excess of written over
    handed ever seen, and taking that off keeps the count from ever being above the truth. It is
    below it only by what ZeroMQ wrote of its own since its queue was last empty: a heartbeat's
    few bytes a second, for a peer that reads nothing.

    Frames ZeroMQ borrows instead of copying (`lend_from` bytes and more: chunk payloads sent
    zero-copy from the pool) are not ours to cap: the transfer window bounds them, and
    transfer_timeout takes them back. They are remembered, one entry per MiB at least, so that
    what is still queued of them is told apart from the copied bytes; that list is pruned when
    it has doubled since the last look."""

    __slots__ = (
        "_lend_from",
        "_long_extra",
        "_short",
        "_short_extra",
        "cap",
        "check_at",
        "conn",
        "copied",
        "cut",
        "handed",
        "lent",
        "lent_queued",
        "own",
        "prune_at",
        "written",
    )

    PRUNE = 1024  # lent frames remembered before the kernel is asked anyway

    def __init__(self, cap: int, lend_from: int, curve: bool = False) -> None:
        self.cap = cap
        self.handed = 0  # bytes handed to ZeroMQ, as they go on the wire
        self.copied = 0  # the part of them in frames ZeroMQ copied
        self.own = 0  # bytes ZeroMQ wrote of its own, at least
        self.written = 0  # what the kernel said last
        self.check_at = cap  # look again once `copied` passes this: the queue may have passed the cap
        self.lent: collections.deque = collections.deque()  # (handed at its end, its bytes) per lent frame
        self.lent_queued = 0  # the bytes of those frames
        self.prune_at = self.PRUNE
        self._lend_from = lend_from
        self._short, self._short_extra, self._long_extra = (223, 35, 42) if curve else (256, 2, 9)
        self.conn: object = None  # the connection the kernel's counts were of
        self.cut = False  # the connection was cut: what is sent for it now is dropped

    def add(self, frames: list) -> bool:
        """Count a message ZeroMQ took; True when it is time to ask the kernel (`settle`)."""
        handed, copied = self.handed, self.copied
        for frame in frames:
            size = len(frame)
            n = size + (self._short_extra if size < self._short else self._long_extra)
            handed += n
            if size < self._lend_from:
                copied += n
            else:
                self.lent.append((handed, n))
                self.lent_queued += n
        self.handed, self.copied = handed, copied
        return copied > self.check_at or len(self.lent) > self.prune_at

    def settle(self, written: int, conn: object = None) -> int:
        """The kernel says `written` bytes went into the connection so far: the bytes of copied
        frames still queued in ZeroMQ (never more than there are). `conn` names the connection; on
        another one than before (or one whose count went back) the counts start again."""
        if conn != self.conn:
            if self.conn is not None:
                self._restart()
            self.conn = conn
        elif written < self.written:
            self._restart()
        self.written = written
        own = written - self.handed
        if own > self.own:
            self.own = own
        ours = written - self.own  # of what we handed, at most this much was written
        lent = self.lent
        while lent and lent[0][0] <= ours:
            self.lent_queued -= lent.popleft()[1]
        queued = self.handed - ours - self.lent_queued
        if lent:  # the first of them may be partly written
            end, n = lent[0]
            queued += max(0, ours - (end - n))
        self.check_at = self.copied + self.cap - queued
        self.prune_at = max(self.PRUNE, 2 * len(lent))
        return queued

    def unknown(self) -> None:
        """The kernel could not be asked (no TCP connection known, or it is gone): nothing can be
        told of what was counted so far; count afresh, and look again a cap later."""
        self._restart()
        self.check_at = self.cap
        self.prune_at = self.PRUNE

    def _restart(self) -> None:
        self.handed = self.copied = self.own = self.written = self.lent_queued = 0
        self.lent.clear()



class Account:
    """One peer connection's count (`backlog`), with how to find and cut the connection. `bound`
    is the most it may have queued: exact when the kernel was last asked, plus what was copied
    since."""

    __slots__ = ("__weakref__", "backlog", "bound", "connection", "cutter", "key", "name", "owed", "stalled_since")

    def __init__(self, owed: Owed, key: object, name: Callable[[], str], connection: Callable[[], TcpConnection | None],
                 cutter: Callable[[], bool], lend_from: int, curve: bool) -> None:
        self.owed, self.key = owed, key
        self.backlog = Backlog(owed.per_connection, lend_from, curve)
        self.name, self.connection, self.cutter = name, connection, cutter
        self.bound = 0
        self.stalled_since: float | None = None  # since when the kernel took none of what is queued

    def taken(self, frames: list) -> None:
        """ZeroMQ took a message for this connection (never one that was cut: nothing is sent to it)."""
        backlog, owed = self.backlog, self.owed
        copied = backlog.copied
        look = backlog.add(frames)
        grown = backlog.copied - copied
        self.bound += grown
        owed.upper += grown
        if look:
            owed.check(self)
        elif owed.upper > owed.total:
            owed.rebalance()

    def settle(self) -> int:
        """Ask the kernel: the bytes of copied frames still queued (0 if that cannot be told)."""
        conn = self.connection()
        written = None if conn is None else kernel_written(conn.fd)
        if written is None:  # (not said hello yet, or gone: its disconnection is on its way)
            self.backlog.unknown()
            queued = 0
        else:
            queued = self.backlog.settle(written, conn)
        self.owed.upper += queued - self.bound
        self.bound = queued
        return queued


class Owed:
    """Every peer connection's account, and the three bounds on them (see the module)."""

    def __init__(self, per_connection: int = PEER_QUEUE_BYTES, total: int = PEER_QUEUE_TOTAL,
                 stall: float = 5.0) -> None:
        self.per_connection, self.total, self.stall = per_connection, total, stall
        self.upper = 0  # the sum of the accounts' bounds (of accounts gone too, until the next rebalance)
        self.cuts = 0  # connections cut for not reading
        self._accounts: weakref.WeakValueDictionary[object, Account] = weakref.WeakValueDictionary()
        self._logged = Throttle(60.0, keys=256)
        self._looked = 0.0  # when stalls were last looked for
        self._freed = 0  # bytes cut connections held, since the heap was last given back

    def account(self, key: object, name: Callable[[], str], connection: Callable[[], TcpConnection | None],
                cutter: Callable[[], bool], lend_from: int, curve: bool) -> Account:
        """The account of a connection (kept as long as its sender holds it)."""
        self.forget(key)
        account = self._accounts[key] = Account(self, key, name, connection, cutter, lend_from, curve)
        return account

    def forget(self, key: object) -> None:
        """The connection is gone for good: ZeroMQ dropped what it held for it."""
        self.released(key)
        self._accounts.pop(key, None)

    def released(self, key: object) -> None:
        """The connection under an account closed (ZeroMQ said so): what it held is dropped. (A cut
        connection's bytes are counted until then: ZeroMQ lets go of them only once it has seen the
        cut, and a flood of peers must not get them counted twice in the meantime.)"""
        account = self._accounts.get(key)
        if account is not None:
            self.upper -= account.bound
            account.bound = 0

    def check(self, account: Account) -> None:
        """What the account sent since the kernel was last asked could have passed the cap: ask."""
        queued = account.settle()
        if queued > self.per_connection:
            self.cut(account, f"{queued / _MiB:.1f} MiB queued for it, more than the "
                              f"{self.per_connection / _MiB:g} MiB a connection may have")
        if self.upper > self.total:
            self.rebalance()

    def rebalance(self) -> None:
        """What every connection may have queued together passed the total: ask the kernel for
        each, and cut the ones owed the most until the rest fit."""
        accounts = list(self._accounts.values())
        self.upper = sum(a.bound for a in accounts if a.backlog.cut)  # (cut: until ZeroMQ let go)
        accounts = [a for a in accounts if not a.backlog.cut]
        for account in accounts:
            account.bound = 0
            account.settle()
        for account in sorted(accounts, key=lambda a: a.bound, reverse=True):
            if self.upper <= self.total:
                break
            self.cut(account, f"{account.bound / _MiB:.1f} MiB queued for it, the most, when what is queued for "
                              f"all peers passed {self.total / _MiB:g} MiB")

    def enforce(self, now: float) -> None:
        """Housekeeping: a connection owed bytes the kernel has not taken for `stall` seconds is
        cut (a peer that stopped reading, whatever it still sends)."""
        if now - self._looked < STALL_CHECK_EVERY:
            return
        self._looked = now
        if self._freed >= TRIM_AFTER:  # (ZeroMQ has let go of what it held for them by now)
            self._freed = 0
            give_back_heap()
        for account in list(self._accounts.values()):
            if account.bound <= 0 or account.backlog.cut:
                account.stalled_since = None
                continue
            written = account.backlog.written
            if account.settle() == 0 or account.backlog.written != written:
                account.stalled_since = None  # (all written, or the kernel took some since the last look)
            elif account.stalled_since is None:
                account.stalled_since = now
            elif now - account.stalled_since >= self.stall:
                self.cut(account, f"{account.bound / _MiB:.1f} MiB queued for it, none of it taken for "
                                  f"{now - account.stalled_since:.0f}s")

    def cut(self, account: Account, why: str) -> None:
        if not account.cutter():
            return
        account.backlog.cut = True
        account.stalled_since = None
        self._freed += account.bound
        self.cuts += 1
        name = account.name()
        if self._logged.allow(name):
            log.warning("peer %s does not read what we send (%s): connection closed (%d cut so far; logged at "
                        "most once a minute per peer)", name, why, self.cuts)

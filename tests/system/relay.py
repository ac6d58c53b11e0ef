"""A TCP relay between two daemons that stops forwarding after a given number of bytes.

A fault that must land mid-transfer (the receiver killed or frozen) needs the transfer not to be
able to finish first: 112 MiB more on loopback take ~0.1 s, less than a busy machine's scheduling
delay between "B has 16 MiB" and the kill. Through the relay the sender's bytes stop at the limit,
so the transfer is still under way whenever the fault lands.
"""
from __future__ import annotations

import contextlib
import selectors
import socket
import threading

from kvd.testing.daemons import free_port


class PausingRelay(threading.Thread):
    """Listens on 127.0.0.1:`port`, connects each accepted connection to `target_port`, and forwards
    both ways; after `limit` bytes towards the target it reads nothing more from that side.
    towards_target=False holds the other way instead: what the target sends back (a pull's bytes,
    served by the daemon that was dialled)."""

    def __init__(self, target_port: int, limit: int, towards_target: bool = True) -> None:
        super().__init__(daemon=True, name="relay")
        self.target_port, self.limit, self.towards_target = target_port, limit, towards_target
        self.forwarded = 0  # bytes in the held direction, over every connection
        self.paused = threading.Event()
        self._stopping = threading.Event()
        self._resume = threading.Event()
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.setblocking(False)

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        peers: dict[socket.socket, tuple[socket.socket, bool]] = {}  # sock -> (its other end, towards target)
        while not self._stopping.is_set():
            if self._resume.is_set():
                self._resume.clear()
                self._read_senders_again(sel, peers)
            for key, _ in sel.select(0.05):
                sock = key.fileobj
                if sock is self._listener:
                    self._accept(sel, peers)
                    continue
                other, to_target = peers.get(sock, (None, False))
                if other is None:
                    continue
                held = to_target == self.towards_target
                if held and self.forwarded >= self.limit:
                    continue  # (paused in this very round: recv(0) would read as the end)
                try:
                    data = sock.recv(min(1 << 16, self.limit - self.forwarded) if held else 1 << 16)
                except OSError:
                    data = b""
                if not data:
                    self._close(sel, peers, sock)
                    continue
                try:
                    other.sendall(data)
                except OSError:
                    self._close(sel, peers, sock)
                    continue
                if held:
                    self.forwarded += len(data)
                    if self.forwarded >= self.limit:
                        self.paused.set()
                        for s, (_, towards) in peers.items():  # read nothing more from the sender
                            if towards == self.towards_target:
                                sel.unregister(s)
        for sock in list(peers):
            self._close(sel, peers, sock)
        self._listener.close()

    def _read_senders_again(self, sel: selectors.BaseSelector,
                            peers: dict[socket.socket, tuple[socket.socket, bool]]) -> None:
        for s, (_, towards) in peers.items():
            if towards == self.towards_target and s.fileno() >= 0 and not _registered(sel, s):
                sel.register(s, selectors.EVENT_READ, None)

    def _accept(self, sel, peers) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            target = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
        except OSError:
            client.close()
            return
        for sock in (client, target):
            sock.setblocking(True)  # sendall blocks: back-pressure, as on a direct connection
            if (sock is client) != self.towards_target or self.forwarded < self.limit:
                sel.register(sock, selectors.EVENT_READ, None)
        peers[client] = (target, True)
        peers[target] = (client, False)

    def _close(self, sel, peers, sock) -> None:
        """Either end gone: both are (a dead receiver is a dead link for the sender)."""
        other, _ = peers.pop(sock, (None, False))
        for s in (sock, other):
            if s is None:
                continue
            peers.pop(s, None)
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(s)
            s.close()

    def release(self) -> None:
        """Forward everything from now on, what was held too (as a frozen receiver that runs again)."""
        self.limit = 1 << 62
        self._resume.set()

    def stop(self) -> None:
        self._stopping.set()
        self.join(5)


def _registered(sel: selectors.BaseSelector, sock: socket.socket) -> bool:
    try:
        sel.get_key(sock)
        return True
    except KeyError:
        return False

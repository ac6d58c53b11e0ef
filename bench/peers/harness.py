"""Two-process write benchmark shared by the peer-engine scripts in this folder.

Runs inside .venv-peers (`.venv-peers/bin/python bench/peers/<engine>_write.py`), never in kvd's
.venv: it imports numpy and the standard library only, nothing of kvd or bench. The script started
by bench/peers.py is the initiator; it starts a second copy of itself with --target, which owns
the destination buffer. The two talk over the target's stdin/stdout, one JSON object a line.

The initiator writes the first n bytes of its buffer into the target's, n from --sizes, each
write timed from the call to its completion as the engine reports it (one-sided: the target's
code takes no part), CPU counted in both processes. After the timed writes of a size the target
clears its buffer, one more write lands, and the target compares the bytes with what was sent.
The result is one JSON object on the initiator's stdout; on failure, {"error", "install"}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from typing import Any, TextIO

import numpy as np

SEED = 11
WARMUP = 2  # the first write also opens the connection (a handshake, for both engines)

Serve = Callable[[np.ndarray], dict[str, Any]]  # target: register the buffer, describe it
Connect = Callable[[np.ndarray, dict[str, Any]], Callable[[int], None]]  # initiator: -> write(n)


class PeerError(Exception):
    """A failure with the line to tell the user and what to install or check."""

    def __init__(self, message: str, install: str = "") -> None:
        super().__init__(message)
        self.install = install


def package_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def pattern(nbytes: int) -> np.ndarray:
    """The bytes the initiator sends and the target expects (random, so an offset shows)."""
    return np.frombuffer(np.random.default_rng(SEED).bytes(nbytes), dtype=np.uint8)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of another process (all its threads) from /proc."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def private_stdout() -> TextIO:
    """Keep fd 1 for our JSON and send whatever the engines' C++ code prints there to stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return channel


def send(channel: TextIO, message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def run_target(serve: Serve, max_bytes: int) -> int:
    """Own the destination buffer until stdin closes; answer clear and verify requests."""
    channel = private_stdout()
    buffer = np.zeros(max_bytes, dtype=np.uint8)
    expected = pattern(max_bytes)  # before the first write: 1.7 s of CPU for 256 MiB, not to be timed
    try:
        info = serve(buffer)
    except PeerError as exc:
        send(channel, {"error": str(exc), "install": exc.install})
        return 1
    send(channel, {**info, "pid": os.getpid()})
    for line in sys.stdin:
        request = json.loads(line)
        nbytes = request["n"]
        if request["op"] == "clear":
            buffer[:nbytes] = 0
            send(channel, {"ok": True})
        elif request["op"] == "verify":
            send(channel, {"ok": bool(np.array_equal(buffer[:nbytes], expected[:nbytes]))})
    return 0


class Target:
    """The target process, seen from the initiator."""

    def __init__(self, script: str, max_bytes: int) -> None:
        self.process = subprocess.Popen([sys.executable, script, "--target", "--max-bytes", str(max_bytes)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self.receive()
        if "error" in self.info:
            raise PeerError(f"target: {self.info['error']}", self.info.get("install", ""))

    def receive(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            raise PeerError(f"target process exited (code {self.process.wait()}), see stderr")
        return json.loads(line)

    def ask(self, op: str, nbytes: int) -> bool:
        self.process.stdin.write(json.dumps({"op": op, "n": nbytes}) + "\n")
        self.process.stdin.flush()
        return self.receive()["ok"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


def measure(write: Callable[[int], None], target: Target, nbytes: int, repeats: int) -> dict[str, Any]:
    """Timed writes of nbytes, then one checked write."""
    seconds, cpu = [], []
    for i in range(WARMUP + repeats):
        cpu0 = time.process_time() + cpu_seconds(target.process.pid)
        t0 = time.perf_counter()
        write(nbytes)
        elapsed = time.perf_counter() - t0
        if i >= WARMUP:
            seconds.append(elapsed)
            cpu.append(time.process_time() + cpu_seconds(target.process.pid) - cpu0)
    target.ask("clear", nbytes)
    write(nbytes)
    return {"size": nbytes, "seconds": seconds, "cpu": cpu, "verified": target.ask("verify", nbytes)}


def run_initiator(script: str, connect: Connect, sizes: list[int], repeats: list[int]) -> dict[str, Any]:
    buffer = pattern(max(sizes)).copy()  # writable: some engines register it read-write
    target = Target(script, max(sizes))
    try:
        write = connect(buffer, target.info)
        results = [measure(write, target, n, r) for n, r in zip(sizes, repeats)]
    finally:
        target.close()
    return {"results": results}


def main(case: str, engine: str, version: str, serve: Serve, connect: Connect) -> int:
    """Entry point of an engine's script: the initiator by default, the target with --target."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", action="store_true")
    parser.add_argument("--max-bytes", type=int)
    parser.add_argument("--sizes", default="65536")
    parser.add_argument("--repeats", default="5")
    args = parser.parse_args()
    script = os.path.abspath(sys.argv[0])
    if args.target:
        return run_target(serve, args.max_bytes)
    channel = private_stdout()
    head = {"case": case, "engine": engine, "version": version}
    try:
        sizes = [int(n) for n in args.sizes.split(",")]
        repeats = [int(r) for r in args.repeats.split(",")]
        send(channel, {**head, **run_initiator(script, connect, sizes, repeats)})
        return 0
    except PeerError as exc:
        send(channel, {**head, "error": str(exc), "install": exc.install})
    except Exception as exc:
        traceback.print_exc()
        send(channel, {**head, "error": f"{type(exc).__name__}: {exc}", "install": ""})
    return 1

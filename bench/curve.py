"""What CURVE costs (the benchmark's process, with its daemons): push throughput with peer
authentication and encryption on (a cluster CA, as the fleet recipe of docs/operations.md runs) and off, in
alternating rounds on the same machine in one run.

    python -m bench.curve              # 1, 16 and 256 MiB pushes, 3 rounds
    python -m bench.curve --rounds 5

CurveZMQ encrypts every byte (XSalsa20-Poly1305, in ZeroMQ's I/O thread), so the cost grows with
the bytes moved; the table gives GB/s each way, the ratio, and CPU seconds per GB of both daemons.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvd.testing.daemons import DaemonFactory, free_port, wait_ready
from kvd.trust.keygen import keygen_ca, keygen_node

from .cases import push
from .measure import human, pooled

SIZES = [1 << 20, 16 << 20, 256 << 20]


def repeats_for(nbytes: int) -> int:
    return 5 if nbytes >= 256 << 20 else 10 if nbytes >= 16 << 20 else 40


def pair(factory: DaemonFactory, keys: Path | None, tag: str):
    """A pushing daemon A and a receiving B; with keys, both admitted by one cluster CA."""
    port_a, port_b = free_port(), free_port()
    extra = {}
    for name in ("A", "B"):
        extra[name] = ["--pool-size", "1GiB"]
        if keys is not None:
            extra[name] += ["--curve-secret-key", str(keys / f"{name}.key_secret"), "--curve-ca", str(keys / "ca.key"),
                            "--curve-allow", str(keys)]  # (B.key / B.cert: the key to dial static peer B by)
    a = factory.start("A", port=port_a, peers={"B": f"tcp://127.0.0.1:{port_b}"}, wait=False, extra=extra["A"])
    b = factory.start("B", port=port_b, peers={"A": f"tcp://127.0.0.1:{port_a}"}, wait=False, extra=extra["B"])
    wait_ready(a)
    wait_ready(b)
    if keys is not None and "CURVE on" not in a.log():
        raise SystemExit(f"the {tag} pair did not start with CURVE on")
    return a, b


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.curve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each size (default: 3)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        keys = Path(workdir) / "keys"
        keygen_ca(str(keys))
        for name in ("A", "B"):
            keygen_node(str(keys), name, ca_secret=str(keys / "ca.key_secret"))
        factory = DaemonFactory(Path(workdir), log_level="info")  # (the ready line says CURVE is on)
        try:
            plain, curve = pair(factory, None, "plain"), pair(factory, keys, "CURVE")
            samples: dict[tuple[str, int], list] = {}
            for round_ in range(args.rounds):
                for size in SIZES:
                    for mode, (a, b) in (("off", plain), ("on", curve)) if round_ % 2 == 0 else \
                            (("on", curve), ("off", plain)):
                        print(f"round {round_ + 1}/{args.rounds}: {human(size)} push, CURVE {mode}", flush=True)
                        samples.setdefault((mode, size), []).append(push(a, b, size, repeats_for(size)))
        finally:
            factory.stop_all()
    print(f"\nCURVE's cost, {args.rounds} alternating rounds ({time.strftime('%Y-%m-%d %H:%M')}):\n")
    print("| push | CURVE off GB/s | CURVE on GB/s | on / off | CPU s/GB off | CPU s/GB on |")
    print("|---|---|---|---|---|---|")
    for size in SIZES:
        off, on = pooled(samples[("off", size)]), pooled(samples[("on", size)])
        rate = {mode: size / s.median / 1e9 for mode, s in (("off", off), ("on", on))}
        spread = {mode: [size / statistics.median(x.seconds) / 1e9 for x in samples[(mode, size)]]
                  for mode in ("off", "on")}
        print(f"| {human(size)} | {rate['off']:.2f} ({min(spread['off']):.2f}-{max(spread['off']):.2f}) "
              f"| {rate['on']:.2f} ({min(spread['on']):.2f}-{max(spread['on']):.2f}) | {rate['on'] / rate['off']:.2f}x "
              f"| {off.cpu_per_run / (size / 1e9):.2f} | {on.cpu_per_run / (size / 1e9):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

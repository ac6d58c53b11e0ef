"""The `kvd` command's client commands (kvd.cli; a small client process of the daemon): status, ls, rm,
cluster ls and cluster locate, one request each over the bare connection (no torch, no pool
mapping). One function per command, found by name in `COMMANDS`; each prints for people, or JSON
with --json, and returns the exit status."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from kvd.errors import KvdError
from kvd.units import format_size
from kvd.wire import protocol as p

from .connection import ask


def _pairs(values: dict[str, Any]) -> str:
    """{'puts': 3, 'sent_bytes': 4096} -> 'puts 3, sent 4.0KiB': a status line for people, not a repr."""
    shown = []
    for key, value in values.items():
        if key.endswith("_bytes") and isinstance(value, int):
            key, value = key.removesuffix("_bytes"), format_size(value)
        shown.append(f"{key} {value}")
    return ", ".join(shown) or "none"


def status(args: argparse.Namespace) -> int:
    stats = ask(p.Stats(req=1), args.socket)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    pool = stats["pool"]
    print(f"node       {stats['node_id']}  (device {stats['device']}, up {stats['uptime_s']:.0f}s)")
    print(f"pool       {format_size(pool['used_bytes'])} used of {format_size(pool['capacity_bytes'])}"
          f" ({100 * pool['used_bytes'] / max(1, pool['capacity_bytes']):.1f}%),"
          f" {format_size(pool['scratch_bytes'])} lent to clients for their next put,"
          f" {format_size(pool['parked_bytes'])} parked (removed; a client or ZeroMQ may still touch it)")
    print(f"entries    {stats['entries']}  ({_pairs(stats['entries_by_state'])})")
    print(f"transfers  {stats['transfers_in_flight']} in flight")
    print(f"clients    {stats['local_clients']} connected (this one included)")
    print(f"listen     {stats['listen']}")
    for name, peer in sorted(stats["peers"].items()):
        state = "connected" if peer["connected"] else "not connected"
        if peer.get("not_linked"):  # (configured, but it cannot even be dialled)
            state = f"not linked: {peer['not_linked']}"
        print(f"peer       {name} {peer['endpoint']} {state}")
    print(f"metrics    {stats['metrics'] or 'off'}")
    if registry := stats.get("registry"):
        _print_registry(registry)
    if cache := stats.get("cache"):
        _print_tier(cache)
    if plane := stats.get("plane"):
        _print_plane(plane)
    print(f"counters   {_pairs(stats['counters'])}")
    for error in stats["recent_errors"][-5:]:
        when = time.strftime("%H:%M:%S", time.localtime(error["time"]))
        print(f"error      {when} {error['request']} {error['request_id'] or ''}: {error['message']}")
    if getattr(args, "debug", False):
        _print_failed_transfers(stats.get("recent_failed_transfers", []))
    return 0


def _print_failed_transfers(failed: list[dict[str, Any]]) -> None:
    """The stories of the last failed transfers: what the transfer machine did, step by step."""
    if not failed:
        print("failed     no transfer failed recently")
    for transfer in failed:
        print(f"failed     transfer {transfer['xfer']}, its story (oldest first):")
        for line in transfer["story"]:
            print(f"         {line}")


def _print_registry(registry: dict[str, Any]) -> None:
    print(f"registry   {registry['url']} {registry['state']} ("
          f"{'up' if registry['up'] else 'unreachable'}, {registry['nodes']} nodes seen, "
          f"{registry['listed']} entries listed"
          f"{', records signed and verified' if registry.get('signed') else ''})")
    if registry.get("last_error") and not registry["up"]:
        print(f"           last error: {registry['last_error']}")
    if registry.get("dropped"):
        print(f"           records dropped: {_pairs(registry['dropped'])}")


def _print_tier(cache: dict[str, Any]) -> None:
    print(f"kv tier    {cache['entries']} pages, {format_size(cache['bytes'])} in "
          f"{format_size(cache['used_bytes'])} of {format_size(cache['budget'])} budget; "
          f"{cache['hits']} hits, {cache['misses']} misses, {cache['evictions']} evictions, "
          f"{cache['refused']} refused, {cache['namespaces']} namespaces")
    for medium, m in (cache.get("media") or {}).items():
        print(f"  {medium:<8} {m['pages']} pages, {format_size(m['bytes'])} in "
              f"{format_size(m['used_bytes'])} of {format_size(m['budget'])}; {m['hits']} hits, "
              f"{m['misses']} misses, "
              f"{m['evictions']} evictions, {m['corrupt']} corrupt dropped" + (
                  f"; read {m['read']['mean_ms']} ms (p99 {m['read']['p99_ms']}), write "
                  f"{m['write']['mean_ms']} ms (p99 {m['write']['p99_ms']}) a page; {m['refused']} "
                  f"refused; {m['dir']}" if medium == "disk" else ""))


def _print_plane(plane: dict[str, Any]) -> None:
    peers = ", ".join(plane["peers"]) or "none yet"
    print(f"data plane {plane['plane']} ({plane['mode']}), agent {plane['agent']}, {plane['memory']} pool "
          f"registered; peers {peers}; operations {plane['posted']} posted, {plane['done']} done, "
          f"{plane['failed']} failed, {plane['ops_running']} running")
    if plane["parked"] or plane["draining"]:
        held = ", ".join(f"{agent} {format_size(p['parked_bytes'])} in {p['parked']}"
                         for agent, p in plane["parked_by_peer"].items())
        print(f"           held for peers' planes: {held or 'none'}; {plane['draining']} waiting for "
              "our own operations to end")


def ls(args: argparse.Namespace) -> int:
    entries: list[dict[str, Any]] = []
    after = None
    while True:  # a page at a time
        page = ask(p.ListEntries(req=1, after=after, limit=p.LIST_PAGE), args.socket)
        entries += page
        if (after := p.next_page_after(page, after)) is None:
            break
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    print(f"{'REQUEST ID':40} {'STATE':10} {'BYTES':>10} {'TENSORS':>7} {'AGE':>8}")
    for e in entries:
        print(f"{e['request_id']:40} {e['state']:10} {format_size(e['bytes']):>10} "
              f"{e['tensors']:>7} {e['age_s']:>7.1f}s")
    cache = ask(p.Stats(req=1), args.socket).get("cache")
    if cache:  # the tier's pages are many and small: by namespace, not one by one
        print(f"kv tier: {cache['entries']} pages, {format_size(cache['bytes'])} "
              f"(budget {format_size(cache['budget'])})")
        for namespace, counts in cache["top_namespaces"].items():
            if counts["entries"]:
                print(f"  namespace {namespace!r}: {counts['entries']} pages, {format_size(counts['bytes'])}")
    return 0


def cluster_ls(args: argparse.Namespace) -> int:
    nodes = ask(p.ClusterNodes(req=1), args.socket)
    if args.json:
        print(json.dumps(nodes, indent=2))
        return 0
    registry = ask(p.Stats(req=1), args.socket).get("registry") or {}
    if not registry.get("up", True):
        print(f"(the registry {registry.get('url')} is unreachable: these are the nodes this daemon saw "
              f"last; {registry.get('last_error') or ''})", file=sys.stderr)
    print(f"{'NODE':24} {'ROLE':8} {'ENDPOINT':28} {'POOL':>9}  LABELS")
    for n in nodes:
        labels = ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items()))
        print(f"{n['node_id']:24} {n['role']:8} {n['endpoint']:28} {format_size(n['pool_bytes']):>9}  {labels}")
    return 0


def cluster_locate(args: argparse.Namespace) -> int:
    holders = ask(p.ClusterLocate(req=1, request_id=args.request_id), args.socket)
    if args.json:
        print(json.dumps(holders, indent=2))
    for h in [] if args.json else holders:
        print(f"{h['node_id']:24} {h['endpoint']:28} {format_size(h['bytes']):>9} {h['state']}")
    if not holders and not args.json:
        print(f"no holder of {args.request_id} in the cluster registry", file=sys.stderr)
    return 0 if holders else 1


def rm(args: argparse.Namespace) -> int:
    removed = bool(ask(p.Delete(req=1, request_id=args.request_id), args.socket))
    if args.json:
        print(json.dumps({"removed": removed}))
    else:
        print(f"removed {args.request_id}" if removed else f"{args.request_id}: not found")
    return 0 if removed else 1


# by the name the command line gives ("cluster ls": the command and its cluster subcommand)
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "status": status, "ls": ls, "rm": rm, "cluster ls": cluster_ls, "cluster locate": cluster_locate,
}


def client_command(args: argparse.Namespace) -> int:
    """Run the client command args name; a daemon's error is printed, exit status 1."""
    name = " ".join(filter(None, (args.command, getattr(args, "cluster_command", None))))
    try:
        return COMMANDS[name](args)
    except KvdError as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 1

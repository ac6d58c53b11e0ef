"""The `kvd` command: serve (runs the daemon process), status, ls, rm (small clients of it), keygen."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .daemon.config import (
    FIELD_NAMES,
    config_default,
    load_config,
    parse_labels,
    parse_peers,
    shown_default,
    unknown_variables,
)

if TYPE_CHECKING:  # (not subscriptable at run time)
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]  # what add_subparsers returns
PRECEDENCE = "Precedence: command-line flags > KVD_* environment variables > --config file > defaults."


def _serve_parser(sub: Subparsers) -> argparse.ArgumentParser:
    serve = sub.add_parser(
        "serve", help="run the daemon",
        description="Run the kvd daemon. Every option can also be set in the TOML config file "
                    "(same name, underscores) or as KVD_<NAME> in the environment. " + PRECEDENCE,
    )
    add = serve.add_argument
    add("--config", metavar="FILE", help="TOML config file (env: KVD_CONFIG)")
    add("--node-id", help="this node's name, as peers know it (default: hostname)")
    add("--listen", metavar="tcp://HOST:PORT",
        help="peer-facing endpoint, loopback unless you say")
    add("--socket", metavar="ENDPOINT",
        help="endpoint for local clients: unix:///ABSOLUTE/PATH (ipc:// is the same) or tcp://HOST:PORT "
             "(default: unix://$KVD_RUNTIME_DIR/kvd.sock, else unix://$XDG_RUNTIME_DIR/kvd/kvd.sock, else "
             "unix:///tmp/kvd-$UID/kvd.sock; env KVD_SOCKET)")
    add("--pool-size", metavar="SIZE", help="staging pool size, e.g. 512MiB, 4GiB")
    add("--block-size", metavar="SIZE", help="pool block size, a power of two")
    add("--pool-path", metavar="FILE",
        help="back the host pool with this file (on a tmpfs) instead of an anonymous memfd")
    add("--no-prefault", dest="pool_prefault", action="store_const", const=False,
        help="do not allocate the pool's pages at start")
    add("--pool-overcommit", action="store_const", const=True,
        help="start even when the pool is bigger than the RAM available (the host's OOM killer may strike)")
    add("--device", metavar="cpu|cuda:N", help="where the pool lives")
    add("--peer", dest="peers", action="append", metavar="NAME=ENDPOINT",
        help="a peer daemon, e.g. B=tcp://10.0.0.2:7470 (repeatable)")
    add("--default-ttl", metavar="DURATION", help="drop unread entries after this long; 0 = never")
    add("--lease-timeout", metavar="DURATION",
        help="a client must finish copying a put or get within this")
    add("--transfer-timeout", metavar="DURATION",
        help="fail a peer transfer after this long without progress")
    add("--connect-timeout", metavar="DURATION", help="peer handshake deadline")
    add("--heartbeat-interval", metavar="DURATION", help="how often peers are pinged")
    add("--heartbeat-timeout", metavar="DURATION",
        help="a peer silent this long is lost and its transfers fail")
    add("--drain-timeout", metavar="DURATION",
        help="on SIGTERM, in-flight transfers get this long to finish")
    add("--scratch-max", metavar="SIZE",
        help="puts up to this size take one round trip: blocks are lent to each client ahead of "
             "its next put; 0 = off")
    add("--chunk-size", metavar="SIZE", help="network chunk size")
    add("--window", type=int, help="chunks in flight per transfer")
    add("--io-threads", type=int, help="ZeroMQ I/O threads; raise on many cores and fast NICs")
    add("--data-plane", choices=["auto", "zmq", "nixl"],
        help="how transfers' bytes move: zmq (chunk frames on the peer connections), nixl (NIXL's one-sided "
             "writes and reads: RDMA, NVLink, shared memory, TCP; refuses peers without it), auto (NIXL where "
             "both ends have it)")
    add("--checksum", choices=["xxh3_64", "crc32", "blake3_64", "none"],
        help="per-chunk checksum (blake3_64: cryptographic, what a one-sided plane uses off loopback)")
    add("--log-level", choices=["debug", "info", "warning", "error"], help="")
    add("--log-format", choices=["text", "json"], help="")
    add("--metrics-port", type=int, help="Prometheus /metrics port; 0 = off")
    add("--metrics-host", help="address the metrics server binds")
    add("--curve-secret-key", metavar="FILE",
        help="authenticate and encrypt peer traffic with this CURVE key pair (a .key_secret file from "
             "`kvd keygen`); needs --curve-allow")
    add("--curve-ca", metavar="FILE",
        help="the cluster CA's public key (ca.key from `kvd keygen --ca`): admit any peer whose cert it signed "
             "for the node id it claims; needs --curve-secret-key from `kvd keygen NODE --ca-secret ...`")
    add("--curve-cert", metavar="FILE",
        help="this node's cert from `kvd keygen NODE --ca-secret ...` (default: NODE.cert beside "
             "--curve-secret-key)")
    add("--curve-deny", metavar="FILE",
        help="revoked CURVE public keys (Z85, one a line, # comments), re-read on SIGHUP: their connections "
             "are cut at once")
    add("--insecure", action="store_const", const=True,
        help="allow a --listen or a tcp:// --socket beyond loopback without authentication (any host that "
             "reaches it can read and inject caches)")
    add("--max-clients", type=int, help="local client connections served at once")
    add("--max-peer-connections", type=int, help="peer connections to --listen at once")
    add("--max-entries", type=int, help="entries held at once; past it a put gets PoolFull")
    add("--cache-size", metavar="SIZE|FRACTION",
        help="the KV tier's budget: a size with its unit (2GiB) or a fraction of the pool (0.5); 0 = off. Its "
             "pages are evicted LRU past it, or when a handoff needs the room")
    add("--cache-max-pages", type=int, metavar="N",
        help="pages the KV tier holds at most (each costs ~1 KB of daemon memory beside its blocks)")
    add("--cache-namespace-pages", type=int, metavar="N",
        help="pages one namespace may hold; past it, its own least recently used go first (0: no cap of its own)")
    add("--cache-dir", metavar="DIR",
        help="the KV tier's disk level: pages go there from RAM, come back checked, and survive a restart (a "
             "directory of this user's alone, empty or a kvd tier's; needs --cache-disk-size)")
    add("--cache-disk-size", metavar="SIZE",
        help="the disk level's budget, a hard cap on its files (e.g. 100GiB); the least recently used go past it")
    add("--registry", metavar="URL",
        help="cluster registry: etcd[s]://[USER:PASS@]HOST:PORT[,HOST:PORT...] or "
             "redis[s]://[USER:PASS@]HOST:PORT[/DB] (default: none, static peers only)")
    add("--registry-password-file", metavar="FILE",
        help="the registry password (its first line), instead of one in the URL (USER from the URL)")
    add("--registry-ca", metavar="FILE", help="CA bundle for the registry's TLS certificate (etcds://, rediss://)")
    add("--registry-cert", metavar="FILE", help="client certificate for mutual TLS with the registry")
    add("--registry-key", metavar="FILE", help="the private key of --registry-cert")
    add("--cluster", metavar="NAME", help="scopes every registry key")
    add("--advertise", metavar="tcp://HOST:PORT",
        help="the endpoint peers dial, as published in the registry (default: --listen, which must then not "
             "be a wildcard address)")
    add("--registry-ttl", metavar="DURATION", help="a dead node leaves the registry within ~2x this")
    add("--registry-publish", choices=["pullable", "all", "none"],
        help="which entries the holder directory lists (pullable: local puts with no destination)")
    add("--role", choices=["prefill", "decode", "any"], help="how routers see this node")
    add("--label", dest="labels", action="append", metavar="KEY=VALUE",
        help="a label published with the node, e.g. zone=us-east-1a (repeatable)")
    add("--curve-allow", action="append", metavar="KEY|FILE|DIR",
        help="public keys allowed to connect (repeatable): a .key file, a directory of them, or a Z85 "
             "key; a file named PEER.key also gives the key used to dial peer PEER")
    show_defaults(serve)
    return serve


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """End each option's help with its Config default, written only in Config. (The parser's own
    defaults stay None: "not given", so that the env and the config file can still set them.)"""
    for action in parser._actions:
        shown = shown_default(action.dest) if action.dest in FIELD_NAMES else None
        if shown is not None:
            action.help = f"{action.help} (default: {shown})" if action.help else f"(default: {shown})"


def _client_parser(sub: Subparsers, name: str, help_text: str) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_text, description=help_text)
    parser.add_argument("--socket", metavar="ENDPOINT", help="daemon's client endpoint (default as for serve)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


class _Parser(argparse.ArgumentParser):
    # "status", "cluster ls", ...: each command's own parser, for its errors
    commands: dict[str, argparse.ArgumentParser]


def build_parser() -> _Parser:
    parser = _Parser(
        prog="kvd", description="kvd: KV-cache transfer daemon for disaggregated LLM inference.",
        epilog="Run `kvd serve --help` for the daemon's options. " + PRECEDENCE,
    )
    sub: Subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=argparse.ArgumentParser)
    commands = parser.commands = {}
    commands["serve"] = _serve_parser(sub)
    status = commands["status"] = _client_parser(sub, "status", "summary of a running daemon: pool, entries, peers")
    status.add_argument("--debug", action="store_true",
                        help="also the last failed transfers' stories (what the transfer machine did, step by step)")
    commands["ls"] = _client_parser(sub, "ls", "list the entries a running daemon holds")
    rm = commands["rm"] = _client_parser(sub, "rm", "delete an entry from a running daemon")
    rm.add_argument("request_id")
    cluster = sub.add_parser("cluster", help="the cluster registry, as a running daemon sees it",
                             description="The cluster registry, as the local daemon (started with --registry) sees it.")
    cluster_sub = cluster.add_subparsers(dest="cluster_command", metavar="COMMAND", required=True)
    for name, help_text in (("ls", "the nodes of the cluster"), ("locate", "which nodes hold a request (a hint)")):
        command = commands[f"cluster {name}"] = cluster_sub.add_parser(name, help=help_text, description=help_text)
        command.add_argument("--socket", metavar="ENDPOINT", help="daemon's client endpoint (default as for serve)")
        command.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "locate":
            command.add_argument("request_id")
    keygen = commands["keygen"] = sub.add_parser(
        "keygen", help="write a cluster CA, or a node's CURVE key pair (and its cert)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write NAME.key (public) and NAME.key_secret (0600: this daemon's --curve-secret-key).\n"
                    "With a cluster CA, every node admits every other without allow-lists:\n\n"
                    "  kvd keygen --ca --dir D                                # D/ca.key, D/ca.key_secret (0600)\n"
                    "  kvd keygen NODE --dir D --ca-secret D/ca.key_secret    # D/NODE.key, .key_secret, .cert\n"
                    "  kvd serve --curve-secret-key D/NODE.key_secret --curve-ca D/ca.key ...\n\n"
                    "Static --peer nodes are dialled by the certs beside NODE's own (D/PEER.cert): across hosts,\n"
                    "copy every NODE.cert into each node's D. The second command run again renews NODE's cert and\n"
                    "keeps its key pair. Without --ca-secret, an existing pair is kept (the peers allow its public\n"
                    "key) unless --force.")
    keygen.add_argument("name", nargs="?", help="the node id (the cert is valid for this id only)")
    keygen.add_argument("--ca", action="store_true", help="write a new cluster CA (ca.key, ca.key_secret) instead")
    keygen.add_argument("--dir", default=".", help="where to write the files (default: .)")
    keygen.add_argument("--ca-secret", metavar="FILE", help="sign NAME.cert with this CA (its ca.key_secret)")
    keygen.add_argument("--cluster", default=config_default("cluster"),
                        help="the cluster the cert is for, as kvd serve --cluster (default: %(default)s)")
    keygen.add_argument("--valid-for", metavar="DURATION", default="30d",
                        help="how long the cert admits its node (default: 30d); renew before it runs out")
    keygen.add_argument("--force", action="store_true",
                        help="replace an existing pair or CA (whatever trusted the old one will refuse the new)")
    keygen.add_argument("--if-missing", action="store_true",
                        help="for scripts: keep an existing CA, or an existing pair (without --ca-secret), and exit "
                             "0, where kvd keygen refuses to overwrite it (exit 1)")
    return parser


def forbid_unpickling(event: str, args: tuple[Any, ...]) -> None:
    """Audit hook for the daemon: loading a pickled object is how ZeroMQ KV transports were taken
    over (vLLM CVE-2025-29783 and kin). kvd never unpickles; if anything tries, stop it."""
    if event == "pickle.find_class":
        raise RuntimeError(f"kvd refuses to unpickle {args[0]}.{args[1]}: no pickle in this process")


def serve(args: argparse.Namespace) -> int:
    import uvloop

    sys.addaudithook(forbid_unpickling)

    from .daemon.daemon import Daemon
    from .daemon.logs import setup_logging

    cli = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    try:
        if cli.get("peers"):
            cli["peers"] = parse_peers(cli["peers"])
        if cli.get("labels"):
            cli["labels"] = parse_labels(cli["labels"])
        config = load_config(cli, config_file=args.config)
    except (ValueError, OSError) as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level, config.log_format)
    import logging

    for warning in unknown_variables():  # (a misspelt KVD_* variable would be ignored without a word)
        logging.getLogger("kvd").warning("%s", warning)
    logging.getLogger("kvd").info("starting with configuration %s", json.dumps(config.public()))
    daemon = Daemon(config, reload_config=lambda: load_config(cli, config_file=args.config))
    try:
        uvloop.run(daemon.run())
    except Exception as exc:
        import zmq

        from .errors import KvdError

        if isinstance(exc, (KvdError, OSError, zmq.ZMQError)):
            logging.getLogger("kvd").error("cannot start: %s", exc)
            return 1
        raise
    return 0


def keygen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .errors import KvdError
    from .trust.keygen import keygen_ca, keygen_node
    from .units import parse_duration

    if args.ca == bool(args.name):
        parser.error("keygen: give a node NAME, or --ca for a cluster CA")
    if args.if_missing and args.force:
        parser.error("keygen: --if-missing keeps what is there, --force replaces it: give one")
    try:
        if args.ca:
            made = keygen_ca(args.dir, force=args.force, if_missing=args.if_missing)
            kept = " (already there: kept, --if-missing)" if made.kept else ""
            print(f"CA public key: {made.public}{kept} (every node's --curve-ca)\n"
                  f"CA secret key: {made.secret}{kept} (keep it off the nodes: it admits nodes to the cluster)")
            return 0
        made = keygen_node(args.dir, args.name, force=args.force, ca_secret=args.ca_secret, cluster=args.cluster,
                           valid_for=parse_duration(args.valid_for), if_missing=args.if_missing)
    except (KvdError, OSError, ValueError) as exc:
        print(f"kvd: {exc}", file=sys.stderr)
        return 1
    kept = " (already there: kept, --if-missing)" if made.kept else ""
    print(f"public key: {made.public}{kept}\nsecret key: {made.secret}{kept} (keep it private)")
    if made.cert:
        print(f"cert:       {made.cert} ({'renewed for the same key pair' if made.renewed else 'new'}, "
              f"node {args.name} of cluster {args.cluster}, valid for {args.valid_for})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # here, not at exit, where a failure could only be printed as a traceback
    except BrokenPipeError:  # `kvd status --json | head`: the reader left early, which is not our error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (what is still buffered goes nowhere)
        return 1


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its own usage (argparse would print the top-level one)
        name = " ".join(filter(None, (args.command, getattr(args, "cluster_command", None))))
        parser.commands.get(name, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "serve":
        return serve(args)
    if args.command == "keygen":
        return keygen(parser, args)
    from .client.commands import client_command  # (status, ls, ...: no daemon modules imported)

    return client_command(args)

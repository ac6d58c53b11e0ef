"""The local client socket's file (daemon process): making room for it safely before the bind.

A unix socket path is claimed before anything binds: a live daemon's socket is refused (a
second daemon stops here), a stale one is removed, and its directory must be ours and writable
by nobody else, or another user could swap the socket for one of theirs.
"""
from __future__ import annotations

import os
import socket
import stat

from kvd.errors import BadRequest
from kvd.wire.endpoints import unix_path


def claim_socket_path(endpoint: str, made: list[str]) -> None:
    """Make room for the client socket file: refuse a live daemon's, remove a stale one. The
    directories made here go into `made`, innermost first, even when it then refuses (a failed
    start takes them away again)."""
    path = unix_path(endpoint)
    if path is None:
        return
    directory = os.path.dirname(path) or "."
    missing = []
    parent = directory
    while parent and not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        not_a_dir = f" ({exc.filename} is not a directory)" if exc.errno in (17, 20) and exc.filename else ""
        raise BadRequest(f"cannot make the socket directory {directory} for {endpoint}: {exc.strerror}"
                         f"{not_a_dir}") from None
    made.extend(missing)
    check_runtime_dir(directory)
    if os.path.lexists(path):
        if socket_in_use(path):
            raise BadRequest(f"{endpoint} is in use by another daemon")
        owner = os.lstat(path).st_uid
        if owner not in (os.getuid(), 0):
            raise BadRequest(f"{path} exists and belongs to uid {owner}: not this daemon's to replace (choose "
                             "another --socket)")
        os.unlink(path)  # stale socket of a daemon that did not exit cleanly


def check_runtime_dir(directory: str) -> None:
    """The client socket's directory must be ours (or root's) and writable by nobody else: another
    user who made it first (e.g. /tmp/kvd-UID, mode 0777) could swap the socket for one of theirs."""
    info = os.lstat(directory)
    if stat.S_ISLNK(info.st_mode):
        raise BadRequest(f"the socket directory {directory} is a symbolic link: refusing it (remove it, or give "
                         "--socket a path in a directory of this user's)")
    problems = []
    if info.st_uid not in (os.getuid(), 0):
        problems.append(f"owned by uid {info.st_uid}, not by this daemon's uid {os.getuid()}")
    # a root-owned sticky directory (/tmp) is fine: others may add files, never move or remove ours,
    # and a name they took first is refused below (in use) or cannot be unlinked
    sticky_root = info.st_uid == 0 and info.st_mode & stat.S_ISVTX
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky_root:
        problems.append(f"writable by {'others' if info.st_mode & stat.S_IWOTH else 'its group'} "
                        f"(mode {stat.S_IMODE(info.st_mode):o})")
    if problems:
        raise BadRequest(f"refusing the socket directory {directory}: {' and '.join(problems)}; another user could "
                         f"replace the daemon's socket there. Remove it (or chmod 700 it, if it is yours), or set "
                         f"KVD_RUNTIME_DIR / --socket to a directory of this user's: one beneath it that kvd makes "
                         f"itself will do (e.g. {os.path.join(directory, 'kvd')}; a Kubernetes emptyDir is 0777)")


def socket_in_use(path: str) -> bool:
    """True if something accepts connections on this unix socket path."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()

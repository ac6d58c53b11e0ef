"""kvd.daemon.startup: a part that fails to build closes the parts made before it (real parts, in
this process: the pool's memfd, the --cache-dir claim, the socket directory)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvd.daemon.config import Config
from kvd.daemon.daemon import Daemon
from kvd.daemon.tier.disk.level import claim_disk
from kvd.errors import BadRequest
from kvd.testing.daemons import free_port
from kvd.wire import protocol as p


def config(workdir: Path, **extra: object) -> Config:
    return Config(node_id="A", listen=f"tcp://127.0.0.1:{free_port()}", socket=f"unix://{workdir}/run/kvd.sock",
                  pool_size=1 << 20, block_size=4096, chunk_size=1 << 16, pool_prefault=False, pool_overcommit=True,
                  metrics_port=0, log_level="warning", cache_dir=str(workdir / "tier"), cache_disk_size=1 << 20,
                  **extra)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_part_that_fails_to_build_closes_what_was_made_before_it(tmp_path):
    # the registry's password file is missing: the directory fails after the --cache-dir claim, the
    # socket's directory and the pool's memory were made
    cfg = config(tmp_path, registry="etcd://127.0.0.1:1", registry_password_file=str(tmp_path / "missing"))
    before = open_fds()

    async def main() -> Daemon:
        daemon = Daemon(cfg)
        with pytest.raises(BadRequest, match="registry-password-file"):
            await daemon.start()
        assert daemon.parts is None
        await daemon.stop()
        return daemon

    asyncio.run(main())
    assert open_fds() <= before  # the memfd and the claim's lock closed again
    assert not (tmp_path / "run").exists()  # the socket's directory taken away (the daemon never served)
    claimed = claim_disk(cfg)  # the --cache-dir is free again (a second claim in this process would be refused)
    assert claimed is not None
    claimed.release()
    claimed.release()  # (once is enough: a second release does nothing)


def test_a_built_daemon_serves_and_its_parts_know_each_other_from_their_constructors(tmp_path):
    cfg = config(tmp_path)

    async def main() -> None:
        daemon = Daemon(cfg)
        try:
            await daemon.start()
            parts = daemon.parts
            assert parts is not None and daemon.lifecycle.ready
            assert parts.handlers.tier_routes[p.CacheGet].__self__ is parts.tier_service
            assert parts.tier_service.disk is parts.disk
            assert parts.status.snapshot()["listen"] == parts.router.bound_endpoint != ""
            assert parts.status.snapshot()["cache"]["media"]["disk"] is not None
        finally:
            await daemon.stop()

    asyncio.run(main())

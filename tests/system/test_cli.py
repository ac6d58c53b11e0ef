"""The kvd command line against a real daemon, and what ./dev test hands pytest."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

import kvd
from kvd.testing.daemons import free_port


def kvd_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True, timeout=60, env=env)


def test_help_explains_every_option():
    top = kvd_cli("--help")
    assert top.returncode == 0 and "serve" in top.stdout and "status" in top.stdout
    serve = kvd_cli("serve", "--help")
    assert serve.returncode == 0
    for flag in ("--config", "--node-id", "--listen", "--socket", "--pool-size", "--device", "--peer",
                 "--default-ttl", "--chunk-size", "--log-format", "--metrics-port"):
        assert flag in serve.stdout, flag
    assert "Precedence" in serve.stdout


def test_status_ls_rm(daemon):
    with daemon.client() as c:
        c.put("cli-1", {"x": torch.ones(1000)})
    status = kvd_cli("status", "--socket", daemon.socket)
    assert status.returncode == 0, status.stderr
    assert "node       A" in status.stdout and "entries    1" in status.stdout
    assert "connected (this one included)" in status.stdout
    data = json.loads(kvd_cli("status", "--socket", daemon.socket, "--json").stdout)
    assert data["entries"] == 1 and data["pool"]["used_bytes"] > 0
    listing = kvd_cli("ls", "--socket", daemon.socket)
    assert "cli-1" in listing.stdout and "ready" in listing.stdout
    entries = json.loads(kvd_cli("ls", "--socket", daemon.socket, "--json").stdout)
    assert entries[0]["request_id"] == "cli-1" and entries[0]["bytes"] == 4000
    assert kvd_cli("rm", "--socket", daemon.socket, "cli-1").returncode == 0
    missing = kvd_cli("rm", "--socket", daemon.socket, "cli-1")
    assert missing.returncode == 1 and "not found" in missing.stdout
    assert json.loads(kvd_cli("status", "--socket", daemon.socket, "--json").stdout)["entries"] == 0


def test_status_debug_tells_the_story_of_a_failed_transfer(daemons):
    """A push to a peer that is not there fails; `kvd status --debug` shows what the transfer
    machine did with it, step by step (plain `kvd status` does not)."""
    a = daemons.start("A", peers={"B": f"tcp://127.0.0.1:{free_port()}"}, extra=["--transfer-timeout", "2s"])
    with a.client() as c, pytest.raises(kvd.KvdError):
        c.put("doomed", {"x": torch.ones(1000)}, dest="B")
    plain = kvd_cli("status", "--socket", a.socket)
    assert plain.returncode == 0 and "failed     transfer" not in plain.stdout
    debug = kvd_cli("status", "--socket", a.socket, "--debug")
    assert debug.returncode == 0, debug.stderr
    assert "failed     transfer" in debug.stdout and "start_push" in debug.stdout, debug.stdout
    assert "--> failed" in debug.stdout, debug.stdout
    data = json.loads(kvd_cli("status", "--socket", a.socket, "--json").stdout)
    assert len(data["recent_failed_transfers"]) == 1


def test_status_without_a_daemon_says_so(tmp_path):
    result = kvd_cli("status", "--socket", f"ipc://{tmp_path}/none.sock")
    assert result.returncode == 1 and "no kvd daemon" in result.stderr


def test_bad_configuration_is_refused_with_a_reason(tmp_path):
    result = kvd_cli("serve", "--pool-size", "lots", "--socket", f"ipc://{tmp_path}/x.sock")
    assert result.returncode == 2 and "not a size" in result.stderr
    bad_file = tmp_path / "bad.toml"
    bad_file.write_text('pool_sise = "1GiB"\n')
    result = kvd_cli("serve", "--config", str(bad_file))
    assert result.returncode == 2 and "pool_sise" in result.stderr


def test_config_file_env_and_flags_combine(daemons, tmp_path):
    port = free_port()
    config = tmp_path / "kvd.toml"
    config.write_text(f'node_id = "from-file"\npool_size = "32MiB"\nlisten = "tcp://127.0.0.1:{port}"\n')
    d = daemons.start("ignored", extra=["--config", str(config)], env={"KVD_POOL_SIZE": "48MiB"})
    # the fixture passes --node-id and --listen on the command line, which win over the file
    with d.client() as c:
        stats = c.stats()
    assert stats["node_id"] == "ignored"
    assert stats["pool"]["capacity_bytes"] == 64 << 20  # --pool-size flag beats env and file
    d2 = daemons.start("B", extra=["--config", str(config)], env={"KVD_DEFAULT_TTL": "5s"})
    assert '"default_ttl": 5.0' in d2.log()


def test_dev_test_adds_q_and_two_workers_only_when_not_asked_otherwise(tmp_path):
    # ./dev test always added -q: `./dev test -q` became -qq, which hides pytest's summary line.
    # A set-up venv whose python prints the arguments it gets, and a pip that must not run.
    root = pathlib.Path(__file__).resolve().parents[2]
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, body in (("python", 'printf "%s\\n" "$@"'), ("pip", 'echo "pip ran: $*" >&2; exit 1')):
        (venv / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    later = time.time() + 3600  # newer than pyproject.toml and requirements/: nothing to install
    for stamp in (".kvd-installed", ".kvd-nixl-installed", ".kvd-vllm-installed", ".kvd-sglang-installed"):
        (venv / stamp).touch()
        os.utime(venv / stamp, (later, later))
    base = {k: v for k, v in os.environ.items() if k != "KVD_TEST_WORKERS"}
    env = {**base, "KVD_VENV": str(venv), "KVD_ETCD_BIN": "/bin/true", "KVD_REDIS_BIN": "/bin/true"}

    def pytest_args(*args: str, **extra_env: str) -> list[str]:
        run = subprocess.run([str(root / "dev"), "test", *args], capture_output=True, text=True, timeout=60,
                             env={**env, **extra_env})
        assert run.returncode == 0, run.stderr
        lines = run.stdout.splitlines()
        assert lines[:2] == ["-m", "pytest"]
        return lines[2:]

    workers = ["-n", "2", "--dist", "loadfile"]  # pytest-xdist: the suite mostly waits
    assert pytest_args() == ["-q", *workers]
    assert pytest_args("-x", "tests/test_layering.py") == ["-q", *workers, "-x", "tests/test_layering.py"]
    assert pytest_args("-rs", "-k", "v") == ["-q", *workers, "-rs", "-k", "v"]  # -r takes a value; "v" is one
    for asked in (["-q"], ["-qq"], ["-v"], ["-vv", "-x"], ["-xq"], ["--quiet"], ["--verbose"], ["--verbosity=2"]):
        assert pytest_args(*asked) == [*workers, *asked]
    # the workers are theirs to choose, and a debugger or -s needs the tests in this process
    for asked in (["-n", "4"], ["-n0"], ["--numprocesses=3"], ["-p", "no:xdist"], ["--pdb"], ["-s"], ["-xs"],
                  ["--capture=no"]):
        assert pytest_args(*asked) == ["-q", *asked]
    assert pytest_args(KVD_TEST_WORKERS="0") == ["-q", "-n", "0", "--dist", "loadfile"]
    assert pytest_args("-v", KVD_TEST_WORKERS="3") == ["-n", "3", "--dist", "loadfile", "-v"]

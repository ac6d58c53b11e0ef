"""`python -m bench --peers` without the peer packages: results parsed into rows, failures as one line.

Nothing here installs a package or reaches the network: the peer environment's "python3" is a
fake that fails, and the peer scripts are stand-ins run with this interpreter.
"""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from bench import peers

KIB64, MIB = 64 << 10, 1 << 20


def fake_result(**extra) -> dict:
    return {"case": "Mooncake TCP, sync write", "engine": "mooncake", "version": "0.3.13.post1",
            "results": [{"size": KIB64, "seconds": [0.002, 0.001, 0.003], "cpu": [0.001, 0.001, 0.001],
                         "verified": True},
                        {"size": MIB, "seconds": [0.004], "cpu": [0.002], "verified": False}], **extra}


def test_the_json_a_peer_script_prints_becomes_rows_beside_raw_tcp_and_kvd():
    # the engines' C++ code may print on stdout too: the result is the last line that is JSON
    stdout = "I1202 tcp_transport.cpp:391] listen on port 15116\n" + json.dumps(fake_result()) + "\n"
    rows = peers.rows_from(peers.parse_result(stdout), raw_tcp={KIB64: 0.0005, MIB: 0.002},
                           kvd_push={KIB64: 0.004, MIB: 0.004})
    assert rows[0] == ("peer: Mooncake TCP, sync write", "64KiB", f"{KIB64 / 0.002 / 1e9:.2f}", "2.000",
                       f"{0.001 / (KIB64 / 1e9):.2f}",
                       "0.25x raw TCP, kvd push 2.00x as long, mooncake 0.3.13.post1")
    assert rows[1][1:4] == ("1MiB", f"{MIB / 0.004 / 1e9:.2f}", "4.000")
    assert rows[1][5].endswith("DATA NOT VERIFIED")


def test_an_engine_error_is_one_line_with_what_to_install():
    result = {"case": "Mooncake TCP, sync write", "error": "import mooncake.engine: libibverbs.so.1: cannot open",
              "install": "apt-get install -y libibverbs1"}
    line = peers.failure_line("Mooncake TCP, sync write", 1, peers.parse_result(json.dumps(result)), "")
    assert line == ("peers: Mooncake TCP, sync write skipped: import mooncake.engine: libibverbs.so.1: "
                    "cannot open; to fix: apt-get install -y libibverbs1")
    assert "exit -11" in peers.failure_line("NIXL UCX-TCP, write", -11, None, "Segmentation fault\n")
    assert peers.failure_line("x", 0, fake_result(), "") is None


def failing_python3(tmp_path: Path) -> str:
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found (no network)' >&2\nexit 1\n")
    fake.chmod(0o755)
    return str(fake)


def test_a_failed_install_prints_one_line_and_the_benchmark_gets_no_rows(tmp_path, capsys):
    venv = tmp_path / ".venv-peers"
    rows = peers.peer_rows({KIB64: 2}, {KIB64: 0.001}, {KIB64: 0.001}, venv=venv, python3=failing_python3(tmp_path))
    assert rows == []
    failures = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    assert len(failures) == 1
    assert "-m venv .venv-peers` failed (exit 1): ERROR: No matching distribution found (no network)" in failures[0]
    assert "PyPI" in failures[0] and "python3-venv" in failures[0]
    assert not (venv / peers.STAMP).exists()  # the next --peers run tries again


def test_a_complete_environment_is_not_rebuilt(tmp_path):
    venv = tmp_path / ".venv-peers"
    venv.mkdir()
    (venv / peers.STAMP).write_text(json.dumps(peers.INSTALL))
    assert peers.ensure_venv(venv, python3=failing_python3(tmp_path)) == venv / "bin" / "python"


def test_a_script_that_hangs_is_killed_and_reported(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""\
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # a target left behind
        print("not json", flush=True)
        time.sleep(60)
    """))
    code, out, err = peers.run_script(Path(sys.executable), script, [KIB64], [2], timeout=2)
    assert peers.failure_line("NIXL UCX-TCP, write", code, peers.parse_result(out), err) == (
        "peers: NIXL UCX-TCP, write skipped: exit -1 without a result (no result within 2s)")

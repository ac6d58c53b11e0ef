"""`kvd ... | head`: a reader that leaves before kvd has written all is no error of kvd's, and gets no
traceback (argparse's own help output already ignores it; kvd's print()s did not)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_into_a_closed_pipe(argv: list[str], unbuffered: bool) -> subprocess.CompletedProcess:
    read, write = os.pipe()
    os.close(read)  # nobody reads: every write to the pipe fails (EPIPE)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    try:
        return subprocess.run([sys.executable, "-m", "kvd", *argv], stdout=write, stderr=subprocess.PIPE,
                              env=env, timeout=60)
    finally:
        os.close(write)


@pytest.mark.parametrize("unbuffered", [False, True], ids=["buffered", "unbuffered"])  # fails at exit / at print
def test_a_reader_that_left_gets_no_traceback(tmp_path, unbuffered):
    proc = run_into_a_closed_pipe(["keygen", "A", "--dir", str(tmp_path)], unbuffered)
    assert proc.stderr == b"", proc.stderr.decode()
    assert proc.returncode == 1  # what it printed did not arrive
    assert (tmp_path / "A.key").is_file() and (tmp_path / "A.key_secret").is_file()  # what it did, it did


def test_a_reader_that_stays_gets_everything(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvd", "keygen", "A", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "public key:" in proc.stdout and proc.stderr == ""

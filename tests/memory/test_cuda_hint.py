"""The one install hint for the CUDA pool's cupy: the build for torch's CUDA major."""
from __future__ import annotations

import pytest

from kvd.memory.cuda import cupy_hint


@pytest.mark.parametrize("cuda, wanted", [
    ("12.8", "pip install '.[cuda]' from kvd's checkout ('kvd-daemon[cuda]'), i.e. cupy-cuda12x"),
    ("13.0", "pip install cupy-cuda13x (torch is built for CUDA 13.0; the cuda extra's cupy-cuda12x is for CUDA 12)"),
    (None, "i.e. cupy-cuda12x"),  # a CPU torch: the extra, as the docs say
])
def test_the_hint_names_the_cupy_for_torchs_cuda(cuda, wanted):
    assert wanted in cupy_hint(cuda)


def test_the_extra_is_the_cuda_12_build():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert extras["optional-dependencies"]["cuda"][0].startswith("cupy-cuda12x")

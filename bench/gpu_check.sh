#!/usr/bin/env bash
# One prepared GPU check for a machine with a CUDA GPU: the CUDA tests and the GPU benchmark.
# Needs a Python with CUDA-enabled torch and cupy-cuda12x (PYTHON=..., default python3) and
# kvd importable (pip install -e '.[cuda,test]'). Results land in $OUT (default ./gpu-results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, cupy; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'cupy', cupy.__version__)"
timeout 300 "$PY" -m pytest tests/test_cuda.py -m cuda -q -p no:cacheprovider -o addopts="" 2>&1 | tee "$OUT/cuda-tests.log"
timeout 240 "$PY" -m bench.gpu --output "$OUT/gpu-bench.md" 2>&1 | tail -20

#!/usr/bin/env bash
# One prepared GPU check for a machine with a CUDA GPU: the CUDA tests, the GPU benchmark and,
# where the machine has cores to spare, the CPU benchmark beside them. Device time is scarce, so
# each step has its own time limit and a failing step does not stop the next.
#
# Needs a Python with CUDA-enabled torch and cupy (cupy-cuda12x or -cuda13x; PYTHON=..., default
# python3), NIXL for the plane step (nixl-cu12/-cu13), and kvd importable: pip install -e
# '.[cuda,nixl,test]', or its dependencies installed and
# the checkout on PYTHONPATH. Results land in $OUT (default ./gpu-results).
#   CPU_BENCH=0    skip the CPU benchmark
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./gpu-results}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    echo "cores: $(nproc)"
    "$PY" -c "import sys, torch, cupy, zmq; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, torch.cuda.is_available(), 'cupy', cupy.__version__, 'pyzmq', zmq.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, log it whole, say how it ended
    local name=$1 limit=$2 t0=$SECONDS
    shift 2
    echo "=== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t0))s" | tee -a "$OUT/gpu.txt"
}

rm -rf /tmp/kvd-cuda-tests
step cuda-tests "${CUDA_TESTS_S:-180}" "$PY" -m pytest tests/system/test_cuda.py -m cuda -v -rs -p no:cacheprovider \
    -o addopts="" --basetemp=/tmp/kvd-cuda-tests
# the tests' daemon logs, for a failure that the pytest output alone does not explain
find /tmp/kvd-cuda-tests -name '*.log' -print0 2>/dev/null | tar czf "$OUT/cuda-test-daemons.tgz" --null -T - 2>/dev/null
step gpu-bench "${GPU_BENCH_S:-180}" "$PY" -m bench.gpu --output "$OUT/gpu-bench.md"
# the NIXL plane between two VRAM pools (needs NIXL: pip install '.[nixl]'): GB/s against a d2d copy,
# and which UCX transports its protocol tables name (cuda_ipc, cuda_copy: GPU to GPU)
step gpu-plane "${GPU_PLANE_S:-120}" "$PY" -m bench.gpu_plane --output "$OUT/gpu-plane.md"
if [[ ${CPU_BENCH:-1} == 1 ]]; then
    step cpu-bench "${CPU_BENCH_S:-180}" "$PY" -m bench --output "$OUT/cpu-bench.md"
fi

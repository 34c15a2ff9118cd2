#!/usr/bin/env bash
# The GPU checks, in one run on a machine with a CUDA GPU (docs/gpu.md, "Measured"):
# the GPU-marked tests (NCCL at 1 rank, the staged path at 2 ranks sharing the GPU, the
# example on CUDA), the CUDA test of horovod.torch, then the GPU benchmark.
#   bash tests/gpu_checks.sh [OUTDIR]      (logs go to OUTDIR, default /tmp/gpu_checks)
# GPU_CHECKS_K=EXPR narrows the device plane's tests to pytest's -k EXPR.
set -u
out=${1:-${OUT:-/tmp/gpu_checks}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX shares the GPU with torch in one process
py=${PYTHON:-python3}
step() {  # step NAME SECONDS CMD...: run with a limit, log to $out/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n "${TAIL:-25}" "$out/$name.log"
}
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$py" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"
    nproc
} >"$out/env.log" 2>&1
cat "$out/env.log"
pytest=("$py" -m pytest -p no:cacheprovider -q -rfEs --timeout 150)
step device_plane_tests 320 "${pytest[@]}" tests/test_device_plane_gpu.py tests/test_device_plane.py ${GPU_CHECKS_K:+-k "$GPU_CHECKS_K"}
step torch_cuda_test 60 "${pytest[@]}" tests/test_torch.py -k cuda
TAIL=40 step gpu_benchmark 220 "$py" -m horovod.benchmarks.gpu

#!/usr/bin/env bash
# GPU checks for a lent NVIDIA GPU machine (CuPy, nvcc; no internet needed):
#   every kernel of the cuda backend against the interpreter, the gpu-marked tests
#   (kernels, CUDA graph replay, PTX fallback, greedy speculative generation), batch
#   invariance on cuda, and dflash-bench on the cuda backend (limits, kernels, end to end,
#   and speculative tokens/s at acceptance lengths 1, 6, 16 with the measured verify-k costs).
# Usage: scripts/gpu_check.sh OUT_DIR      (results and logs land in OUT_DIR)
set -uo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
PY=${PY:-python3}

if ! $PY -c "import dflash_ir.backends" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || {
    echo "gpu_check: cannot install dflash-ir here (see $out/install.log)"; exit 2; }
fi
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
# cubins for this GPU only: a third of the compile time
cc=$($PY -c "import cupy; print(cupy.cuda.Device().compute_capability)" 2>>"$out/errors.txt") || {
  echo "gpu_check: cupy cannot see a GPU (see $out/errors.txt)"; exit 2; }
export DFLASH_IR_CUDA_ARCHS="sm_$cc"
export DFLASH_IR_KERNEL_CACHE="$out/kernel-cache"

status=0
$PY tests/kernel_cases.py cuda 2>&1 | tee "$out/selftest.txt" || status=1
$PY -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider --junitxml="$out/gpu-tests.xml" 2>&1 \
  | tee "$out/gpu-tests.txt" || status=1
$PY -m pytest tests/backends/test_batch_invariance.py -k cuda -q -rs -p no:cacheprovider 2>&1 \
  | tee "$out/batch-invariance.txt" || status=1
$PY -m dflash_ir.benchmark.cli -b cuda --suites limits,kernels,e2e,tau --taus 1,6,16 -o "$out/bench" 2>&1 \
  | tee "$out/bench.txt" || status=1
echo "gpu_check: $( [ $status = 0 ] && echo passed || echo FAILED ), results in $out"
exit $status

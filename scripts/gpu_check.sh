#!/usr/bin/env bash
# GPU checks for a lent NVIDIA GPU machine (CuPy, nvcc; no internet needed):
#   the gpu-marked tests (every kernel of the cuda backend against the interpreter, CUDA graph
#   replay, PTX fallback, greedy speculative generation, the oracle pairs where the fixtures
#   are present), batch invariance on cuda, and dflash-bench on the cuda backend (limits,
#   kernels, end to end in both numerics modes, speculative tokens/s at acceptance lengths
#   1, 6, 16 with the measured verify-k costs, and where a decode step, a verify and a draft
#   block spend their time, kernel by kernel).
# Usage: scripts/gpu_check.sh OUT_DIR      (logs and results land in OUT_DIR)
# Each stage has a wall-clock limit (GPU_CHECK_LIMITS="tests batch bench" seconds, default
# "170 45 200"; 0 skips a stage), so the whole check ends inside a lease's command limit and
# still reports what it finished. $DFLASH_IR_KERNEL_CACHE may name a cache of cubins built beforehand.
set -uo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
PY=${PY:-python3}
read -r t_tests t_batch t_bench <<<"${GPU_CHECK_LIMITS:-170 45 200}"

if ! $PY -c "import dflash_ir.backends" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || {
    echo "gpu_check: cannot install dflash-ir here (see $out/install.log)"; exit 2; }
fi
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
# cubins for this GPU only: a third of the compile time
cc=$($PY -c "import cupy; print(cupy.cuda.Device().compute_capability)" 2>>"$out/errors.txt") || {
  echo "gpu_check: cupy cannot see a GPU (see $out/errors.txt)"; exit 2; }
export DFLASH_IR_CUDA_ARCHS="sm_$cc"
export DFLASH_IR_KERNEL_CACHE="${DFLASH_IR_KERNEL_CACHE:-$(mktemp -d)}"
export PYTHONUNBUFFERED=1
# pytest-xdist, where installed, spreads the kernel cases over the CPU cores
parallel=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")

status=0
stage() {  # stage NAME LIMIT COMMAND...: run it under its limit, log to OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  [ "$limit" = 0 ] && { echo "== $name skipped (limit 0)"; return; }
  echo "== $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "gpu_check: $name stopped at its ${limit}s limit" | tee -a "$out/$name.txt"
  [ "$rc" = 0 ] || status=1
}
stage gpu-tests "$t_tests" $PY -m pytest tests/gpu -m gpu -q -rs -p no:cacheprovider $parallel
stage batch-invariance "$t_batch" $PY -m pytest tests/backends/test_batch_invariance.py -k cuda -q -rs \
  -p no:cacheprovider
stage bench "$t_bench" $PY -m dflash_ir.benchmark.cli -b cuda --suites limits,kernels,e2e,tau,profile --taus 1,6,16 \
  --numerics exact,q8 --budget 0.3 -o "$out/bench"
echo "gpu_check: $( [ $status = 0 ] && echo passed || echo FAILED ), results in $out"
exit $status

"""TVM-built vs native kernels on the same device: tvm-opencl and tvm-llvm vs opencl (the native
CPU backend: PoCL here)"""
import pytest

from dflash_ir.benchmark.kernels import default_cases
from dflash_ir.benchmark.measure import time_calls

from common import ready_backend

CASES = default_cases(quick=True)  # shapes ~16x below the 9B / 35B layers: a short run on PoCL
PAIRS = [("opencl", "tvm-opencl"), ("opencl", "tvm-llvm")]
HEADER = f"{'kernel':28s} {'native':10s} {'ms':>9s}   {'TVM-built':10s} {'ms':>9s} {'TVM/native':>10s}"


@pytest.fixture(scope="module", params=range(len(CASES)), ids=lambda i: f"case{i}")
def case(request):
    return CASES[request.param]()


@pytest.mark.parametrize("native, tvm", PAIRS, ids=[t for _, t in PAIRS])
def test_tvm_vs_native(benchmark, table, case, native, tvm, tmp_path):
    tvm_run = case.runner(ready_backend(tvm), tmp_path / "tvm")
    native_seconds = time_calls(case.runner(ready_backend(native), tmp_path / "native")).seconds
    benchmark.pedantic(tvm_run, rounds=5, warmup_rounds=1)
    tvm_seconds = benchmark.stats["median"]
    table(HEADER, f"{case.name:28s} {native:10s} {native_seconds * 1e3:9.3f}   {tvm:10s} {tvm_seconds * 1e3:9.3f} "
                  f"{tvm_seconds / native_seconds:9.2f}x")

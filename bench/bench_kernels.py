"""Hot kernels at Qwen3.5-9B / Qwen3.6-35B-A3B layer shapes, per backend, against the roofline"""
import pytest

from dflash_ir.benchmark.kernels import default_cases

from common import BANDWIDTH_GBS, bench_backends, ready_backend

CASES = default_cases()
HEADER = f"{'kernel':36s} {'backend':10s} {'ms':>9s} {'GB/s':>8s} {'of bw':>6s} {'GFLOP/s':>9s}"


@pytest.fixture(scope="module", params=range(len(CASES)), ids=lambda i: f"case{i}")
def case(request):
    return CASES[request.param]()


@pytest.mark.parametrize("name", bench_backends())
def test_kernel(benchmark, table, case, name, tmp_path):
    run = case.runner(ready_backend(name), tmp_path)
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    seconds = benchmark.stats["median"]
    gbs = case.nbytes / seconds / 1e9
    bandwidth = BANDWIDTH_GBS.get(name) or BANDWIDTH_GBS.get("host")
    share = f"{gbs / bandwidth:6.0%}" if bandwidth else ""
    table(HEADER, f"{case.name:36s} {name:10s} {seconds * 1e3:9.3f} {gbs:8.2f} {share:>6s} "
                  f"{case.flops / seconds / 1e9:9.1f}")

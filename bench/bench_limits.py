"""Machine limits through each backend: STREAM copy / triad (GB/s) and f32 GEMM (GFLOP/s)"""
import pytest

from dflash_ir.benchmark.limits import host_limits, measure_limits

from common import BANDWIDTH_GBS, bench_backends, ready_backend

HEADER = f"{'through':12s} {'copy GB/s':>10s} {'triad GB/s':>11s} {'GEMM GFLOP/s':>13s}"


def _row(limits) -> str:
    BANDWIDTH_GBS[limits.backend] = limits.bandwidth_gbs
    return f"{limits.backend:12s} {limits.copy_gbs:10.2f} {limits.triad_gbs:11.2f} {limits.gemm_gflops:13.1f}"


def test_host(benchmark, table):
    table(HEADER, _row(benchmark.pedantic(host_limits, rounds=1, iterations=1)))


@pytest.mark.parametrize("name", bench_backends())
def test_backend(benchmark, table, name, tmp_path):
    backend = ready_backend(name)
    table(HEADER, _row(benchmark.pedantic(measure_limits, args=(backend, tmp_path), rounds=1, iterations=1)))

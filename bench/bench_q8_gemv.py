"""Q8_0 GEMV throughput vs copy bandwidth through the same backend

Weight bytes read per second by the Q8_0 GEMV kernel (one activation row, so the weight
read is the whole cost), next to the bandwidth of a plain elementwise kernel (read +
write) on the same device. Backend: $DFLASH_IR_BENCH_BACKEND (default opencl, i.e. PoCL
on a CPU-only machine).

    python -m pytest bench/bench_q8_gemv.py -q        (pytest-benchmark)
    python bench/bench_q8_gemv.py [BACKEND]           (plain timing, e.g. on a GPU machine)
"""
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_ir.backends.base import get_backend
from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType
from dflash_ir.quant import quantize

BACKEND = os.environ.get("DFLASH_IR_BENCH_BACKEND", "opencl")
SHAPES = [(2048, 2048), (4096, 4096), (11008, 4096)]  # (N rows of w, K)
COPY_ELEMENTS = 1 << 24
HEADER = f"{'kernel':34s} {'MB moved':>9s} {'ms':>8s} {'GB/s':>7s} {'of copy':>8s}"


def _launcher(backend, graph, weights, inputs):
    folder = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    program = backend.load(graph, backend.compile(graph, folder), folder, lambda w: weights[w.tensor])
    return program.launcher(inputs)


def copy_case(backend):
    """(name, bytes moved, run) of an f32 elementwise kernel: read + write."""
    b = GraphBuilder("copy")
    b.output("y", b.neg(b.input("x", DType.F32, ("T",))))
    run = _launcher(backend, b.build(), {}, {"x": np.ones(COPY_ELEMENTS, np.float32)})
    return f"copy f32 x {COPY_ELEMENTS}", 8 * COPY_ELEMENTS, run


def gemv_case(backend, n: int, k: int):
    """(name, weight bytes, run) of one activation row times a Q8_0 weight [n, k]."""
    b = GraphBuilder("gemv")
    w = b.weight("w", DType.Q8_0, (n, k))
    b.output("y", b.matmul(b.input("x", DType.F32, (1, k)), w))
    weight = quantize(np.random.default_rng(0).standard_normal((n, k)).astype(np.float32), DType.Q8_0)
    run = _launcher(backend, b.build(), {"w": weight}, {"x": np.ones((1, k), np.float32)})
    return f"q8_0 gemv {n}x{k}", weight.nbytes, run


def row(name: str, nbytes: int, seconds: float, copy_gbs: float | None) -> str:
    gbs = nbytes / seconds / 1e9
    share = f"{gbs / copy_gbs:7.0%}" if copy_gbs else ""
    return f"{name:34s} {nbytes / 1e6:9.1f} {seconds * 1e3:8.2f} {gbs:7.2f} {share:>8s}"


_COPY_GBS: list[float] = []


@pytest.fixture(scope="module")
def backend():
    be = get_backend(BACKEND)
    if be.unavailable_reason():
        pytest.skip(f"{BACKEND}: {be.unavailable_reason()}")
    return be


def _bench(benchmark, table, case) -> float:
    name, nbytes, run = case
    benchmark.pedantic(run, rounds=5, warmup_rounds=1)
    seconds = benchmark.stats["mean"]
    table(HEADER, row(name, nbytes, seconds, _COPY_GBS[0] if _COPY_GBS else None))
    return nbytes / seconds / 1e9


def test_copy_bandwidth(benchmark, backend, table):
    _COPY_GBS.append(_bench(benchmark, table, copy_case(backend)))


@pytest.mark.parametrize("n, k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_q8_0_gemv(benchmark, backend, table, n, k):
    _bench(benchmark, table, gemv_case(backend, n, k))


def main(name: str) -> None:
    backend = get_backend(name)
    backend.require()
    print(f"{__doc__.splitlines()[0]}: {name} on {backend.device_description()}\n{HEADER}")
    copy_gbs = None
    for case in [copy_case(backend)] + [gemv_case(backend, n, k) for n, k in SHAPES]:
        label, nbytes, run = case
        run()
        start, repeat = time.perf_counter(), 20
        for _ in range(repeat):
            run()
        seconds = (time.perf_counter() - start) / repeat
        print(row(label, nbytes, seconds, copy_gbs), flush=True)
        copy_gbs = copy_gbs or nbytes / seconds / 1e9


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else BACKEND)

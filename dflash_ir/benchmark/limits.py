"""The machine's limits, measured through each backend in the same run: STREAM-style copy and
triad (bandwidth) and an f32 GEMM (arithmetic), so every kernel figure can be printed as a
fraction of what that device actually sustains rather than of a datasheet number.

Our op set has no fused triad: `a = b + 3 c` is a scale kernel then an add kernel, so it
moves 20 bytes per element (read c, write t, read b and t, write a) and is counted so.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType

from .measure import time_calls
from .programs import single_graph_runner

F32 = DType.F32


@dataclass(frozen=True)
class Limits:
    backend: str
    copy_gbs: float
    triad_gbs: float
    gemm_gflops: float

    @property
    def bandwidth_gbs(self) -> float:
        """What the device sustains: the better of the two streams."""
        return max(self.copy_gbs, self.triad_gbs)


def _copy_graph():
    b = GraphBuilder("stream_copy")
    b.output("y", b.neg(b.input("x", F32, ("N",))))
    return b.build()


def _triad_graph():
    b = GraphBuilder("stream_triad")
    b.output("a", b.add(b.input("b", F32, ("N",)), b.scale(b.input("c", F32, ("N",)), factor=3.0)))
    return b.build()


def _gemm_graph(k: int):
    b = GraphBuilder("gemm_f32")
    b.output("y", b.matmul(b.input("x", F32, ("T", k)), b.weight("w", F32, (k, k))))
    return b.build()


def last_level_cache_bytes() -> int:
    """The size of the CPU's largest cache (sysfs), 0 where it cannot be read."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        sizes.append(int(text[:-1]) * scale[text[-1]] if text[-1] in scale else int(text))
    return max(sizes, default=0)


def beyond_cache_bytes() -> int:
    """How many bytes a stream must span to come from memory, not cache: twice the last-level
    cache (a server part's L3 can hold 300 MB), at least 64 MiB."""
    return max(64 << 20, 2 * last_level_cache_bytes())


def stream_elements() -> int:
    """f32 elements per STREAM array: past the caches, at most 1 GiB."""
    return min(1 << 28, beyond_cache_bytes() // 4)


def measure_limits(backend, work_dir: Path, *, elements: int | None = None, gemm: int = 1024,
                   budget_s: float = 1.0) -> Limits:
    """Copy and triad over `elements` f32 per array (default: past every cache), and a `gemm`
    x `gemm` x `gemm` f32 product, all compiled and run by `backend`."""
    elements = elements or stream_elements()
    rng = np.random.default_rng(0)
    x = rng.standard_normal(elements).astype(np.float32)
    work_dir = Path(work_dir)
    copy = time_calls(single_graph_runner(backend, _copy_graph(), {}, {"x": x}, {}, work_dir / "copy"),
                      budget_s=budget_s)
    triad = time_calls(single_graph_runner(backend, _triad_graph(), {}, {"b": x, "c": x}, {}, work_dir / "triad"),
                       budget_s=budget_s)
    w = rng.standard_normal((gemm, gemm)).astype(np.float32)
    xs = rng.standard_normal((gemm, gemm)).astype(np.float32)
    product = time_calls(single_graph_runner(backend, _gemm_graph(gemm), {"w": w}, {"x": xs}, {}, work_dir / "gemm"),
                         budget_s=budget_s)
    return Limits(backend.name, copy.rate(8.0 * elements) / 1e9, triad.rate(20.0 * elements) / 1e9,
                  product.rate(2.0 * gemm ** 3) / 1e9)


def host_limits(*, elements: int | None = None, gemm: int = 1024, budget_s: float = 1.0) -> Limits:
    """The host through numpy alone (memcpy-speed copy, BLAS sgemm): the CPU's own ceiling,
    which the CPU backends (interpreter, PoCL, lavapipe, TVM llvm) all share."""
    elements = elements or stream_elements()
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(elements).astype(np.float32) for _ in range(3))
    m = rng.standard_normal((gemm, gemm)).astype(np.float32)
    copy = time_calls(lambda: np.copyto(a, b), budget_s=budget_s)
    triad = time_calls(lambda: (np.multiply(c, np.float32(3.0), out=a), np.add(a, b, out=a)), budget_s=budget_s)
    product = time_calls(lambda: m @ m, budget_s=budget_s)
    # numpy's triad is two passes too: read c, write a, read a and b, write a
    return Limits("host", copy.rate(8.0 * elements) / 1e9, triad.rate(20.0 * elements) / 1e9,
                  product.rate(2.0 * gemm ** 3) / 1e9)

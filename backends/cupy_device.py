"""The run-time device of the cuda and rocm backends: CuPy loads a cubin / PTX / HSACO module
(RawModule) and launches its kernels; buffers are flat byte arrays on the GPU. A program's
resolved launch list (the runner's `prepare`) is captured once as a CUDA graph and replayed
with one launch: a decode token is a few hundred kernels of microseconds each, where the
launch overhead would otherwise be a large part of the token."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Callable

import numpy as np


@functools.cache
def _module(path: str):
    import cupy

    return cupy.RawModule(path=path)


class CupyDevice:
    def __init__(self, binary: Path):
        import cupy

        self._cupy = cupy
        self.memory = ("gpu", cupy.cuda.Device().id)  # buffers of every module on this GPU
        self.module = _module(str(binary))
        self.kernels: dict[str, object] = {}

    def alloc(self, nbytes: int):
        return self._cupy.empty(nbytes, dtype=self._cupy.uint8)

    # synchronous copies on the legacy default stream, which the kernels are launched on too
    def upload(self, buf, array: np.ndarray, offset: int = 0) -> None:
        buf[offset:].data.copy_from_host(array.ctypes.data_as(ctypes.c_void_p), array.nbytes)

    def download(self, buf, array: np.ndarray) -> None:
        buf.data.copy_to_host(array.ctypes.data_as(ctypes.c_void_p), array.nbytes)

    def copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        dst[dst_offset:dst_offset + nbytes] = src[src_offset:src_offset + nbytes]

    def kernel(self, name: str):
        if name not in self.kernels:
            self.kernels[name] = self.module.get_function(name)
        return self.kernels[name]

    def launch(self, kernel: str, groups, local, args) -> None:
        self.kernel(kernel)(tuple(groups), tuple(local), tuple(args))

    def prepare(self, launches) -> Callable[[], None]:
        """A replay of `launches` as one CUDA graph, captured on a blocking stream (which
        orders itself with the legacy default stream the copies use) at the first replay."""
        resolved = [(self.kernel(name), tuple(groups), tuple(local), tuple(args))
                    for name, groups, local, args in launches]
        stream = self._cupy.cuda.Stream()
        graph = []

        def replay() -> None:
            if not graph:
                with stream:
                    stream.begin_capture()
                    for fn, groups, local, args in resolved:
                        fn(groups, local, args)
                    graph.append(stream.end_capture())
            graph[0].launch(stream)
        return replay

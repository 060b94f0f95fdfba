"""The run-time device of the cuda and rocm backends: CuPy loads a cubin / PTX / HSACO module
(RawModule) and launches its kernels; buffers are flat byte arrays on the GPU."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

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
    def upload(self, buf, array: np.ndarray) -> None:
        buf.data.copy_from_host(array.ctypes.data_as(ctypes.c_void_p), array.nbytes)

    def download(self, buf, array: np.ndarray) -> None:
        buf.data.copy_to_host(array.ctypes.data_as(ctypes.c_void_p), array.nbytes)

    def copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int) -> None:
        dst[dst_offset:dst_offset + nbytes] = src[src_offset:src_offset + nbytes]

    def launch(self, kernel: str, groups, local, args) -> None:
        if kernel not in self.kernels:
            self.kernels[kernel] = self.module.get_function(kernel)
        self.kernels[kernel](tuple(groups), tuple(local), tuple(args))

"""The `tvm-llvm` run-time device: numpy byte buffers on the host, kernels called through
the TVM runtime from the artifact's shared library. Each launch views its byte buffers as
the flat typed tensors the PrimFunc declares (zero-copy, via DLPack), so memory planning,
checks and states stay the runner's; the views of a launch (kernel, sizes, buffers) are made
once and reused by every later token, as making them cost more than a small kernel runs."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..plan import compile_expr

ALIGN = 64  # TVM's LLVM code may assume 64-byte aligned buffers
MAX_CALLS = 4096  # launches whose typed views are kept (each keeps its buffers alive)

# TVM's thread pool takes half the hardware threads on x86 (it assumes SMT siblings): one on
# a 2-CPU machine. Every CPU this process may run on, as PoCL uses (read when the pool starts).
os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))


class HostDevice:
    def __init__(self, library: Path, kernels: Mapping[str, Mapping[str, Any]]):
        import tvm
        import tvm_ffi

        self._from_dlpack = tvm_ffi.from_dlpack
        self.memory = "host"  # numpy buffers: any host device's copy reads them
        self.module = tvm.runtime.load_module(str(library))
        self._specs = {name: ([(np.dtype(dtype), compile_expr(size)) for dtype, size in k["params"]], tuple(k["ints"]))
                       for name, k in kernels.items()}
        self._calls: dict[tuple, tuple[Any, list]] = {}  # (kernel, ints, buffer addresses) -> (function, views)

    def alloc(self, nbytes: int) -> np.ndarray:
        raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
        start = -raw.ctypes.data % ALIGN
        return raw[start:start + nbytes]

    def upload(self, buf: np.ndarray, array: np.ndarray, offset: int = 0) -> None:
        buf[offset:offset + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    def download(self, buf: np.ndarray, array: np.ndarray) -> None:
        array.reshape(-1).view(np.uint8)[:] = buf[:array.nbytes]

    def copy(self, src: np.ndarray, src_offset: int, dst: np.ndarray, dst_offset: int, nbytes: int) -> None:
        """Buffer to buffer (lets the runner keep states in device buffers between calls)."""
        dst[dst_offset:dst_offset + nbytes] = src[src_offset:src_offset + nbytes]

    def launch(self, kernel: str, groups, local, args) -> None:
        params, names = self._specs[kernel]
        ints = tuple(int(a) for a in args[len(params):])
        key = (kernel, ints, *(buf.ctypes.data for buf in args[:len(params)]))
        call = self._calls.get(key)
        if call is None:  # a launch repeats every token: its typed views are made once
            if len(self._calls) >= MAX_CALLS:  # new sizes (another context length): the old views go
                self._calls.clear()
            env = dict(zip(names, ints))
            tensors = [self._from_dlpack(buf[:size(env) * dtype.itemsize].view(dtype))
                       for (dtype, size), buf in zip(params, args)]
            call = self._calls[key] = (self.module[kernel], tensors)
        func, tensors = call
        func(*tensors, *ints)

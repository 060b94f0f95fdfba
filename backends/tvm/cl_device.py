"""The tvm-opencl run-time device: the native OpenCL device (pyopencl queue and buffers)
launching kernels from one TVM-generated program per source, built once per process."""
from __future__ import annotations

import functools

from ..opencl import BUILD_OPTIONS, CLDevice


@functools.cache
def program(source: str) -> dict:
    """Kernels by name of a TVM OpenCL source (raises with the build log on an error)."""
    import pyopencl as cl

    ctx = CLDevice().ctx
    built = cl.Program(ctx, source).build(options=BUILD_OPTIONS)
    return {k.function_name: k for k in built.all_kernels()}


class TVMCLDevice(CLDevice):
    def __init__(self, source: str):
        super().__init__()
        self.kernels = program(source) if source else {}

    def kernel(self, name: str):
        return self.kernels[name]

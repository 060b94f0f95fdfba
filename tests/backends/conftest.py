"""Backends under test, skipped cleanly where their device or compiler is missing."""
import pytest

from dflash_ir.backends.base import Backend, get_backend
from dflash_ir.backends.toolchain import find_hip, find_nvcc


def ready(name: str) -> Backend:
    """The named backend, or a skip that says why it cannot run here."""
    backend = get_backend(name)
    reason = backend.unavailable_reason()
    if reason:
        pytest.skip(f"{name}: {reason}")
    return backend


@pytest.fixture(scope="session")
def opencl():
    return ready("opencl")


@pytest.fixture(scope="session")
def vulkan():
    return ready("vulkan")


@pytest.fixture(scope="session")
def tvm():
    """The tvm-llvm backend (apache-tvm at the pinned version)."""
    return ready("tvm-llvm")


@pytest.fixture(scope="session")
def tvm_opencl(tvm):
    """The tvm-opencl backend: TVM to build, an OpenCL device (PoCL here) to run."""
    return ready("tvm-opencl")


@pytest.fixture(scope="session")
def nvcc():
    if find_nvcc() is None:
        pytest.skip("nvcc not found")


@pytest.fixture(scope="session")
def hip():
    found = find_hip()
    if isinstance(found, str):
        pytest.skip(found)


# -- running single kir kernels (tests of the kernel layer itself) --------------------------
def _written(kernel, arrays) -> dict:
    return {p.name: arrays[p.name] for p in kernel.buffers if p.writes}


@pytest.fixture(scope="session")
def run_opencl(opencl):
    """`run(kernel, groups, arrays, ints={})` -> the written buffers after one launch of
    `kernel` (a kir Kernel) printed by the OpenCL printer, on the OpenCL device; `arrays`
    holds every buffer's initial contents, by parameter name."""
    import numpy as np
    import pyopencl as cl

    from dflash_ir.backends.kir.c import PRINTERS
    from dflash_ir.backends.opencl import _context, _program

    ctx, queue, _ = _context()

    def run(kernel, groups, arrays, ints=None):
        printer = PRINTERS["opencl"]
        fn = _program(printer.module_header(kernel.functions) + printer.kernel_source(kernel))[kernel.name]
        arrays = {n: np.array(a) for n, a in arrays.items()}
        mf = cl.mem_flags
        bufs = {p.name: cl.Buffer(ctx, mf.READ_WRITE | mf.COPY_HOST_PTR, hostbuf=arrays[p.name])
                for p in kernel.buffers}
        size = tuple(g * l for g, l in zip(tuple(groups) + (1,) * (3 - len(groups)), kernel.local))
        args = [bufs[p.name] for p in kernel.buffers] + [np.int32((ints or {})[n]) for n in kernel.ints]
        fn(queue, size, kernel.local, *args)
        for name, a in _written(kernel, arrays).items():
            cl.enqueue_copy(queue, a, bufs[name])
        queue.finish()
        return _written(kernel, arrays)

    return run


@pytest.fixture(scope="session")
def run_vulkan(vulkan):
    """`run(kernel, features, groups, arrays, ints={})` -> the written buffers after one
    launch of `kernel` printed as GLSL under `features` (kir.glsl), on a Vulkan device with
    exactly the features the variant requires; skipped without the SPIR-V tools or features."""
    import numpy as np

    from dflash_ir.backends.kir.glsl import render_glsl
    from dflash_ir.backends.spirv import compile_spirv, spirv_tools_missing
    from dflash_ir.backends.vulkan_device import (choose_device, open_device, physical_devices,
                                                  supported_features, supported_subgroup_operations)

    if spirv_tools_missing():
        pytest.skip(spirv_tools_missing())
    physical = choose_device(physical_devices())

    def run(kernel, features, groups, arrays, ints=None):
        have = supported_features(physical) | supported_subgroup_operations(physical)
        need = set(features.required_device_features()) | set(features.required_subgroup_operations())
        if not need <= have:
            pytest.skip(f"{physical.describe()} lacks {sorted(need - have)}")
        device = open_device(physical, frozenset(features.required_device_features()))
        spirv = compile_spirv(render_glsl(kernel, features), name=kernel.name)
        device.add_kernels({kernel.name: spirv})
        arrays = {n: np.array(a) for n, a in arrays.items()}
        bufs = {}
        for p in kernel.buffers:
            bufs[p.name] = device.alloc(-(-arrays[p.name].nbytes // 4) * 4)
            device.upload(bufs[p.name], arrays[p.name])
        groups = tuple(groups) + (1,) * (3 - len(groups))
        device.launch(kernel.name, groups, kernel.local,
                      [bufs[p.name] for p in kernel.buffers] + [(ints or {})[n] for n in kernel.ints])
        device.synchronize()
        for name, a in _written(kernel, arrays).items():
            device.download(bufs[name], a)
        return _written(kernel, arrays)

    return run

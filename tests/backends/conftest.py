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

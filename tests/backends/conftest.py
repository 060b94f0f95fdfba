"""Backends under test, skipped cleanly where their device or compiler is missing."""
import pytest

from dflash_ir.backends.base import get_backend
from dflash_ir.backends.toolchain import find_hip, find_nvcc


@pytest.fixture(scope="session")
def opencl():
    backend = get_backend("opencl")
    if backend.unavailable_reason():
        pytest.skip(f"opencl: {backend.unavailable_reason()}")
    return backend


@pytest.fixture(scope="session")
def nvcc():
    if find_nvcc() is None:
        pytest.skip("nvcc not found")


@pytest.fixture(scope="session")
def hip():
    found = find_hip()
    if isinstance(found, str):
        pytest.skip(found)

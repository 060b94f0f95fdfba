"""Backends under test, skipped cleanly where their device or compiler is missing."""
import pytest

from dflash_ir.backends.base import get_backend
from dflash_ir.backends.toolchain import find_hip, find_nvcc
from dflash_ir.models.generator import tiny_draft_config, tiny_target_config, write_draft, write_target


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


@pytest.fixture(scope="session")
def generated_pair(tmp_path_factory):
    """`get(arch, dtype)` -> (target, draft) paths of a generated tiny pair (models/generator.py defaults)."""
    made = {}

    def get(arch: str, dtype: str = "f16"):
        if (arch, dtype) not in made:
            d = tmp_path_factory.mktemp(f"{arch}-{dtype}")
            tcfg = tiny_target_config(arch)
            write_target(d / "target.gguf", tcfg, dtype=dtype, seed=1)
            write_draft(d / "draft.gguf", tiny_draft_config(tcfg), target_cfg=tcfg, dtype=dtype, seed=2)
            made[arch, dtype] = (d / "target.gguf", d / "draft.gguf")
        return made[arch, dtype]

    return get

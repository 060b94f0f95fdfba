"""GPU tests: the cuda backend on a real NVIDIA GPU (CuPy + nvcc); skipped anywhere else."""
import pytest

from dflash_ir.backends.base import get_backend
from dflash_ir.backends.toolchain import find_nvcc


@pytest.fixture(scope="session")
def cuda():
    backend = get_backend("cuda")
    if backend.unavailable_reason():
        pytest.skip(f"cuda: {backend.unavailable_reason()}")
    if find_nvcc() is None:
        pytest.skip("nvcc not found (the cuda backend compiles with it)")
    return backend


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """`get(arch, dtype)` -> (target, draft) of a generated tiny pair."""
    gen = pytest.importorskip("dflash_ir.models.generator")
    made = {}

    def get(arch: str, dtype: str):
        if (arch, dtype) not in made:
            d = tmp_path_factory.mktemp(f"{arch}-{dtype}")
            cfg = gen.tiny_target_config(arch)
            gen.write_target(d / "t.gguf", cfg, dtype=dtype, seed=1)
            gen.write_draft(d / "d.gguf", gen.tiny_draft_config(cfg), target_cfg=cfg, dtype=dtype, seed=2)
            made[arch, dtype] = (d / "t.gguf", d / "d.gguf")
        return made[arch, dtype]

    return get

"""Compile-only: every kernel compiles to cubin (each CUBIN_ARCHS) + PTX and to HSACO (each
supported GFX target), and every kernel a program launches is a symbol of its binaries.
Needs nvcc / the HIP toolchain, not a GPU; skipped without them."""
import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.backends.base import get_backend
from dflash_ir.backends.kir.build import FUNCTIONS
from dflash_ir.backends.kir.c import PRINTERS
from dflash_ir.backends.lowering import lower
from kernel_cases import CASES, case_graph
from dflash_ir.backends.toolchain import (
    CUBIN_ARCHS,
    GFX_ARCHS,
    elf_functions,
    hip_archs,
    hip_build,
    nvcc_ptx,
    ptx_entries,
    ptxas_cubin,
)


@pytest.fixture(scope="module")
def every_kernel():
    """The kernels of all cases in tests/kernel_cases.py: every op and variant the lowering produces for GPUs."""
    kernels = {}
    for c in CASES.values():
        kernels.update(lower(case_graph(c.build())).kernels)
    return kernels


def _source(dialect: str, kernels) -> str:
    """The module a backend builds: every device function, then the kernels."""
    return PRINTERS[dialect].render(kernels.values(), tuple(FUNCTIONS.values()))


def test_every_kernel_compiles_for_cuda(nvcc, every_kernel):
    ptx = nvcc_ptx(_source("cuda", every_kernel))
    assert ptx_entries(ptx.decode()) == set(every_kernel)
    for arch in CUBIN_ARCHS:
        assert elf_functions(ptxas_cubin(ptx, arch)) == set(every_kernel), arch


def test_every_kernel_compiles_for_rocm(hip, every_kernel):
    assert hip_archs() == GFX_ARCHS, "the Debian ROCm 5.2 device libraries cover gfx90a and gfx1030"
    source = _source("hip", every_kernel)
    for arch in hip_archs():
        assert elf_functions(hip_build(source, arch)) == set(every_kernel), arch


@pytest.fixture(scope="module")
def model_graphs(tiny_pair):
    """The verify and draft-block programs of a generated MoE pair: between them every kind of
    kernel a model launches (the prefill and decode programs hold the same kernels)."""
    pair = open_pair(*tiny_pair("qwen35moe", "q8_0"))
    return [pair.graphs["target.verify"], pair.graphs["draft.block"]]


def _launched(entry: dict) -> set[str]:
    return {launch["kernel"] for step in entry["plan"]["steps"] for launch in step["launches"]}


def test_model_kernels_are_in_the_cubins(nvcc, model_graphs, tmp_path):
    backend = get_backend("cuda")
    for graph in model_graphs:
        entry = backend.compile(graph, tmp_path)
        assert set(entry["cubin"]) == set(CUBIN_ARCHS)
        for arch, rel in entry["cubin"].items():
            assert _launched(entry) <= elf_functions((tmp_path / rel).read_bytes()), f"{graph.name} {arch}"
        assert _launched(entry) <= ptx_entries((tmp_path / entry["ptx"]).read_text()), graph.name


def test_model_kernels_are_in_the_code_objects(hip, model_graphs, tmp_path):
    backend = get_backend("rocm")
    for graph in model_graphs:
        entry = backend.compile(graph, tmp_path)
        assert set(entry["hsaco"]) == set(hip_archs())
        for arch, rel in entry["hsaco"].items():
            assert _launched(entry) <= elf_functions((tmp_path / rel).read_bytes()), f"{graph.name} {arch}"

"""Compile-only through TVM (no GPU): TVM's CUDA source for every kernel of every case in tests/kernel_cases.py
and of every fixture model builds with nvcc to PTX and to a cubin per CUBIN_ARCHS, and every
device kernel a plan launches is an entry of the PTX and a function of each cubin; tvm-rocm
links an HSACO per GFX target holding every device kernel of its plan."""
import shutil

import pytest

from dflash_ir.artifact import compile_pair, read_manifest
from kernel_cases import CASES, case_graph
from dflash_ir.backends.toolchain import CUBIN_ARCHS, elf_functions, nvcc_ptx, ptx_entries, ptxas_cubin


def test_every_case_kernel_builds_for_cuda(tvm, nvcc):
    from dflash_ir.backends.tvm.build import build_gpu
    from dflash_ir.backends.tvm.lowering import lower

    kernels = {}
    for c in CASES.values():
        kernels.update(lower(case_graph(c.build()))[1])
    source, launches = build_gpu("cuda", kernels)
    assert set(launches) == set(kernels) and all(launches.values())
    names = {k.name for ks in launches.values() for k in ks}
    ptx = nvcc_ptx(source)
    assert ptx_entries(ptx.decode()) == names
    for arch in CUBIN_ARCHS:
        assert elf_functions(ptxas_cubin(ptx, arch)) == names, arch


def _assert_binaries_hold_launched_kernels(out):
    manifest = read_manifest(out)
    assert manifest["backend"]["name"] == "tvm-cuda"
    for name, program in manifest["programs"].items():
        entry = program["backend"]
        assert entry["tvm"]["version"] and entry["tvm"]["target"]["kind"] == "cuda"
        launched = {launch["kernel"] for step in entry["plan"]["steps"] for launch in step["launches"]}
        assert launched, name
        assert launched <= ptx_entries((out / entry["ptx"]).read_text()), name
        assert set(entry["cubin"]) == set(CUBIN_ARCHS)
        for arch, path in entry["cubin"].items():
            assert launched <= elf_functions((out / path).read_bytes()), (name, arch)


@pytest.mark.parametrize("arch, dtype", [("qwen35", "f16"), ("qwen35moe", "q8_0")])
def test_generated_pair_builds_for_cuda(tvm, nvcc, tiny_pair, arch, dtype, tmp_path):
    out = compile_pair(*tiny_pair(arch, dtype), out=tmp_path / "art", backend="tvm-cuda", n_ctx=64)
    _assert_binaries_hold_launched_kernels(out)


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fixture_pair_builds_for_cuda(tvm, nvcc, oracle_gguf, kind, tmp_path):
    out = compile_pair(oracle_gguf(f"{kind}/gguf/{kind}-target-f16.gguf"), oracle_gguf(f"{kind}/gguf/{kind}-dflash-f16.gguf"),
                       out=tmp_path / "art", backend="tvm-cuda", n_ctx=96)
    _assert_binaries_hold_launched_kernels(out)


EF_AMDGPU_MACH = {"gfx90a": 0x3F, "gfx1030": 0x36}  # e_flags' low byte names the GFX target


def test_rocm_artifact_holds_linked_hsaco_per_target(tvm, hip, tmp_path):
    """tvm-rocm links TVM's code objects (v6, by an ld.lld >= 18: rocm_build.linker) into one
    HSACO per GFX target the device libraries cover, each made for its target and holding
    every device kernel its launch plan names."""
    import struct

    from dflash_ir.backends.base import get_backend
    from dflash_ir.backends.toolchain import hip_archs

    assert set(hip_archs()) == set(EF_AMDGPU_MACH)
    entry = get_backend("tvm-rocm").compile(case_graph(CASES["fused_attention_gated_persist"].build()), tmp_path)
    launched = {launch["kernel"] for step in entry["plan"]["steps"] for launch in step["launches"]}
    assert launched and set(entry["hsaco"]) == set(EF_AMDGPU_MACH)
    for arch, rel in entry["hsaco"].items():
        hsaco = (tmp_path / rel).read_bytes()
        e_type, = struct.unpack_from("<H", hsaco, 16)
        e_flags, = struct.unpack_from("<I", hsaco, 48)
        assert e_type == 3 and hsaco[7] == 64, arch  # ET_DYN (linked), ELFOSABI_AMDGPU_HSA
        assert e_flags & 0xFF == EF_AMDGPU_MACH[arch], arch
        assert elf_functions(hsaco) == launched, arch


def test_rocm_link_names_the_linker_it_needs(tvm, monkeypatch):
    """Only an ld.lld older than 18 on PATH: the backend says which it found and what to install."""
    from dflash_ir.backends.base import BackendUnavailable
    from dflash_ir.backends.tvm import rocm_build

    monkeypatch.setattr(rocm_build, "LINKERS", ("ld.lld-15", "ld.lld-14"))
    rocm_build.linker.cache_clear()
    if not any(map(shutil.which, rocm_build.LINKERS)):
        pytest.skip("neither ld.lld-15 nor ld.lld-14 installed")
    try:
        with pytest.raises(BackendUnavailable, match=r"code object v6.*LLD 1[45].*apt-get install lld-19"):
            rocm_build.linker()
    finally:
        rocm_build.linker.cache_clear()

"""Compile-only through TVM (no GPU): TVM's CUDA source for every kernel of every case in tests/kernel_cases.py
and of every fixture model builds with nvcc to PTX and to a cubin per CUBIN_ARCHS, and every
device kernel a plan launches is an entry of the PTX and a function of each cubin."""
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


def _lld_major() -> int:
    import re
    import subprocess

    return int(re.search(r"LLD (\d+)", subprocess.run(["ld.lld", "--version"], capture_output=True, text=True).stdout)[1])


def test_rocm_objects_build_and_link_as_far_as_the_toolchain_allows(tvm, hip, tmp_path):
    """TVM's LLVM makes an AMDGPU object holding every device kernel for each GFX target the
    device libraries cover; ld.lld < 18 cannot link its code object v6 into an HSACO, and
    the backend says so (backends/tvm/rocm_build.py)."""
    from dflash_ir.backends.base import BackendUnavailable, get_backend
    from dflash_ir.backends.toolchain import hip_archs
    from dflash_ir.backends.tvm.build import TARGETS, scheduled_device
    from dflash_ir.backends.tvm.lowering import lower
    from dflash_ir.backends.tvm.rocm_build import amdgpu_object, link, ocml_f64

    graph = case_graph(CASES["fused_attention_gated_persist"].build())
    kernels = lower(graph)[1]
    mod, _, _, launches = scheduled_device({**TARGETS["rocm"], "mcpu": hip_archs()[0]}, kernels, ocml_f64)
    names = {k.name for ks in launches.values() for k in ks}
    for arch in hip_archs():
        obj = amdgpu_object(mod, arch)
        assert obj[:4] == b"\x7fELF" and obj[7] == 64, arch  # ELFOSABI_AMDGPU_HSA
        assert names <= elf_functions(obj), arch
        if _lld_major() >= 18:
            assert names <= elf_functions(link(obj)), arch
        else:
            with pytest.raises(BackendUnavailable, match=r"code object v6\): ld.lld: error: unknown abi version"):
                link(obj)
    if _lld_major() < 18:
        with pytest.raises(BackendUnavailable, match="an ld.lld from LLVM 18 or newer"):
            get_backend("tvm-rocm").compile(graph, tmp_path)

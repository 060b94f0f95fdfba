"""Device-free: one kernel tree printed in three dialects, the launch plan, size
expressions, views and in-place updates, and the messages of backends that cannot run."""
import json
import re

import numpy as np
import pytest

from dflash_ir.backends.base import BackendUnavailable, get_backend
from dflash_ir.backends.kir.c import PRINTERS
from dflash_ir.backends.kir.ir import walk
from dflash_ir.artifact import open_pair
from dflash_ir.backends import lowering
from dflash_ir.backends.kernels import linalg
from dflash_ir.backends.lowering import lower
from dflash_ir.backends.plan import Plan, compile_expr
from kernel_cases import CASES, case_graph
from dflash_ir.backends.toolchain import elf_functions
from dflash_ir.builder import GraphBuilder
from dflash_ir.dtypes import DType


def _plan(name: str) -> Plan:
    return lower(case_graph(CASES[name].build()))


def _names(kernel) -> set[str]:
    """The identifiers a kernel's tree introduces or reads: parameters, variables, arrays."""
    names = {p.name for p in kernel.params}
    for n in walk(kernel.body):
        if n.op in ("var", "decl", "for", "index"):
            names.add(n.arg)
        elif n.op == "array":
            names.add(n.arg[0])
    return names


def _skeleton(source: str, kernel) -> list[tuple[str, ...]]:
    """Per line of the kernel's body: the tree's identifiers it names (how many times each)
    and its braces; what a dialect spells its own way (types, ids, intrinsics, the order of
    a helper's arguments) is left out."""
    body = source[source.index(kernel.name):]
    names = _names(kernel)
    return [tuple(sorted(t for t in re.findall(r"(?<![.\w])[A-Za-z_]\w*|[{}]", line) if t in names or t in "{}"))
            for line in body.splitlines()]


def test_one_tree_three_dialects():
    """The GPU GEMV of a Q8_0 weight times Q8_0 activations (an int8 dot product per word):
    the same statements over the same names in every dialect, each with its own spelling
    of the kernel head, the ids and the dot product."""
    plan = _plan("matmul_q8_0_q8_x_3_rows")
    kernel = next(k for k in plan.kernels.values() if k.op == "matmul_gemv")
    sources = {name: p.render([kernel]) for name, p in PRINTERS.items()}
    lanes, cols, _ = kernel.local  # the GEMV's geometry for this K (kernels/linalg.Gemv)
    assert lanes * cols == 256
    assert f"__kernel __attribute__((reqd_work_group_size({lanes}, {cols}, 1))) void {kernel.name}" in sources["opencl"]
    for dialect in ("cuda", "hip"):
        assert f'extern "C" __global__ void __launch_bounds__(256) {kernel.name}(' in sources[dialect]
    body = {name: s[s.index(kernel.name):] for name, s in sources.items()}
    assert "__dp4a(" in body["cuda"] and "dot4_i8" not in body["cuda"]
    assert "sdot4_i8(" in body["hip"] and "__builtin_amdgcn_sdot4" in sources["hip"]
    assert "hip/hip_runtime.h" in sources["hip"] and "cuda_fp16.h" in sources["cuda"]
    assert "dot4_i8(" in body["opencl"] and "static inline int dot4_i8(" in sources["opencl"]
    assert "get_group_id" in body["opencl"] and "blockIdx" in body["cuda"] and "blockIdx" in body["hip"]
    skeletons = {name: _skeleton(s, kernel) for name, s in sources.items()}
    assert len(skeletons["opencl"]) > 20 and sum(map(len, skeletons["opencl"])) > 100
    assert skeletons["opencl"] == skeletons["cuda"] == skeletons["hip"], "kernel statements differ across dialects"


def test_symbolic_sizes_become_int_params_and_launch_expressions():
    plan = _plan("matmul_f32_5_rows")
    launches = [l for s in plan.steps for l in s.launches]
    assert all(l.ints == ("n_T",) for l in launches)
    for t, chosen in ((1, 0), (16, 0), (17, 1), (40, 1)):  # the GEMV up to 16 rows, then the tiled GEMM
        assert [bool(compile_expr(l.when)({"n_T": t})) for l in launches] == [i == chosen for i in range(2)], t
    env = {"n_T": 40}
    assert tuple(compile_expr(g)(env) for g in launches[1].groups) == (3, 2, 1)


def test_plan_round_trips_through_json():
    plan = _plan("fused_attention_gated_persist")
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.steps == [s for s in plan.steps if s.launches]
    assert (again.aliases, again.temps, again.checks) == (plan.aliases, plan.temps, plan.checks)


@pytest.mark.parametrize("text", ["__import__('os')", "n_T.real", "open('x')", "1.5", "[1][0]"])
def test_size_expressions_are_integer_arithmetic_only(text):
    with pytest.raises(ValueError):
        compile_expr(text)


def test_cache_write_is_in_place_unless_the_old_cache_is_read():
    in_place, copy = _plan("kv_write_in_place"), _plan("kv_write_copy")
    assert in_place.aliases == {"kv_write": "cache"}
    assert [l.kernel.split("_")[0] for s in copy.steps for l in s.launches][:2] == ["copy", "kv"]


def test_conv_state_of_one_row_is_shifted_in_place():
    in_place = _plan("causal_conv1d_T1_in_place")
    (conv,) = [l for s in in_place.steps for l in s.launches]
    assert in_place.aliases == {"causal_conv1d.1": "state"} and "state" not in conv.buffers
    (conv,) = [l for s in _plan("causal_conv1d_T1_f32").steps for l in s.launches]
    assert "state" in conv.buffers  # the new state is an output: the old one is not overwritten


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_recurrent_state_is_updated_in_place_unless_it_is_an_output(profile):
    in_place = lower(case_graph(CASES["gated_delta_rule_in_place_dv24"].build()), profile)
    copy = lower(case_graph(CASES["gated_delta_rule_tiled"].build()), profile)
    (gdn,) = [l for s in in_place.steps for l in s.launches if l.kernel.startswith("gated_delta_rule")]
    assert in_place.aliases == {"gated_delta_rule.1": "state"}
    assert "state" not in gdn.buffers and "gated_delta_rule.1" in gdn.buffers
    (gdn,) = [l for s in copy.steps for l in s.launches if l.kernel.startswith("gated_delta_rule")]
    assert not copy.aliases and "state" in gdn.buffers


def test_reshape_is_a_view_and_identical_nodes_share_a_kernel():
    b = GraphBuilder("g")
    x = b.input("x", DType.F32, ("T", 12))
    y = b.exp(b.reshape(x, shape=("T", 3, 4)))
    b.output("out", b.add(b.exp(b.reshape(y, shape=("T", 12))), x))
    plan = lower(b.build())
    assert set(plan.aliases) == {"reshape", "reshape_1"}
    exps = [l.kernel for s in plan.steps for l in s.launches if l.kernel.startswith("exp")]
    assert len(exps) == 2 and len(set(exps)) == 1  # same element count: the same kernel
    assert len(plan.kernels) == 2


def test_a_product_tree_is_built_once_for_all_layers_as_a_fresh_build_would_be(tiny_pair, monkeypatch):
    """KernelSpec.emit_memoised: the CPU tiles of a 4-layer decode build each distinct body
    once, and the memoised plan equals one whose every body is built afresh."""
    graph = open_pair(*tiny_pair("qwen35", "q8_0")).graphs["target.decode"]
    built, real = [], linalg._tiles

    def counted(kb, bufs, *key):
        built.append(key)
        real(kb, bufs, *key)

    monkeypatch.setattr(linalg, "_tiles", counted)
    memoised = lower(graph, "cpu")
    tiles = [l for s in memoised.steps for l in s.launches if l.kernel.startswith("matmul_tiles")]
    assert len(built) == len(set(built)) < len(tiles)
    monkeypatch.setattr(lowering, "_memoised_body", lowering._memoised_body.__wrapped__)
    fresh = lower(graph, "cpu")
    assert len(built) == len(set(built)) + len(tiles)
    assert fresh.steps == memoised.steps and fresh.kernels == memoised.kernels


def test_weight_only_nodes_are_constant_steps():
    plan = _plan("matmul_dequantized_weight")
    assert [(s.launches[0].kernel.split("_")[0], s.constant) for s in plan.steps] == [("dequantize", True),
                                                                                   ("matmul", False)]


def test_fused_ops_lower_through_their_parts():
    plan = _plan("fused_moe_f16_experts")  # (Q8_0 experts have fused kernels: test_moe_launches.py)
    ops = [l.kernel.rsplit("_", 1)[0] for s in plan.steps for l in s.launches]
    assert ops.count("expert_matmul") == 3 and "topk" in ops and plan.temps


def test_cuda_and_rocm_say_why_they_cannot_run():
    np.testing.assert_equal(get_backend("cuda").unavailable_reason() is None, _has_cupy_gpu())
    for name, words in (("cuda", "no CUDA GPU"), ("rocm", "no ROCm GPU")):
        reason = get_backend(name).unavailable_reason()
        if reason:
            assert words in reason and "cupy" in reason
            with pytest.raises(BackendUnavailable, match=words):
                get_backend(name).require()


def test_rocm_compile_names_the_missing_toolchain(monkeypatch, tmp_path):
    from dflash_ir.backends import rocm

    monkeypatch.setattr(rocm, "find_hip", lambda: "HIP toolchain incomplete, missing the ROCm device libraries")
    with pytest.raises(BackendUnavailable, match="cannot compile for rocm: HIP toolchain incomplete"):
        get_backend("rocm").compile(case_graph(CASES["neg_odd"].build()), tmp_path)


def test_elf_reader_rejects_other_files():
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        elf_functions(b"__CLANG_OFFLOAD_BUNDLE__")


def _has_cupy_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0 and not cupy.cuda.runtime.is_hip
    except Exception:
        return False


@pytest.mark.parametrize("capability, chosen", [("90", "k.sm_90.cubin"), ("86", "k.sm_80.cubin"),
                                                ("89", "k.sm_89.cubin"), ("100", "k.ptx")])
def test_cuda_loads_the_cubin_of_the_device(monkeypatch, tmp_path, capability, chosen):
    """A cubin runs on its major version with an equal or newer minor; anything else JITs the PTX."""
    import sys
    import types

    from dflash_ir.backends import cupy_device

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(
        compute_capability=capability, id=0)), RawModule=lambda path: path)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(cupy_device, "_module", lambda path: path)
    entry = {"cubin": {a: f"k.{a}.cubin" for a in ("sm_80", "sm_89", "sm_90")}, "ptx": "k.ptx"}
    for name in (*entry["cubin"].values(), entry["ptx"]):
        (tmp_path / name).write_bytes(b"")  # loading opens only the artifact's own regular files
    device = get_backend("cuda").device_for(entry, tmp_path)
    assert device.module == str(tmp_path / chosen)


def test_opencl_says_what_to_install(monkeypatch):
    import sys

    pyopencl = pytest.importorskip("pyopencl")
    monkeypatch.setattr(pyopencl, "get_platforms", lambda: [])
    assert "pocl-opencl-icd" in get_backend("opencl").unavailable_reason()
    monkeypatch.setitem(sys.modules, "pyopencl", None)
    assert get_backend("opencl").unavailable_reason() == "pyopencl is not installed (pip install pyopencl)"

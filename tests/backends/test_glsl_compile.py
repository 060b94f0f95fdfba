"""Compile-only, no Vulkan device: every kernel rendered as GLSL (backends/glsl.py) compiles to
SPIR-V that spirv-val accepts, under the FULL and BASELINE feature sets, and the SPIR-V has
the interface the Vulkan runtime binds (read back from the binary: set 0, binding i = buffer
i, readonly when not written, ints as push constants at 4 * i, the work-group size, entry
`main`) and needs no capability beyond the variant's device features. Skipped without
glslangValidator and spirv-val (Debian packages glslang-tools and spirv-tools)."""
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.backends import glsl
from dflash_ir.backends.cstyle import Buffer, Kernel
from dflash_ir.backends.glsl import BASELINE, FULL, UnsupportedKernel, compile_spirv, render_glsl
from dflash_ir.backends.lowering import PROFILES, lower
from dflash_ir.backends.selftest import CASES, case_graph
from dflash_ir.backends.toolchain import CompileError

VARIANTS = {"full": FULL, "baseline": BASELINE}


@pytest.fixture(scope="session")
def spirv_tools():
    missing = glsl.glsl_tools_missing()
    if missing:
        pytest.skip(missing)


# -- reading SPIR-V back ----------------------------------------------------------------
# opcodes, decorations, storage classes and capabilities of the SPIR-V 1.3 specification
OP_NAME, OP_MEMBER_NAME, OP_CAPABILITY, OP_ENTRY_POINT, OP_EXECUTION_MODE = 5, 6, 17, 15, 16
OP_TYPE_POINTER, OP_VARIABLE, OP_DECORATE, OP_MEMBER_DECORATE = 32, 59, 71, 72
LOCAL_SIZE, NON_WRITABLE, BINDING, DESCRIPTOR_SET, OFFSET = 17, 24, 33, 34, 35
WORKGROUP, PUSH_CONSTANT, STORAGE_BUFFER = 4, 9, 12
GL_COMPUTE = 5
# SPIR-V capability -> the device feature or compute-stage subgroup operation it needs (None: every device)
CAPABILITY_FEATURE = {1: None, 11: "shaderInt64", 22: "shaderInt16", 39: "shaderInt8",
                      4433: "storageBuffer16BitAccess", 4448: "storageBuffer8BitAccess",
                      61: "VK_SUBGROUP_FEATURE_BASIC_BIT", 63: "VK_SUBGROUP_FEATURE_ARITHMETIC_BIT"}


def _string(words) -> str:
    raw = struct.pack(f"<{len(words)}I", *words)
    return raw[:raw.index(b"\0")].decode()


def spirv_interface(code: bytes) -> dict:
    """Entry points, local size, capabilities, storage-buffer bindings, push-constant members
    and work-group variables of a SPIR-V module."""
    words = struct.unpack(f"<{len(code) // 4}I", code)
    assert words[0] == 0x07230203, "not SPIR-V"
    names, member_names, decorations, member_decorations = {}, {}, {}, {}
    pointers, variables, info = {}, [], {"entry_points": [], "capabilities": set()}
    at = 5
    while at < len(words):
        op, count = words[at] & 0xFFFF, words[at] >> 16
        args = words[at + 1:at + count]
        at += count
        if op == OP_NAME:
            names[args[0]] = _string(args[1:])
        elif op == OP_MEMBER_NAME:
            member_names[args[0], args[1]] = _string(args[2:])
        elif op == OP_CAPABILITY:
            info["capabilities"].add(args[0])
        elif op == OP_ENTRY_POINT:
            info["entry_points"].append((args[0], _string(args[2:])))
        elif op == OP_EXECUTION_MODE and args[1] == LOCAL_SIZE:
            info["local"] = tuple(args[2:5])
        elif op == OP_DECORATE:
            decorations.setdefault(args[0], {})[args[1]] = args[2:]
        elif op == OP_MEMBER_DECORATE:
            member_decorations.setdefault((args[0], args[1]), {})[args[2]] = args[3:]
        elif op == OP_TYPE_POINTER:
            pointers[args[0]] = args[2]
        elif op == OP_VARIABLE:
            variables.append((pointers.get(args[0]), args[1], args[2]))
    buffers, push, shared = {}, [], set()
    for block, var, storage in variables:
        if storage == STORAGE_BUFFER:
            d = decorations[var]
            readonly = NON_WRITABLE in member_decorations.get((block, 0), {})
            buffers[d[BINDING][0]] = (d[DESCRIPTOR_SET][0], member_names[block, 0], readonly)
        elif storage == PUSH_CONSTANT:
            members = sorted(m for (b, m) in member_names if b == block)
            push = [(member_names[block, m], member_decorations[block, m][OFFSET][0]) for m in members]
        elif storage == WORKGROUP:
            shared.add(names[var])
    return {**info, "buffers": buffers, "push_constants": push, "shared": shared}


def _glsl_name(name: str) -> str:
    return "out_" if name == "out" else name  # `out` is a GLSL keyword


def check_interface(kernel: Kernel, features, code: bytes) -> None:
    spv = spirv_interface(code)
    assert spv["entry_points"] == [(GL_COMPUTE, "main")]
    assert spv["local"] == kernel.local
    assert spv["buffers"] == {i: (0, _glsl_name(b.name), not b.writes) for i, b in enumerate(kernel.buffers)}
    assert spv["push_constants"] == [(n, 4 * i) for i, n in enumerate(kernel.ints)]
    needed = {CAPABILITY_FEATURE[c] for c in spv["capabilities"]} - {None}
    assert needed <= set(features.required_device_features()) | set(features.required_subgroup_operations()), \
        kernel.name


def compile_and_check(kernels, features) -> None:
    def one(kernel):
        check_interface(kernel, features, compile_spirv(render_glsl(kernel, features), name=kernel.name))

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(one, kernels))


# -- every kernel -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def selftest_kernels():
    """Every op and variant the lowering produces, for every device profile."""
    kernels = {}
    for profile in PROFILES:
        for c in CASES.values():
            kernels.update(lower(case_graph(c.build()), profile).kernels)
    return list(kernels.values())


@pytest.fixture(scope="module")
def model_kernels(tiny_pair):
    """The kernels of the verify and draft-block programs of a generated Q8_0 MoE pair."""
    pair = open_pair(*tiny_pair("qwen35moe", "q8_0"))
    kernels = {}
    for name in ("target.verify", "draft.block"):
        kernels.update(lower(pair.graphs[name]).kernels)
    return list(kernels.values())


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_selftest_kernel_compiles(spirv_tools, selftest_kernels, variant):
    compile_and_check(selftest_kernels, VARIANTS[variant])


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_model_kernel_compiles(spirv_tools, model_kernels, variant):
    compile_and_check(model_kernels, VARIANTS[variant])


def test_variants_differ_in_what_they_require(spirv_tools, selftest_kernels):
    """FULL really uses its features (so BASELINE is the one to run without them)."""
    q8 = next(k for k in selftest_kernels if k.op == "dequantize" and k.buffers[0].ctype == "u8")
    full = spirv_interface(compile_spirv(render_glsl(q8, FULL), name=q8.name))["capabilities"]
    assert {CAPABILITY_FEATURE[c] for c in full} == {None, "shaderInt64", "shaderInt8", "storageBuffer8BitAccess"}
    base = spirv_interface(compile_spirv(render_glsl(q8, BASELINE), name=q8.name))["capabilities"]
    assert base == {1}
    assert FULL.required_device_features() == ("storageBuffer8BitAccess", "storageBuffer16BitAccess",
                                               "shaderInt64", "shaderInt8")
    assert BASELINE.required_device_features() == BASELINE.required_device_extensions() == ()


def test_full_variant_reduces_work_groups_with_subgroup_arithmetic(spirv_tools, selftest_kernels):
    """A work-group reduction (softmax: a max, then a sum) is subgroup arithmetic in FULL and
    a barrier tree in BASELINE; the numerics of both run on lavapipe in test_vulkan_kernels."""
    softmax = next(k for k in selftest_kernels if k.op == "softmax" and "WG_MAX" in k.body)
    full = spirv_interface(compile_spirv(render_glsl(softmax, FULL), name=softmax.name))["capabilities"]
    assert {"VK_SUBGROUP_FEATURE_BASIC_BIT", "VK_SUBGROUP_FEATURE_ARITHMETIC_BIT"} <= {CAPABILITY_FEATURE[c] for c in full}
    assert set(FULL.required_subgroup_operations()) == {"VK_SUBGROUP_FEATURE_BASIC_BIT",
                                                        "VK_SUBGROUP_FEATURE_ARITHMETIC_BIT"}
    base = spirv_interface(compile_spirv(render_glsl(softmax, BASELINE), name=softmax.name))["capabilities"]
    assert not {61, 63} & base and BASELINE.required_subgroup_operations() == ()


# -- the translation --------------------------------------------------------------------
def _kernel(body: str, buffers=(("x", "float", False), ("out", "float", True)), ints=(), local=(64, 1, 1)):
    return Kernel.make("probe", [Buffer(*b) for b in buffers], ints, local, body)


def _main(source: str) -> str:
    return source[source.index("void main()"):]


def test_shared_arrays_move_to_module_scope(spirv_tools):
    k = _kernel("  int lid = LID(0);\n  LOCAL float red[64];\n  LOCAL int at[64];\n  red[lid] = x[lid];\n"
                "  at[lid] = lid;\n  BARRIER();\n  if (lid == 0) out[GID(0)] = red[63] + F32(at[5]);\n")
    for features in VARIANTS.values():
        source = render_glsl(k, features)
        assert "shared float red[64];\nshared int at[64];\n" in source[:source.index("void main()")]
        assert "LOCAL" not in source and "red[64]" not in _main(source)
        assert spirv_interface(compile_spirv(source, name=k.name))["shared"] == {"red", "at"}


@pytest.mark.parametrize("line", ["  LOCAL float red[n_T];\n", "  LOCAL float a[4], b[4];\n"])
def test_shared_arrays_need_one_constant_size(line):
    with pytest.raises(UnsupportedKernel, match="LOCAL arrays"):
        render_glsl(_kernel(line + "  out[0] = 1.0f;\n", ints=("n_T",)), FULL)


def test_ints_are_push_constants_and_buffers_bind_in_order(spirv_tools):
    buffers = (("w", "u8", False), ("pos", "int", False), ("out", "u16", True), ("idx", "int", True))
    k = _kernel("  int i = GID(0) * 64 + LID(0);\n  if (i >= n_T * n_S) return;\n"
                "  idx[i] = pos[0] + LD_U8(w, i);\n  STORE_HALF(out, i, F32(LD_I8(w, I64(i) + n_S)));\n",
                buffers=buffers, ints=("n_S", "n_T"))
    for features in VARIANTS.values():
        spv = spirv_interface(compile_spirv(render_glsl(k, features), name=k.name))
        assert spv["buffers"] == {0: (0, "w", True), 1: (0, "pos", True), 2: (0, "out_", False), 3: (0, "idx", False)}
        assert spv["push_constants"] == [("n_S", 0), ("n_T", 4)]
        assert spv["local"] == (64, 1, 1)


def test_buffer_subscripts_become_uint_nested_ones_too():
    k = _kernel("  i64 o = I64(GID(0)) * 3;\n  out[o] = x[o + I64(x[o + 1])];\n")
    main = _main(render_glsl(k, FULL))
    assert "out_[uint(o)] = x[uint(o + I64(x[uint(o + 1)]))];" in main


def test_casts_follow_the_features():
    """64-bit offsets only where the device has shaderInt64; I8 sign-extends either way."""
    k = _kernel("  i64 o = I64(GID(0)) * 3;\n  out[o] = F32(I8(I32(x[o])));\n")
    full, base = render_glsl(k, FULL), render_glsl(k, BASELINE)
    assert "#define i64 int64_t" in full and "#define I64(x) int64_t(x)" in full
    assert "#define i64 int\n" in base and "#define I64(x) int(x)" in base
    assert all("#define I8(x) bitfieldExtract(int(x), 0, 8)" in s for s in (full, base))


def test_narrow_buffers_are_only_read_through_macros():
    k = _kernel("  out[GID(0)] = F32(x[GID(0)]);\n", buffers=(("x", "u16", False), ("out", "float", True)))
    with pytest.raises(UnsupportedKernel, match="'x' of 8/16-bit elements is subscripted"):
        render_glsl(k, FULL)


def test_pointers_are_not_part_of_the_subset():
    k = _kernel("  GLOBAL const float* xr = x + GID(0);\n  out[GID(0)] = xr[0];\n")
    with pytest.raises(UnsupportedKernel, match="GLOBAL is C-only"):
        render_glsl(k, FULL)


def test_64_bit_buffers_need_int64(spirv_tools):
    k = _kernel("  out[GID(0)] = F32(x[GID(0)]);\n", buffers=(("x", "i64", False), ("out", "float", True)))
    with pytest.raises(UnsupportedKernel, match="shaderInt64"):
        render_glsl(k, BASELINE)
    check_interface(k, FULL, compile_spirv(render_glsl(k, FULL), name=k.name))


def test_compile_errors_name_the_kernel(spirv_tools):
    with pytest.raises(CompileError, match=r"(?s)broken_probe: glslangValidator failed.*undeclared_thing"):
        compile_spirv("#version 450\nvoid main() { undeclared_thing = 1; }\n", name="broken_probe")


def test_a_missing_compiler_names_the_debian_package(monkeypatch):
    monkeypatch.setattr(glsl.shutil, "which", lambda name: None)
    glsl._tool.cache_clear()
    try:
        with pytest.raises(glsl.GLSLToolMissing, match="Debian package glslang-tools"):
            compile_spirv("#version 450\nvoid main() {}\n", name="probe")
        assert "glslang-tools" in glsl.glsl_tools_missing()
    finally:
        glsl._tool.cache_clear()

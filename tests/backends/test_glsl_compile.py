"""Compile-only, no Vulkan device: every kernel printed as GLSL (backends/kir/glsl.py) compiles
to SPIR-V that spirv-val accepts, under the FULL and BASELINE feature sets, and the SPIR-V has
the interface the Vulkan runtime binds (read back from the binary: set 0, binding i = buffer
i, readonly when not written, ints as push constants at 4 * i, the work-group size, entry
`main`) and needs no capability beyond the variant's device features. Skipped without
glslangValidator and spirv-val (Debian packages glslang-tools and spirv-tools)."""
import os
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest

from dflash_ir.artifact import open_pair
from dflash_ir.backends import spirv
from dflash_ir.backends.kir import F32, I32, I64, KernelBuilder, cast, var
from dflash_ir.backends.kir.glsl import BASELINE, FULL, UnsupportedKernel, render_glsl
from dflash_ir.backends.kir.ir import Kernel, walk
from dflash_ir.backends.lowering import PROFILES, lower
from kernel_cases import CASES, case_graph
from dflash_ir.backends.spirv import compile_spirv
from dflash_ir.backends.toolchain import CompileError

VARIANTS = {"full": FULL, "baseline": BASELINE}


@pytest.fixture(scope="session")
def spirv_tools():
    missing = spirv.spirv_tools_missing()
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
    for block, variable, storage in variables:
        if storage == STORAGE_BUFFER:
            d = decorations[variable]
            readonly = NON_WRITABLE in member_decorations.get((block, 0), {})
            buffers[d[BINDING][0]] = (d[DESCRIPTOR_SET][0], member_names[block, 0], readonly)
        elif storage == PUSH_CONSTANT:
            members = sorted(m for (b, m) in member_names if b == block)
            push = [(member_names[block, m], member_decorations[block, m][OFFSET][0]) for m in members]
        elif storage == WORKGROUP:
            shared.add(names[variable])
    return {**info, "buffers": buffers, "push_constants": push, "shared": shared}


def _glsl_name(name: str) -> str:
    return name + "_" if name in ("out", "in", "input", "output", "buffer", "shared") else name  # GLSL keywords


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
    assert [p.ctype for p in q8.buffers] == ["u8", "f32"]
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
    softmax = next(k for k in selftest_kernels if k.op == "softmax")
    assert [n.arg[2] for n in walk(softmax.body) if n.op == "wg_reduce"] == ["max", "sum"]
    assert {"VK_SUBGROUP_FEATURE_BASIC_BIT", "VK_SUBGROUP_FEATURE_ARITHMETIC_BIT"} <= _capabilities(softmax, FULL)
    assert set(FULL.required_subgroup_operations()) == {"VK_SUBGROUP_FEATURE_BASIC_BIT",
                                                        "VK_SUBGROUP_FEATURE_ARITHMETIC_BIT"}
    base = spirv_interface(compile_spirv(render_glsl(softmax, BASELINE), name=softmax.name))["capabilities"]
    assert not {61, 63} & base and BASELINE.required_subgroup_operations() == ()


# -- the translation --------------------------------------------------------------------
def _builder(buffers=(("x", "f32", False), ("out", "f32", True)), local=(64,)):
    kb = KernelBuilder("probe", local=local)
    return kb, [kb.buffer(*b) for b in buffers]


def _main(source: str) -> str:
    return source[source.index("void main()"):]


def _capabilities(kernel: Kernel, features) -> set:
    code = compile_spirv(render_glsl(kernel, features), name=kernel.name)
    return {CAPABILITY_FEATURE[c] for c in spirv_interface(code)["capabilities"]}


def test_shared_arrays_move_to_module_scope(spirv_tools):
    """Work-group arrays, wherever the tree declares them, are `shared` at module scope."""
    kb, (x, out) = _builder()
    lid = kb.let("lid", kb.lid(0))
    red = kb.array("red", F32, 64, "local")
    red[lid] = x[lid]
    at = kb.array("at", I32, 64, "local")  # declared after a statement
    at[lid] = lid
    kb.barrier()
    with kb.if_(lid.eq(0)):
        out[kb.gid(0)] = red[63] + cast(F32, at[5])
    k = kb.build()
    for features in VARIANTS.values():
        source = render_glsl(k, features)
        assert "shared float red[64];\nshared int at[64];\n" in source[:source.index("void main()")]
        assert "red[64]" not in _main(source) and "at[64]" not in _main(source)
        assert spirv_interface(compile_spirv(source, name=k.name))["shared"] == {"red", "at"}


def test_glsl_keywords_are_renamed_everywhere(spirv_tools):
    """Buffers, variables, loop variables and arrays named like GLSL keywords (C names)."""
    kb, (x, out) = _builder((("input", "f32", False), ("out", "f32", True)))
    lid = kb.let("lid", kb.lid(0))
    shared = kb.array("shared", F32, 64, "local")
    sample = kb.array("sample", F32, 4)
    filt = kb.let("filter", 0.0)
    with kb.loop("half", 0, 4) as h:
        sample[h] = x[lid * 4 + h]
        kb.set(filt, filt + sample[h])
    shared[lid] = filt
    kb.barrier()
    out[lid] = shared[63 - lid]
    k = kb.build()
    for features in VARIANTS.values():
        source = render_glsl(k, features)
        main = _main(source)
        for name in ("input", "out", "shared", "sample", "filter", "half"):
            assert f"{name}_" in source
        assert "float filter_ = 0.0;" in main and "for (int half_ = 0; half_ < 4; ++half_)" in main
        assert "shared float shared_[64];" in source and "float sample_[4];" in main
        spv = spirv_interface(compile_spirv(source, name=k.name))
        assert spv["buffers"] == {0: (0, "input_", True), 1: (0, "out_", False)} and spv["shared"] == {"shared_"}


def test_ints_are_push_constants_and_buffers_bind_in_order(spirv_tools):
    kb, (w, pos, out, idx) = _builder((("w", "u8", False), ("pos", "i32", False), ("out", "u16", True),
                                       ("idx", "i32", True)))
    n_s, n_t = var("n_S"), var("n_T")
    i = kb.let("i", kb.gid(0) * 64 + kb.lid(0))
    kb.return_if(i >= n_t * n_s)
    idx[i] = pos[0] + w.load(i, "u8")
    out.store(i, cast(F32, w.load(cast(I64, i) + n_s, "i8")), "f16")
    k = kb.build(["n_S", "n_T"])
    assert k.ints == ("n_S", "n_T")
    for features in VARIANTS.values():
        spv = spirv_interface(compile_spirv(render_glsl(k, features), name=k.name))
        assert spv["buffers"] == {0: (0, "w", True), 1: (0, "pos", True), 2: (0, "out_", False), 3: (0, "idx", False)}
        assert spv["push_constants"] == [("n_S", 0), ("n_T", 4)]
        assert spv["local"] == (64, 1, 1)


def test_buffer_subscripts_become_uint_nested_ones_too():
    kb, (x, out) = _builder()
    o = kb.let("o", cast(I64, kb.gid(0)) * 3)
    out[o] = x[o + cast(I64, x[o + 1])]
    k = kb.build()
    assert "out_[uint(o)] = x[uint(o + int64_t(x[uint(o + 1l)]))];" in _main(render_glsl(k, FULL))
    assert "out_[uint(o)] = x[uint(o + int(x[uint(o + 1)]))];" in _main(render_glsl(k, BASELINE))


def test_i64_is_int64_t_only_with_int64(spirv_tools):
    """64-bit offsets only where the device has shaderInt64; a byte read as int8 is sign
    extended either way (with int8 arithmetic in FULL, bitfieldExtract in BASELINE; the
    values are checked on a device in test_glsl_numerics)."""
    kb, (q, out) = _builder((("q", "u8", False), ("out", "f32", True)))
    o = kb.let("o", cast(I64, kb.gid(0)) * 3)
    out[o] = cast(F32, q.load(o, "i8"))
    k = kb.build()
    full, base = _main(render_glsl(k, FULL)), _main(render_glsl(k, BASELINE))
    assert "int64_t o = int64_t(int(gl_WorkGroupID.x)) * 3l;" in full and "int(int8_t(q[uint(o)]))" in full
    assert "int o = int(int(gl_WorkGroupID.x)) * 3;" in base and "int64_t" not in base
    assert "bitfieldExtract(int(q[uint(o) / 4u]), int((uint(o) % 4u) * 8u), 8)" in base
    assert {"shaderInt64", "shaderInt8"} <= _capabilities(k, FULL)
    assert _capabilities(k, BASELINE) == {None}


def test_narrow_buffers_are_packed_words_in_baseline(spirv_tools):
    """Without 8/16-bit storage a narrow buffer is uint words: loads shift and mask, stores
    change only their own bits with atomics (neighbouring invocations share a word)."""
    kb, (h, b, o8, o16) = _builder((("h", "u16", False), ("b", "u8", False), ("o8", "u8", True),
                                     ("o16", "u16", True)))
    i = kb.let("i", kb.gid(0) * 64 + kb.lid(0))
    o8[i] = b[i] + h.load(i, "u16")
    o16.store(i, h.load(i, "f16") * 2.0, "f16")
    k = kb.build()
    base, full = render_glsl(k, BASELINE), render_glsl(k, FULL)
    for name in ("h", "b", "o8", "o16"):
        assert f"{{ uint {name}[]; }};" in base
    assert "uint8_t" not in base and "uint16_t" not in base
    main = _main(base)
    assert main.count("bitfieldExtract(") == 3 and main.count("atomicAnd(") == main.count("atomicOr(") == 2
    assert "o8[uint(" not in main and "o16[uint(" not in main  # never a whole-word store
    assert "{ uint8_t b[]; }" in full and "{ uint16_t o16[]; }" in full and "atomic" not in _main(full)
    assert _capabilities(k, BASELINE) == {None}
    assert {"storageBuffer8BitAccess", "storageBuffer16BitAccess"} <= _capabilities(k, FULL)


def test_views_must_fit_the_buffer():
    """A byte or u16 view exists only of narrow buffers (a Q8_0 block's bytes)."""
    kb, (x, out) = _builder()
    out[kb.gid(0)] = cast(F32, x.load(kb.gid(0), "i8"))
    with pytest.raises(UnsupportedKernel, match="byte view of a f32 buffer 'x'"):
        render_glsl(kb.build(), FULL)


def test_64_bit_buffers_need_int64(spirv_tools):
    kb, (x, out) = _builder((("x", "i64", False), ("out", "f32", True)))
    out[kb.gid(0)] = cast(F32, x[kb.gid(0)])
    k = kb.build()
    with pytest.raises(UnsupportedKernel, match="shaderInt64"):
        render_glsl(k, BASELINE)
    check_interface(k, FULL, compile_spirv(render_glsl(k, FULL), name=k.name))


def test_compile_errors_name_the_kernel(spirv_tools):
    with pytest.raises(CompileError, match=r"(?s)broken_probe: glslangValidator failed.*undeclared_thing"):
        compile_spirv("#version 450\nvoid main() { undeclared_thing = 1; }\n", name="broken_probe")


def test_a_missing_compiler_names_the_debian_package(monkeypatch):
    monkeypatch.setattr(spirv.shutil, "which", lambda name: None)
    spirv._tool.cache_clear()
    try:
        with pytest.raises(spirv.GLSLToolMissing, match="Debian package glslang-tools"):
            compile_spirv("#version 450\nvoid main() {}\n", name="probe")
        assert "glslang-tools" in spirv.spirv_tools_missing()
    finally:
        spirv._tool.cache_clear()

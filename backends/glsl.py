"""GLSL 4.50 compute shaders for Vulkan from the neutral kernels of cstyle.py, and SPIR-V.

One kernel is one shader. The body is the kernel's neutral C text, unchanged but for three
mechanical steps: work-group arrays (`LOCAL float red[N];`) move to module scope as
`shared`, identifiers that are GLSL keywords (`out`) get a trailing underscore, and buffer
subscripts become `uint` (GLSL indexes with 32-bit scalars; offsets may be 64-bit). The
vocabulary macros get GLSL meanings chosen by the device's features (`GLSLFeatures`).

Interface with the runtime (backends/vulkan.py relies on it):
- descriptor set 0, binding i = kernel.buffers[i], a std430 storage buffer (`readonly`
  when the kernel does not write it); byte sizes are padded to a multiple of 4;
- a push-constant block holding kernel.ints in order, each an `int` at offset 4 * i;
- entry point `main`; the work-group size is kernel.local, the dispatch the plan's groups.
Indices are 32-bit in GLSL: a buffer holds at most 2^32 - 1 elements (2^31 bytes without
int64, see GLSLFeatures).

Precision: the f16 conversions, roundf, log1pf, sinf and cosf are helpers written here
(exact, or within a few ulp) instead of built-ins whose precision Vulkan leaves loose
(sin/cos: 2^-11 absolute; round: ties either way; packHalf2x16: rounding unspecified).
exp, log, sqrt and division are the built-ins (3 + 2|x| ulp, 3 ulp, 3 ulp and 2.5 ulp).
"""
from __future__ import annotations

import functools
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .cstyle import DERIVED, HELPERS, Kernel
from .toolchain import CompileError, cached_build

TARGET_ENV = "vulkan1.1"  # SPIR-V 1.3: 16-bit storage is core there, 8-bit storage an extension


@dataclass(frozen=True)
class GLSLFeatures:
    """What a shader may use beyond core Vulkan 1.1 with 32-bit storage:
    storage8 / storage16  8- and 16-bit SSBO elements (else packed in uint words);
    int64                 64-bit buffer offsets (else `i64` is `int`: the runtime must then
                          refuse buffers of 2^31 bytes or more);
    float16_int8          int8 arithmetic (sign extension of loaded quants);
    subgroups             subgroup arithmetic for work-group reductions (else barrier trees)."""

    storage8: bool = False
    storage16: bool = False
    int64: bool = False
    float16_int8: bool = False
    subgroups: bool = False

    def required_device_features(self) -> tuple[str, ...]:
        """The VkPhysicalDevice*Features members this variant needs enabled."""
        wanted = (("storage8", "storageBuffer8BitAccess"), ("storage16", "storageBuffer16BitAccess"),
                  ("int64", "shaderInt64"), ("float16_int8", "shaderInt8"))
        return tuple(name for flag, name in wanted if getattr(self, flag))

    def required_device_extensions(self) -> tuple[str, ...]:
        """Device extensions that provide those features on Vulkan 1.1 (core from 1.2)."""
        wanted = (("storage8", "VK_KHR_8bit_storage"), ("float16_int8", "VK_KHR_shader_float16_int8"))
        return tuple(name for flag, name in wanted if getattr(self, flag))

    def required_subgroup_operations(self) -> tuple[str, ...]:
        """VkSubgroupFeatureFlagBits names the shaders need in the compute stage."""
        return ("VK_SUBGROUP_FEATURE_BASIC_BIT", "VK_SUBGROUP_FEATURE_ARITHMETIC_BIT") if self.subgroups else ()


FULL = GLSLFeatures(storage8=True, storage16=True, int64=True, float16_int8=True, subgroups=True)
BASELINE = GLSLFeatures()


class UnsupportedKernel(ValueError):
    """A kernel the GLSL renderer cannot express under the given features."""


# GLSL keywords a C kernel may use as an identifier; renamed with a trailing underscore
_KEYWORDS = frozenset(
    "out in inout buffer shared sample input output filter common partition active half fixed long short "
    "packed namespace using class union enum typedef template this resource goto inline noinline public "
    "static extern external interface unsigned sizeof cast precise patch smooth flat noperspective "
    "centroid coherent volatile restrict readonly writeonly subroutine invariant attribute varying layout "
    "uniform lowp mediump highp precision superp".split())

_SHARED = re.compile(r"^[ \t]*LOCAL[ \t]+(\w+)[ \t]+(\w+)[ \t]*\[(\d+)\][ \t]*;[ \t]*\n", re.M)
_C_ONLY = re.compile(r"\b(GLOBAL|i8|u8|u16)\b")


def render_glsl(kernel: Kernel, features: GLSLFeatures) -> str:
    """The compute shader of one kernel under `features` (see the module docstring)."""
    from .kir import glsl as tree_glsl
    from .kir.ir import Kernel as TreeKernel

    if isinstance(kernel, TreeKernel):
        return tree_glsl.render_glsl(kernel, tree_glsl.GLSLFeatures(**vars(features)))
    body, shared = _hoist_shared(kernel)
    names = {b.name: _glsl_name(b.name) for b in kernel.buffers}
    body = _rename_keywords(body)
    narrow = [names[b.name] for b in kernel.buffers if b.ctype in ("u8", "u16")]
    for name in narrow:
        if re.search(rf"\b{name}\s*\[", body):
            raise UnsupportedKernel(f"{kernel.name}: buffer {name!r} of 8/16-bit elements is subscripted; "
                                    "the neutral subset reads and writes those only through LD_/ST_ macros")
    body = _index_as_uint(body, set(names.values()) - set(narrow))
    x, y, z = kernel.local
    parts = ["#version 450", f"// kernel {kernel.name} (op {kernel.op})", *_extensions(features),
             f"layout(local_size_x = {x}, local_size_y = {y}, local_size_z = {z}) in;",
             *(_buffer_block(i, b, names[b.name], features, kernel.name) for i, b in enumerate(kernel.buffers))]
    if kernel.ints:
        members = " ".join(f"int {n};" for n in kernel.ints)
        parts.append(f"layout(push_constant, std430) uniform Ints {{ {members} }};")
    parts += [f"shared {t} {_glsl_name(n)}[{size}];" for t, n, size in shared]
    parts += [f"#define {k} {v}" for k, v in {**DERIVED, **_macros(features)}.items()]
    parts += [GLSL_HELPERS.strip(), HELPERS.strip(), f"void main() {{\n{body.rstrip()}\n}}\n"]
    return "\n".join(parts)


def _hoist_shared(kernel: Kernel) -> tuple[str, list[tuple[str, str, str]]]:
    shared = _SHARED.findall(kernel.body)
    body = _SHARED.sub("", kernel.body)
    if re.search(r"\bLOCAL\b", body):
        raise UnsupportedKernel(f"{kernel.name}: LOCAL arrays must be declared alone on a line, "
                                "with a constant size, at the top level of the body")
    if _C_ONLY.search(body):
        raise UnsupportedKernel(f"{kernel.name}: {_C_ONLY.search(body).group(1)} is C-only, "
                                "not part of the neutral subset (no pointers, no C narrow types)")
    return body, shared


def _glsl_name(name: str) -> str:
    return name + "_" if name in _KEYWORDS else name


def _rename_keywords(body: str) -> str:
    return re.sub(r"\b[A-Za-z_]\w*\b", lambda m: _glsl_name(m.group(0)), body)


def _index_as_uint(text: str, buffers: set[str]) -> str:
    """`buf[e]` -> `buf[uint(e)]` for the buffer names, nested subscripts included."""
    if not buffers:
        return text
    pattern = re.compile(r"\b(" + "|".join(sorted(buffers)) + r")\s*\[")
    out, pos = [], 0
    while m := pattern.search(text, pos):
        depth, end = 1, m.end()
        while depth:
            depth += {"[": 1, "]": -1}.get(text[end], 0)
            end += 1
        inner = _index_as_uint(text[m.end():end - 1], buffers)
        out.append(f"{text[pos:m.start()]}{m.group(1)}[uint({inner})]")
        pos = end
    return "".join(out) + text[pos:]


def _extensions(f: GLSLFeatures) -> list[str]:
    wanted = [(f.storage8, "GL_EXT_shader_8bit_storage"), (f.storage16, "GL_EXT_shader_16bit_storage"),
              (f.int64, "GL_EXT_shader_explicit_arithmetic_types_int64"),
              (f.float16_int8, "GL_EXT_shader_explicit_arithmetic_types_int8"),
              (f.subgroups, "GL_KHR_shader_subgroup_basic"), (f.subgroups, "GL_KHR_shader_subgroup_arithmetic")]
    return [f"#extension {name} : require" for on, name in wanted if on]


def _buffer_block(binding: int, b, name: str, f: GLSLFeatures, kernel: str) -> str:
    if b.ctype == "i64" and not f.int64:
        raise UnsupportedKernel(f"{kernel}: buffer {b.name!r} holds 64-bit integers, which need the int64 "
                                "feature (shaderInt64)")
    element = {"float": "float", "int": "int", "i64": "int64_t",
               "u16": "uint16_t" if f.storage16 else "uint", "u8": "uint8_t" if f.storage8 else "uint"}[b.ctype]
    access = "" if b.writes else "readonly "
    return f"layout(set = 0, binding = {binding}, std430) {access}buffer Buffer{binding} {{ {element} {name}[]; }};"


def _macros(f: GLSLFeatures) -> dict[str, str]:
    """The vocabulary of cstyle.py in GLSL. Narrow buffers without 8/16-bit storage are uint
    words: reads shift and mask, writes change only their own bits with atomicAnd/atomicOr,
    so invocations that write neighbouring elements of one word do not race."""
    m = {
        "GID(d)": "int(gl_WorkGroupID[d])", "LID(d)": "int(gl_LocalInvocationID[d])",
        # OpenCL's barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE): all memory, work-group scope
        "BARRIER()": "{ groupMemoryBarrier(); barrier(); }",
        "DEVICE": "",
        "i64": "int64_t" if f.int64 else "int", "u32": "uint",
        "F32(x)": "float(x)", "I32(x)": "int(x)", "I64(x)": "int64_t(x)" if f.int64 else "int(x)",
        "U32(x)": "uint(x)", "I8(x)": "bitfieldExtract(int(x), 0, 8)",
        "HALF_AT(b, i)": "f16_bits_to_f32(uint(LD_U16(b, i)))",
        "HALF_AT_BYTE(b, o)": "f16_bits_to_f32(uint(LD_U16_BYTE(b, o)))",
        "STORE_HALF(b, i, v)": "ST_U16(b, i, f16_bits_rte(v))",
        "BITS_TO_FLOAT(u)": "uintBitsToFloat(uint(u))",
        "ROUND_HALF(v)": "f16_bits_to_f32(f16_bits_rte(v))",
        "DOT4_I8(a, b, acc)": "((acc) + dot4_i8((a), (b)))",
        "expf": "exp", "logf": "log", "sqrtf": "sqrt", "fabsf": "abs", "fmaxf": "max", "fminf": "min",
        "log1pf": "log1p_f32", "roundf": "round_half_away", "sinf": "sin_f32", "cosf": "cos_f32",
        "INFINITY": "uintBitsToFloat(0x7f800000u)",
    }
    if f.subgroups:
        # each subgroup's total lands in its slot (gl_SubgroupID < the group size), then one
        # invocation combines the few slots: no assumption on how lanes map to lid
        m["WG_SUBGROUPS(buf, n, op, identity, e)"] = (
            "BARRIER(); { float sg = op(lid < (n) ? buf[lid] : (identity)); BARRIER(); "
            "if (subgroupElect()) buf[gl_SubgroupID] = sg; } BARRIER(); "
            "if (lid == 0) for (int s = 1; s < int(gl_NumSubgroups); ++s) buf[0] = e; BARRIER();")
        m["WG_SUM(buf, n)"] = "WG_SUBGROUPS(buf, n, subgroupAdd, 0.0, buf[0] + buf[s])"
        m["WG_MAX(buf, n)"] = "WG_SUBGROUPS(buf, n, subgroupMax, -INFINITY, max(buf[0], buf[s]))"
    if f.storage16:
        m["LD_U16(b, i)"] = "int(uint(b[uint(i)]))"
        m["ST_U16(b, i, v)"] = "b[uint(i)] = uint16_t(uint(v) & 0xffffu)"
    else:
        m["LD_U16(b, i)"] = "int(bitfieldExtract(b[uint(i) >> 1], int((uint(i) & 1u) << 4), 16))"
        m["ST_U16(b, i, v)"] = _packed_store(16)
    if f.storage8:
        m["LD_U8(b, i)"] = "int(uint(b[uint(i)]))"
        m["LD_I8(b, i)"] = ("int(int8_t(b[uint(i)]))" if f.float16_int8
                            else "bitfieldExtract(int(uint(b[uint(i)])), 0, 8)")
        m["LD_U16_BYTE(b, o)"] = "(LD_U8(b, o) | (LD_U8(b, uint(o) + 1u) << 8))"
        m["ST_U8(b, i, v)"] = "b[uint(i)] = uint8_t(uint(v) & 0xffu)"
    else:
        m["LD_U8(b, i)"] = "int(bitfieldExtract(b[uint(i) >> 2], int((uint(i) & 3u) << 3), 8))"
        m["LD_I8(b, i)"] = "bitfieldExtract(int(b[uint(i) >> 2]), int((uint(i) & 3u) << 3), 8)"
        m["LD_U16_BYTE(b, o)"] = "int(bitfieldExtract(b[uint(o) >> 2], int((uint(o) & 2u) << 3), 16))"
        m["ST_U8(b, i, v)"] = _packed_store(8)
    return m


def _packed_store(bits: int) -> str:
    per_word = 32 // bits
    mask = f"0x{(1 << bits) - 1:x}u"
    return (f"do {{ uint at_ = uint(i), sh_ = (at_ % {per_word}u) * {bits}u; "
            f"atomicAnd(b[at_ / {per_word}u], ~({mask} << sh_)); "
            f"atomicOr(b[at_ / {per_word}u], (uint(v) & {mask}) << sh_); }} while (false)")


# Helpers behind the macros above, exact where the built-ins' precision is loose.
GLSL_HELPERS = """
// f32 -> f16 bits, round to nearest even (packHalf2x16 leaves the rounding open)
uint f16_bits_rte(float v) {
  uint x = floatBitsToUint(v), sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u;
  if (a >= 0x477ff000u) return sign | 0x7c00u;
  if (a < 0x38800000u) return sign | uint(roundEven(uintBitsToFloat(a) * 16777216.0));
  return sign | (((a + 0x0fffu + ((a >> 13) & 1u)) >> 13) - 0x1c000u);
}
// f16 bits -> f32, subnormals included
float f16_bits_to_f32(uint h) {
  uint sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0u) return uintBitsToFloat(sign | floatBitsToUint(float(m) * 5.9604644775390625e-8));
  if (e == 31u) return uintBitsToFloat(sign | 0x7f800000u | (m << 13));
  return uintBitsToFloat(sign | ((e + 112u) << 23) | (m << 13));
}
// C roundf: halfway cases away from zero (GLSL round() may go either way)
float round_half_away(float v) {
  float t = trunc(v);
  return abs(v - t) >= 0.5 ? t + sign(v) : t;
}
// log(1 + x): 2 atanh(x / (2 + x)) as a series where log(1 + x) would lose digits
float log1p_f32(float x) {
  if (x > -0.5 && x < 1.0) {
    float s = x / (2.0 + x), z = s * s;
    return 2.0 * s * (1.0 + z * (1.0 / 3.0 + z * (0.2 + z * (1.0 / 7.0 + z * (1.0 / 9.0 + z * (1.0 / 11.0
         + z * (1.0 / 13.0 + z * (1.0 / 15.0))))))));
  }
  return log(1.0 + x);
}
// sin and cos: reduction by pi/2 split in three parts whose first two products with the
// quadrant count j are exact for |j| < 2^13 (|x| < 12867), then minimax polynomials on
// [-pi/4, pi/4] (Cephes sinf / cosf)
float sin_poly(float r) {
  float z = r * r;
  return r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
}
float cos_poly(float r) {
  float z = r * r;
  return 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5));
}
float reduce_half_pi(float x, out int quadrant) {
  float j = floor(x * 0.636619772367581 + 0.5);
  quadrant = int(j) & 3;
  return ((x - j * 1.5703125) - j * 4.837512969970703125e-4) - j * 7.54978995489188216e-8;
}
float sin_f32(float x) {
  int q;
  float r = reduce_half_pi(x, q);
  float v = (q & 1) == 0 ? sin_poly(r) : cos_poly(r);
  return q >= 2 ? -v : v;
}
float cos_f32(float x) {
  int q;
  float r = reduce_half_pi(x, q);
  float v = (q & 1) == 0 ? cos_poly(r) : sin_poly(r);
  return q == 1 || q == 2 ? -v : v;
}
int dot4_i8(int a, int b) {
  return bitfieldExtract(a, 0, 8) * bitfieldExtract(b, 0, 8) + bitfieldExtract(a, 8, 8) * bitfieldExtract(b, 8, 8)
       + bitfieldExtract(a, 16, 8) * bitfieldExtract(b, 16, 8) + (a >> 24) * (b >> 24);
}
"""


class GLSLToolMissing(CompileError):
    """glslangValidator or spirv-val is not installed."""


_TOOLS = {"glslangValidator": "glslang-tools", "spirv-val": "spirv-tools"}


@functools.cache
def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise GLSLToolMissing(f"{name} not found: install the Debian package {_TOOLS[name]} "
                              f"(apt-get install {_TOOLS[name]})")
    return found


def glsl_tools_missing() -> str | None:
    """Why SPIR-V cannot be built here, or None when both tools are installed."""
    try:
        for name in _TOOLS:
            _tool(name)
    except GLSLToolMissing as e:
        return str(e)
    return None


@functools.cache
def _tool_versions() -> str:
    return "\n".join(subprocess.run([_tool(name), "--version"], capture_output=True, text=True).stdout.strip()
                     for name in _TOOLS)


def compile_spirv(source: str, *, name: str = "kernel") -> bytes:
    """SPIR-V of a compute shader (glslangValidator, then spirv-val), cached on disk by
    source and tool versions; CompileError naming the kernel and quoting the tool output."""
    compiler = [_tool("glslangValidator"), "-V", "--target-env", TARGET_ENV]
    validator = [_tool("spirv-val"), "--target-env", TARGET_ENV]

    def build(out: Path) -> None:
        src = out.with_name("kernel.comp")
        src.write_text(source)
        for cmd in (compiler + ["-o", str(out), str(src)], validator + [str(out)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise CompileError(f"{name}: {Path(cmd[0]).name} failed:\n{done.stdout}{done.stderr}")

    return cached_build(f"spirv {TARGET_ENV}\n{_tool_versions()}\n{source}", build)

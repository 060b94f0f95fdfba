"""GLSL 4.50 compute shaders from kernel trees: one kernel, one shader.

Interface with the Vulkan runtime (backends/vulkan.py relies on it):
- descriptor set 0, binding i = the kernel's i-th buffer parameter, a std430 storage
  buffer (`readonly` when the kernel does not write it); byte sizes padded to 4;
- a push-constant block holding the int parameters in order, each an `int` at offset 4 * i;
- entry point `main`; the work-group size is kernel.local, the dispatch the plan's groups.
Indices are 32-bit in GLSL: a buffer holds at most 2^32 - 1 elements (2^31 bytes without
int64, see GLSLFeatures).

Work-group arrays move to module scope as `shared` (found by walking the tree), names that
are GLSL keywords get a trailing underscore, and every buffer subscript is printed as
`uint(...)`: the tree knows which nodes are buffer accesses, so nothing is recognised in
text. Narrow buffers (8/16-bit elements) without the storage features are uint words:
reads shift and mask, writes change only their own bits with atomicAnd/atomicOr, so
invocations writing neighbouring elements of one word do not race.

Precision: f16 conversions, roundf, log1p, sin and cos are helpers written here (exact, or
within a few ulp) instead of built-ins whose precision Vulkan leaves loose (sin/cos: 2^-11
absolute; round: ties either way; packHalf2x16: rounding unspecified). exp, log, sqrt and
division are the built-ins (3 + 2|x| ulp, 3 ulp, 3 ulp and 2.5 ulp).
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import DT, K, Kernel, Param, walk
from .lower import expand_wg_reduce, scalarize
from .printer import Printer

# GLSL keywords a kernel may use as an identifier; renamed with a trailing underscore
KEYWORDS = frozenset(
    "out in inout buffer shared sample input output filter common partition active half fixed long short "
    "packed namespace using class union enum typedef template this resource goto inline noinline public "
    "static extern external interface unsigned sizeof cast precise patch smooth flat noperspective "
    "centroid coherent volatile restrict readonly writeonly subroutine invariant attribute varying layout "
    "uniform lowp mediump highp precision superp dot step mix clamp sign length distance".split())


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

    def extensions(self) -> list[str]:
        wanted = [(self.storage8, "GL_EXT_shader_8bit_storage"), (self.storage16, "GL_EXT_shader_16bit_storage"),
                  (self.int64, "GL_EXT_shader_explicit_arithmetic_types_int64"),
                  (self.float16_int8, "GL_EXT_shader_explicit_arithmetic_types_int8"),
                  (self.subgroups, "GL_KHR_shader_subgroup_basic"),
                  (self.subgroups, "GL_KHR_shader_subgroup_arithmetic")]
        return [f"#extension {name} : require" for on, name in wanted if on]


FULL = GLSLFeatures(storage8=True, storage16=True, int64=True, float16_int8=True, subgroups=True)
BASELINE = GLSLFeatures()


class UnsupportedKernel(ValueError):
    """A kernel the GLSL printer cannot express under the given features."""


_MATH = {"exp": "exp", "log": "log", "log1p": "log1p_f32", "sqrt": "sqrt", "sin": "sin_f32", "cos": "cos_f32",
         "fabs": "abs", "floor": "floor", "trunc": "trunc", "round": "round_half_away", "fma": "fma",
         "dot4_i8": "dot4_i8", "round_f16": "round_f16"}


class GLSLPrinter(Printer):
    def __init__(self, kernel: Kernel, features: GLSLFeatures):
        super().__init__(kernel)
        self.f = features

    def ident(self, name: str) -> str:
        return name + "_" if name in KEYWORDS else name

    def type_name(self, t: DT) -> str:
        if t.lanes > 1:
            raise UnsupportedKernel("vector values reach the GLSL printer: scalarize first")
        return {"f32": "float", "i16": "int", "i32": "int", "u32": "uint", "bool": "bool",
                "i64": "int64_t" if self.f.int64 else "int"}[t.scalar]

    def float_literal(self, v: float) -> str:
        if v != v:
            return "uintBitsToFloat(0x7fc00000u)"
        if v in (float("inf"), float("-inf")):
            return f"{'-' if v < 0 else ''}uintBitsToFloat(0x7f800000u)"
        return self.shortest_f32(v)

    def int_literal(self, v: int, t: DT) -> str:
        if t.scalar == "u32":
            return f"{v}u"
        return f"{v}l" if t.scalar == "i64" and self.f.int64 else str(v)

    def special(self, kind: str, axis: int) -> str:
        return f"int({'gl_WorkGroupID' if kind == 'gid' else 'gl_LocalInvocationID'}.{'xyz'[axis]})"

    def barrier(self) -> str:
        # OpenCL's barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE): all memory, work-group scope
        return "groupMemoryBarrier(); barrier()"

    def cast(self, t: DT, x: K) -> tuple[str, int]:
        return f"{self.type_name(t)}({self.expr(x)})", 16

    def bitcast(self, t: DT, x: str, src: DT) -> str:
        if t.scalar == "f32":
            return f"{'int' if src.scalar == 'i32' else 'uint'}BitsToFloat({x})"
        if src.scalar == "f32":
            return f"floatBits{'ToInt' if t.scalar == 'i32' else 'ToUint'}({x})"
        return f"{self.type_name(t)}({x})"

    def intrinsic(self, name: str, t: DT) -> str:
        return _MATH[name]

    def minmax(self, op: str, t: DT) -> str:
        return op

    def index(self, n: K) -> str:
        return self.expr(n)

    def array_decl(self, name: str, t: DT, length: int, scope: str, init) -> str:
        if scope == "local":
            return ""  # hoisted to module scope
        if init is None:
            return f"{self.type_name(t)} {name}[{length}];"
        values = ", ".join(self.literal(v, t)[0] for v in init)
        return f"const {self.type_name(t)} {name}[{length}] = {self.type_name(t)}[{length}]({values});"

    def wg_reduce(self, node: K) -> list[str]:
        """Each subgroup's total lands in its slot (gl_SubgroupID < the group size), then one
        invocation combines the few slots: no assumption on how lanes map to lid."""
        name, n, how = node.arg
        buf, op = self.ident(name), "subgroupAdd" if how == "sum" else "subgroupMax"
        identity = "0.0" if how == "sum" else "uintBitsToFloat(0xff800000u)"
        combine = f"{buf}[0] + {buf}[s_]" if how == "sum" else f"max({buf}[0], {buf}[s_])"
        lid = "int(gl_LocalInvocationID.x)"
        return [f"{self.barrier()};",
                f"{{ float sg_ = {op}({lid} < {n} ? {buf}[{lid}] : {identity}); {self.barrier()};",
                f"  if (subgroupElect()) {buf}[gl_SubgroupID] = sg_; }}",
                f"{self.barrier()};",
                f"if ({lid} == 0) for (int s_ = 1; s_ < int(gl_NumSubgroups); ++s_) {buf}[0] = {combine};",
                f"{self.barrier()};"]

    # -- narrow buffers ---------------------------------------------------------------------
    def _word_bits(self, buf: str, index: str, bits: int, signed: bool) -> str:
        per = 32 // bits
        word = f"{buf}[uint({index}) / {per}u]"
        shift = f"int((uint({index}) % {per}u) * {bits}u)"
        return f"bitfieldExtract({'int(' + word + ')' if signed else word}, {shift}, {bits})"

    def _u8(self, p: Param, index: str, signed: bool = False) -> str:
        name = self.ident(p.name)
        if p.ctype != "u8":
            raise UnsupportedKernel(f"{self.kernel.name}: byte view of a {p.ctype} buffer {p.name!r}")
        if self.f.storage8:
            if signed:
                return (f"int(int8_t({name}[uint({index})]))" if self.f.float16_int8
                        else f"bitfieldExtract(int(uint({name}[uint({index})])), 0, 8)")
            return f"int(uint({name}[uint({index})]))"
        value = self._word_bits(name, index, 8, signed)
        return value if signed else f"int({value})"

    def _u16(self, p: Param, index: str) -> str:
        name = self.ident(p.name)
        if p.ctype == "u16":
            return f"int(uint({name}[uint({index})]))" if self.f.storage16 else f"int({self._word_bits(name, index, 16, False)})"
        if p.ctype == "u8":  # a u16 at an even byte of a byte buffer
            if self.f.storage8:
                return f"({self._u8(p, f'2 * ({index})')} | ({self._u8(p, f'2 * ({index}) + 1')} << 8))"
            return f"int({self._word_bits(name, index, 16, False)})"
        raise UnsupportedKernel(f"{self.kernel.name}: u16 view of a {p.ctype} buffer {p.name!r}")

    def load(self, p: Param, view: str, index: str, lanes: int) -> str:
        name = self.ident(p.name)
        if view == p.ctype and view in ("f32", "i32", "i64"):
            return f"{name}[uint({index})]"
        if view in ("u8", "i8"):
            return self._u8(p, index, signed=view == "i8")
        if view == "u16":
            return self._u16(p, index)
        if view == "f16":
            return f"f16_bits_to_f32(uint({self._u16(p, index)}))"
        if view == "bf16":
            return f"uintBitsToFloat(uint({self._u16(p, index)}) << 16)"
        raise UnsupportedKernel(f"{self.kernel.name}: no {view} view of a {p.ctype} buffer {p.name!r}")

    def store(self, p: Param, view: str, index: str, value: str, lanes: int) -> str:
        name = self.ident(p.name)
        if view in ("f32", "i32", "i64"):
            return f"{name}[uint({index})] = {value}"
        bits = {"u8": 8, "u16": 16, "f16": 16}[view]
        if view == "f16":
            value = f"f16_bits_rte({value})"
        narrow = self.f.storage8 if p.ctype == "u8" else self.f.storage16
        if narrow and p.ctype == "u8" and bits == 16:  # a u16 at an even byte of a byte buffer
            return (f"{{ uint v_ = uint({value}); {name}[2u * uint({index})] = uint8_t(v_ & 0xffu); "
                    f"{name}[2u * uint({index}) + 1u] = uint8_t((v_ >> 8) & 0xffu); }}")
        if narrow:
            return f"{name}[uint({index})] = uint{bits}_t(uint({value}) & 0x{(1 << bits) - 1:x}u)"
        per, mask = 32 // bits, f"0x{(1 << bits) - 1:x}u"
        return (f"{{ uint at_ = uint({index}), sh_ = (at_ % {per}u) * {bits}u; "
                f"atomicAnd({name}[at_ / {per}u], ~({mask} << sh_)); "
                f"atomicOr({name}[at_ / {per}u], (uint({value}) & {mask}) << sh_); }}")

    # -- the shader ---------------------------------------------------------------------------
    def buffer_block(self, binding: int, p: Param) -> str:
        if p.ctype == "i64" and not self.f.int64:
            raise UnsupportedKernel(f"{self.kernel.name}: buffer {p.name!r} holds 64-bit integers, which need "
                                    "the int64 feature (shaderInt64)")
        element = {"f32": "float", "i32": "int", "i64": "int64_t",
                   "u16": "uint16_t" if self.f.storage16 else "uint",
                   "u8": "uint8_t" if self.f.storage8 else "uint"}[p.ctype]
        access = "" if p.writes else "readonly "
        return (f"layout(set = 0, binding = {binding}, std430) {access}buffer Buffer{binding} "
                f"{{ {element} {self.ident(p.name)}[]; }};")


def render_glsl(kernel: Kernel, features: GLSLFeatures) -> str:
    """The compute shader of one kernel under `features` (see the module docstring)."""
    if not features.subgroups:
        kernel = expand_wg_reduce(kernel)
    kernel = scalarize(kernel)
    printer = GLSLPrinter(kernel, features)
    x, y, z = kernel.local
    parts = ["#version 450", f"// kernel {kernel.name} (op {kernel.op})", *features.extensions(),
             f"layout(local_size_x = {x}, local_size_y = {y}, local_size_z = {z}) in;",
             *(printer.buffer_block(i, p) for i, p in enumerate(kernel.buffers))]
    if kernel.ints:
        members = " ".join(f"int {n};" for n in kernel.ints)
        parts.append(f"layout(push_constant, std430) uniform Ints {{ {members} }};")
    shared = [n for n in walk(kernel.body) if n.op == "array" and n.arg[2] == "local"]
    parts += [f"shared {printer.type_name(n.dtype)} {printer.ident(n.arg[0])}[{n.arg[1]}];" for n in shared]
    parts += [GLSL_HELPERS.strip()]
    parts += [printer.function_source(f, "") for f in kernel.functions]
    parts += ["void main() {", *printer.statements(kernel.body), "}", ""]
    return "\n".join(parts)


# The GLSL runtime: exact replacements for built-ins whose precision Vulkan leaves loose.
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
float round_f16(float v) { return f16_bits_to_f32(f16_bits_rte(v)); }
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
int dot4_i8(int a, int b, int acc) {
  return acc + bitfieldExtract(a, 0, 8) * bitfieldExtract(b, 0, 8) + bitfieldExtract(a, 8, 8) * bitfieldExtract(b, 8, 8)
       + bitfieldExtract(a, 16, 8) * bitfieldExtract(b, 16, 8) + (a >> 24) * (b >> 24);
}
"""

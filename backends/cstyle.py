"""One C-style renderer for OpenCL C, CUDA C++ and HIP (tinygrad's CStyleLanguage idea).

Kernels are written once, as a body in a dialect-neutral C subset, by the builders in
`backends/kernels/`. The subset is also what `glsl.py` renders for Vulkan, so it has no
pointers and no C casts: a buffer is only indexed (`x[i]`, a "row" is an offset variable),
buffers of 8/16-bit elements are only read and written through macros, and conversions are
macros. A `Dialect` subclass supplies the vocabulary's meaning as class-attribute knobs:

    KERNEL signature        kernel qualifier, buffer qualifier, `restrict`, launch bounds
    LOCAL                   a work-group shared array, declared at the top level of a body
    GID(d) LID(d)           work-group and work-item ids; BARRIER() a work-group barrier
    DEVICE                  qualifier of helper functions (they take values, never buffers)
    i64 u32                 integer variable types besides int (i64 holds buffer offsets)
    F32(x) I32(x) I64(x) U32(x)   conversions; I8(x) the low byte of int x, sign-extended
    LD_U8(b, i) LD_I8(b, i) int value of byte i of a u8 buffer, zero- / sign-extended
    LD_U16(b, i)            int value of element i of a u16 buffer
    LD_U16_BYTE(b, o)       int value of the u16 at even byte offset o of a u8 buffer
    ST_U8(b, i, v) ST_U16(b, i, v)   store the low bits of int v (a statement)
    HALF_AT(b, i)           f32 value of f16 element i of a u16 buffer
    HALF_AT_BYTE(b, o)      f32 value of the f16 at even byte offset o of a u8 buffer
    STORE_HALF(b, i, v)     round v to f16 (nearest even) into element i of a u16 buffer
    BITS_TO_FLOAT(u)        reinterpret a u32 as f32 (bf16 is its high half)
    ROUND_HALF(v)           v rounded to f16 (nearest even), as f32
    DOT4_I8(a, b, acc)      acc + dot of the four signed bytes of ints a and b
    BF16_AT(b, i) Q8_0_AT(b, row, i)   weight reads, defined once from the above (DERIVED)
    ACC16_ZERO(a, n)        declare a[0..n): n zeroed accumulators of sixteen f32 sums each
    ACC16_SUM(a)            the total of one accumulator's sixteen sums
    Q8_0_LOAD32(v, d, b, o) declare v: the 32 quants of the Q8_0 block at byte o of b as f32,
                            and d: its scale
    DOT32_ACC16(a, v, d, x, xc)  accumulator a += d * (v[e] * x[xc + e] + v[e + 16] * x[xc + e + 16])
                            into sum e: the scale multiplies a block's partial sums, not
                            each weight
    Q8S_LOAD32(v, b, o)     declare v: the 32 int8 quants at byte o of b (the split Q8_0
                            layout, quants apart from scales) as f32
    HALF16_AT_BYTE(d, b, o) declare d[16]: the 16 f16 values at even byte o of b as f32
                            (these six are DERIVED as loops; OpenCL uses its vector types,
                            which PoCL turns into wide loads, conversions and FMAs)
    WG_SUM(buf, n) WG_MAX(buf, n)   reduce LOCAL buf[n] (n a power of two, the work-group
                            size, indexed by `lid`) into buf[0], then a barrier: a barrier
                            tree (DERIVED); GLSL with subgroup arithmetic reduces each
                            subgroup in registers and only combines the subgroups' partials
    expf logf log1pf sqrtf cosf sinf fabsf fmaxf fminf roundf, INFINITY   (C99 float names)

Variables are int, float, bool, i64 or u32 (i8 u8 u16 only name buffer element types), and
names avoid GLSL built-in functions (`dot`, `step`, ...); glsl.py renames GLSL keywords such
as `out`. A rendered module is prelude + shared helper functions + kernels; only the
prelude and the kernel signatures differ between dialects, so the kernels that run on PoCL
in CI are the kernels that compile to cubin and HSACO (and, rendered by glsl.py, to SPIR-V).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

# Device helpers every module carries, written in the neutral subset.
HELPERS = """
DEVICE float sigmoid_f32(float x) {
  float e = expf(-fabsf(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}
DEVICE float softplus_f32(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }
"""

# Vocabulary defined from the dialect macros, the same text for every dialect unless a
# dialect has a faster form. A Q8_0 block is an fp16 scale d then 32 int8 quants (34
# bytes); `row` is the byte offset of a row.
DERIVED = {
    "BF16_AT(b, i)": "BITS_TO_FLOAT(U32(LD_U16(b, i)) << 16)",
    "Q8_0_AT(b, row, i)": "(HALF_AT_BYTE(b, (row) + ((i) >> 5) * 34) * "
                          "F32(LD_I8(b, (row) + ((i) >> 5) * 34 + 2 + ((i) & 31))))",
    "ACC16_ZERO(a, n)": "float a[n][16]; for (int q8e = 0; q8e < (n) * 16; ++q8e) a[q8e / 16][q8e % 16] = 0.0f",
    "ACC16_SUM(a)": "((((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))) + "
                    "(((a[8] + a[9]) + (a[10] + a[11])) + ((a[12] + a[13]) + (a[14] + a[15]))))",
    "Q8_0_LOAD32(v, d, b, o)": "float v[32]; float d = HALF_AT_BYTE(b, o); "
                               "for (int q8e = 0; q8e < 32; ++q8e) v[q8e] = F32(LD_I8(b, (o) + 2 + q8e))",
    "Q8S_LOAD32(v, b, o)": "float v[32]; for (int q8e = 0; q8e < 32; ++q8e) v[q8e] = F32(LD_I8(b, (o) + q8e))",
    "HALF16_AT_BYTE(d, b, o)": "float d[16]; for (int q8e = 0; q8e < 16; ++q8e) d[q8e] = HALF_AT_BYTE(b, (o) + 2 * q8e)",
    "DOT32_ACC16(a, v, d, x, xc)": "for (int q8e = 0; q8e < 16; ++q8e) "
                                   "a[q8e] += (d) * (v[q8e] * x[U32((xc) + q8e)] + v[q8e + 16] * x[U32((xc) + q8e + 16)])",
    "WG_SUM(buf, n)": "WG_TREE(buf, n, buf[lid] + buf[lid + s])",
    "WG_MAX(buf, n)": "WG_TREE(buf, n, fmaxf(buf[lid], buf[lid + s]))",
    "WG_TREE(buf, n, e)": "BARRIER(); for (int s = (n) / 2; s > 0; s >>= 1) { if (lid < s) buf[lid] = e; BARRIER(); }",
}

# The conversions and narrow-buffer accesses of the C dialects: plain casts and indexing.
C_MACROS = {
    "F32(x)": "((float)(x))", "I32(x)": "((int)(x))", "I64(x)": "((i64)(x))", "U32(x)": "((u32)(x))",
    "I8(x)": "((int)(i8)(x))",
    "LD_U8(b, i)": "((int)(b)[i])", "LD_I8(b, i)": "((int)(i8)(b)[i])", "LD_U16(b, i)": "((int)(b)[i])",
    "LD_U16_BYTE(b, o)": "((int)*(GLOBAL const u16*)((b) + (o)))",
    "ST_U8(b, i, v)": "((b)[i] = (u8)(v))", "ST_U16(b, i, v)": "((b)[i] = (u16)(v))",
}


@dataclass(frozen=True)
class Buffer:
    """A kernel's buffer parameter: element C type, and whether the kernel writes it."""

    name: str
    ctype: str
    writes: bool = False


@dataclass(frozen=True)
class Kernel:
    """One kernel, dialect-neutral. `local` is its fixed work-group size (x, y, z);
    `ints` are int parameters (symbol sizes) after the buffers."""

    name: str
    op: str
    buffers: tuple[Buffer, ...]
    ints: tuple[str, ...]
    local: tuple[int, int, int]
    body: str

    @staticmethod
    def make(op: str, buffers, ints, local, body: str) -> "Kernel":
        """Content-addressed name, so identical kernels of different nodes are one kernel."""
        buffers, ints, local = tuple(buffers), tuple(ints), tuple(local)
        key = repr((buffers, ints, body, local)).encode()
        return Kernel(f"{op}_{hashlib.sha1(key).hexdigest()[:10]}", op, buffers, ints, local, body)

    @property
    def threads(self) -> int:
        return self.local[0] * self.local[1] * self.local[2]


class Dialect:
    name = ""
    extension = ""
    includes = ""            # first lines of a module: includes, pragmas
    kernel_prefix = ""       # before the name; may use {threads}, {x}, {y}, {z}
    buffer_qualifier = ""
    restrict = ""
    macros: dict[str, str] = {}

    def prelude(self) -> str:
        defs = "\n".join(f"#define {k} {v}" for k, v in {**C_MACROS, **DERIVED, **self.macros}.items())
        return f"{self.includes}\n{defs}\n"

    def signature(self, k: Kernel) -> str:
        params = [f"{self.buffer_qualifier}{'' if b.writes else 'const '}{b.ctype}* {self.restrict} {b.name}"
                  for b in k.buffers]
        params += [f"int {n}" for n in k.ints]
        x, y, z = k.local
        prefix = self.kernel_prefix.format(threads=k.threads, x=x, y=y, z=z)
        return f"{prefix} {k.name}({', '.join(params)})"

    def module_header(self) -> str:
        """What every module starts with: the prelude and the helper functions."""
        from .kir.build import FUNCTIONS
        from .kir.c import PRINTERS

        return f"{self.prelude()}{HELPERS}\n" + PRINTERS[self.name].module_header(tuple(FUNCTIONS.values()))

    def kernel_source(self, k) -> str:
        from .kir.c import PRINTERS
        from .kir.ir import Kernel as TreeKernel

        if isinstance(k, TreeKernel):
            return PRINTERS[self.name].kernel_source(k)
        return f"{self.signature(k)} {{\n{k.body.rstrip()}\n}}\n"

    def render(self, kernels) -> str:
        """The module source: header, then each distinct kernel once."""
        unique = {k.name: k for k in kernels}
        return self.module_header() + "\n".join(self.kernel_source(k) for k in unique.values())


_C99_FLOAT_MATH = ("exp", "log", "log1p", "sqrt", "cos", "sin", "fabs", "fmax", "fmin", "round")


class OpenCLDialect(Dialect):
    name = "opencl"
    extension = "cl"
    includes = "#pragma OPENCL EXTENSION cl_khr_byte_addressable_store : enable"
    kernel_prefix = "__kernel __attribute__((reqd_work_group_size({x}, {y}, {z}))) void"
    buffer_qualifier = "__global "
    restrict = "restrict"
    macros = {
        "GLOBAL": "__global", "LOCAL": "__local", "DEVICE": "static inline",
        "GID(d)": "((int)get_group_id(d))", "LID(d)": "((int)get_local_id(d))",
        "BARRIER()": "barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE)",
        "i8": "char", "u8": "uchar", "u16": "ushort", "u32": "uint", "i64": "long",
        "HALF_AT(b, i)": "vload_half((i), (__global const half*)(b))",
        "HALF_AT_BYTE(b, o)": "vload_half(0, (__global const half*)((b) + (o)))",
        "STORE_HALF(b, i, v)": "vstore_half_rte((v), (i), (__global half*)(b))",
        "BITS_TO_FLOAT(u)": "as_float(u)",
        "ROUND_HALF(v)": "round_half_portable(v)",
        "DOT4_I8(a, b, acc)": "((acc) + dot4_i8_portable((a), (b)))",
        "ACC16_ZERO(a, n)": "float16 a[n]; for (int q8e = 0; q8e < (n); ++q8e) a[q8e] = (float16)(0.0f)",
        "ACC16_SUM(a)": "sum16_portable(a)",
        "Q8_0_LOAD32(v, d, b, o)": "float16 v[2]; float d = HALF_AT_BYTE(b, o); "
                                   "v[0] = convert_float16(as_char16(vload16(0, (b) + (o) + 2))); "
                                   "v[1] = convert_float16(as_char16(vload16(0, (b) + (o) + 18)))",
        "Q8S_LOAD32(v, b, o)": "float16 v[2]; v[0] = convert_float16(as_char16(vload16(0, (b) + (o)))); "
                               "v[1] = convert_float16(as_char16(vload16(0, (b) + (o) + 16)))",
        "HALF16_AT_BYTE(d, b, o)": "float d[16]; vstore16(half16_portable(vload16(0, (GLOBAL const ushort*)((b) + (o)))), 0, d)",
        "DOT32_ACC16(a, v, d, x, xc)": "a = fma((float16)(d), (v)[0] * vload16(0, (x) + (xc)) + "
                                       "(v)[1] * vload16(0, (x) + (xc) + 16), a)",
        **{f"{f}f": f for f in _C99_FLOAT_MATH},
    }

    def prelude(self) -> str:
        # OpenCL C has no int8 dot in its core and no half variables without cl_khr_fp16
        return super().prelude() + (
            "static inline int dot4_i8_portable(int a, int b) {\n"
            "  return (int)(char)a * (int)(char)b + (int)(char)(a >> 8) * (int)(char)(b >> 8)\n"
            "       + (int)(char)(a >> 16) * (int)(char)(b >> 16) + (a >> 24) * (b >> 24);\n}\n"
            # f16 -> f32 of 16 values at once, exactly (vload_half is one value at a time in PoCL)
            "static inline float16 half16_portable(ushort16 h) {\n"
            "  uint16 u = convert_uint16(h), e = u & 0x7c00u, m = u & 0x3ffu, s = (u & 0x8000u) << 16;\n"
            "  uint16 normal = s | (((u & 0x7fffu) + 0x1c000u) << 13);\n"
            "  uint16 small = s | as_uint16(convert_float16(m) * 0x1p-24f);\n"
            "  uint16 special = s | 0x7f800000u | (m << 13);\n"
            "  return as_float16(select(select(normal, small, e == 0u), special, e == 0x7c00u));\n}\n"
            "static inline float sum16_portable(float16 a) {\n"
            "  float8 h = a.lo + a.hi;\n  float4 q = h.lo + h.hi;\n  float2 p = q.lo + q.hi;\n  return p.x + p.y;\n}\n"
            "static inline float round_half_portable(float v) {\n"
            "  ushort h;\n  vstore_half_rte(v, 0, (__private half*)&h);\n  return vload_half(0, (__private const half*)&h);\n}\n")


class _CudaLike(Dialect):
    """CUDA and HIP share the C++ kernel language; only headers and intrinsics differ."""

    kernel_prefix = 'extern "C" __global__ void __launch_bounds__({threads})'
    restrict = "__restrict__"
    macros = {
        "GLOBAL": "", "LOCAL": "__shared__", "DEVICE": "static __device__ __forceinline__",
        "GID(d)": "((int)((d) == 0 ? blockIdx.x : (d) == 1 ? blockIdx.y : blockIdx.z))",
        "LID(d)": "((int)((d) == 0 ? threadIdx.x : (d) == 1 ? threadIdx.y : threadIdx.z))",
        "BARRIER()": "__syncthreads()",
        "i8": "signed char", "u8": "unsigned char", "u16": "unsigned short", "u32": "unsigned int",
        "i64": "long long",
        "HALF_AT(b, i)": "__half2float(((const __half*)(b))[i])",
        "HALF_AT_BYTE(b, o)": "__half2float(*(const __half*)((b) + (o)))",
        "STORE_HALF(b, i, v)": "(((__half*)(b))[i] = __float2half_rn(v))",
        "BITS_TO_FLOAT(u)": "__uint_as_float(u)",
        "ROUND_HALF(v)": "__half2float(__float2half_rn(v))",
    }


class CUDADialect(_CudaLike):
    name = "cuda"
    extension = "cu"
    includes = "#include <cuda_fp16.h>"
    macros = {**_CudaLike.macros, "DOT4_I8(a, b, acc)": "__dp4a((a), (b), (acc))"}


class HIPDialect(_CudaLike):
    name = "hip"
    extension = "hip"
    includes = "#include <hip/hip_runtime.h>\n#include <hip/hip_fp16.h>"
    # sdot4 exists on the CDNA and RDNA2 ISAs we build for (gfx90a, gfx1030)
    macros = {**_CudaLike.macros, "DOT4_I8(a, b, acc)": "__builtin_amdgcn_sdot4((a), (b), (acc), false)"}


DIALECTS = {d.name: d for d in (OpenCLDialect(), CUDADialect(), HIPDialect())}

"""One C-style renderer for OpenCL C, CUDA C++ and HIP (tinygrad's CStyleLanguage idea).

Kernels are written once, as a body in a dialect-neutral C subset, by the builders in
`backends/kernels/`. That subset spells everything that differs between the dialects with
a small vocabulary, and a `Dialect` subclass supplies its meaning as class-attribute knobs:

    KERNEL signature        kernel qualifier, buffer qualifier, `restrict`, launch bounds
    GLOBAL / LOCAL          address spaces (pointer casts, work-group shared arrays)
    GID(d) LID(d)           work-group and work-item ids; BARRIER() a work-group barrier
    DEVICE                  qualifier of helper functions
    i8 u8 u16 u32 i64       fixed-width integer types
    HALF_TO_FLOAT(p)        f32 value of the f16 at u16 pointer p (2-byte aligned)
    STORE_HALF(p, v)        round v to f16 (nearest even) and store it at u16 pointer p
    BITS_TO_FLOAT(u)        reinterpret a u32 as f32 (bf16 is its high half)
    ROUND_HALF(v)           v rounded to f16 (nearest even), as f32
    DOT4_I8(a, b, acc)      acc + dot of the four signed bytes of a and b
    expf logf log1pf sqrtf cosf sinf fabsf fmaxf fminf roundf, INFINITY   (C99 float names)

A rendered module is prelude + shared helper functions + kernels; only the prelude and
the kernel signatures differ between dialects, so the kernels that run on PoCL in CI are
the kernels that compile to cubin and HSACO.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

# Device helpers every module carries, written in the neutral subset.
HELPERS = """
DEVICE float q8_0_at(GLOBAL const u8* row, int i) {
  GLOBAL const u8* block = row + (i >> 5) * 34;
  return HALF_TO_FLOAT((GLOBAL const u16*)block) * (float)(i8)block[2 + (i & 31)];
}
DEVICE float bf16_at(GLOBAL const u16* p, i64 i) { return BITS_TO_FLOAT(((u32)p[i]) << 16); }
DEVICE float sigmoid_f32(float x) {
  float e = expf(-fabsf(x));
  return x >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);
}
DEVICE float softplus_f32(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }
"""


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
        defs = "\n".join(f"#define {k} {v}" for k, v in self.macros.items())
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
        return f"{self.prelude()}{HELPERS}\n"

    def kernel_source(self, k: Kernel) -> str:
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
        "HALF_TO_FLOAT(p)": "vload_half(0, (__global const half*)(p))",
        "STORE_HALF(p, v)": "vstore_half_rte((v), 0, (__global half*)(p))",
        "BITS_TO_FLOAT(u)": "as_float(u)",
        "ROUND_HALF(v)": "round_half_portable(v)",
        "DOT4_I8(a, b, acc)": "((acc) + dot4_i8_portable((a), (b)))",
        **{f"{f}f": f for f in _C99_FLOAT_MATH},
    }

    def prelude(self) -> str:
        # OpenCL C has no int8 dot in its core and no half variables without cl_khr_fp16
        return super().prelude() + (
            "static inline int dot4_i8_portable(int a, int b) {\n"
            "  return (int)(char)a * (int)(char)b + (int)(char)(a >> 8) * (int)(char)(b >> 8)\n"
            "       + (int)(char)(a >> 16) * (int)(char)(b >> 16) + (a >> 24) * (b >> 24);\n}\n"
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
        "HALF_TO_FLOAT(p)": "__half2float(*(const __half*)(p))",
        "STORE_HALF(p, v)": "(*(__half*)(p) = __float2half_rn(v))",
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

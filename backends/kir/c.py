"""The C-family printers: OpenCL C, CUDA C++ and HIP, one class with dialect knobs
(tinygrad's CStyleLanguage idea). OpenCL keeps vector values as its vector types (PoCL
turns them into wide loads, conversions and FMAs); CUDA and HIP get scalarized trees.

A module is the prelude (includes, the dialect's few runtime helpers), the device
functions, then the kernels; every kernel of a program is printed from the same tree for
all three dialects, so the kernels that run on PoCL in CI are the kernels that compile to
cubin and HSACO.
"""
from __future__ import annotations

from .ir import DT, K, Function, Kernel, Param
from .lower import expand_wg_reduce, scalarize
from .printer import Printer

_MATH_C99 = {"exp": "expf", "log": "logf", "log1p": "log1pf", "sqrt": "sqrtf", "sin": "sinf", "cos": "cosf",
             "fabs": "fabsf", "floor": "floorf", "trunc": "truncf", "round": "roundf", "fma": "fmaf"}


class CPrinter(Printer):
    name = ""
    extension = ""
    vectors = False
    includes = ""
    runtime = ""              # helper functions in the dialect's own text
    kernel_prefix = ""        # before the name; may use {threads}, {x}, {y}, {z}
    buffer_qualifier = ""
    restrict = ""
    local_qualifier = ""
    function_qualifier = ""
    scalar_names = {"f32": "float", "i16": "short", "i32": "int", "u32": "unsigned int", "i64": "long long",
                    "bool": "bool"}
    element_names = {"f32": "float", "i32": "int", "i64": "long long", "u8": "unsigned char", "u16": "unsigned short"}

    # -- module ---------------------------------------------------------------------------
    def prepare(self, kernel: Kernel) -> Kernel:
        kernel = expand_wg_reduce(kernel)
        return kernel if self.vectors else scalarize(kernel)

    def unroll_hint(self, factor: int) -> str:
        return f"#pragma unroll {factor}"

    def module_header(self, functions: tuple[Function, ...] = ()) -> str:
        """Prelude and device functions: every module (or per-kernel file set) starts with it."""
        parts = [self.includes, self.runtime.strip()] + [self.function_source(f, self.function_qualifier)
                                                          for f in functions]
        return "\n".join(p for p in parts if p) + "\n"

    def kernel_source(self, kernel: Kernel) -> str:
        kernel = self.prepare(kernel)
        printer = type(self)(kernel)
        params = [printer.param(p) for p in kernel.params]
        x, y, z = kernel.local
        prefix = self.kernel_prefix.format(threads=kernel.threads, x=x, y=y, z=z)
        lines = [f"{prefix} {kernel.name}({', '.join(params)}) {{", *printer.statements(kernel.body), "}"]
        return "\n".join(lines) + "\n"

    def render(self, kernels, functions: tuple[Function, ...] = ()) -> str:
        """The module source: header, then each distinct kernel once."""
        unique = {k.name: k for k in kernels}
        used = tuple(dict.fromkeys(f for k in unique.values() for f in k.functions))
        return self.module_header(tuple(dict.fromkeys(functions + used))) + "\n".join(
            self.kernel_source(k) for k in unique.values())

    def param(self, p: Param) -> str:
        if not p.is_buffer:
            return f"int {p.name}"
        const = "" if p.writes else "const "
        return f"{self.buffer_qualifier}{const}{self.element_names[p.ctype]}* {self.restrict} {p.name}"

    # -- vocabulary ----------------------------------------------------------------------
    def type_name(self, t: DT) -> str:
        return self.scalar_names[t.scalar] + (str(t.lanes) if t.lanes > 1 else "")

    def float_literal(self, v: float) -> str:
        if v != v:
            return "NAN"
        if v in (float("inf"), float("-inf")):
            return "INFINITY" if v > 0 else "-INFINITY"
        return self.shortest_f32(v) + "f"

    def int_literal(self, v: int, t: DT) -> str:
        return {"u32": f"{v}u", "i64": f"{v}L"}.get(t.scalar, str(v))

    def cast(self, t: DT, x: K) -> tuple[str, int]:
        return f"({self.type_name(t)}){self._wrap(x, 14)}", 14

    def intrinsic(self, name: str, t: DT) -> str:
        return _MATH_C99[name] if name in _MATH_C99 else name

    def minmax(self, op: str, t: DT) -> str:
        return ("fmin" if op == "min" else "fmax") + "f" if t.is_float else op

    def array_decl(self, name: str, t: DT, length: int, scope: str, init) -> str:
        qualifier = f"{self.local_qualifier} " if scope == "local" else ""
        if init is None:
            return f"{qualifier}{self.type_name(t)} {name}[{length}];"
        values = ", ".join(self.literal(v, t)[0] for v in init)
        return f"const {self.type_name(t)} {name}[{length}] = {{{values}}};"

    def _typed(self, p: Param, element: str) -> str:
        """The buffer as a pointer to `element` (C type name)."""
        const = "" if p.writes else "const "
        return f"(({self.buffer_qualifier}{const}{element}*){p.name})"


# f16 bits (in a uint) to f32 in OpenCL C: PoCL converts f16 one value at a time in
# vload_half, in integer steps. Shared by the native kernels and TVM's loop nests on a CPU
# device (backends/tvm/nest_targets.py), which call it by name.
OPENCL_F16_TO_F32 = """
#if defined(__x86_64__) && (defined(__F16C__) || defined(__AVX512F__))  /* every AVX-512 CPU has F16C */
/* F16C's conversion by inline assembly (PoCL defines no __F16C__ for skylake-avx512), where
   vload_half takes ~20 integer steps a value; a signalling NaN comes out quieted either way */
static inline float f16_to_f32(uint h) {
  float r;
  __asm__("vmovd %1, %0; vcvtph2ps %0, %0" : "=x"(r) : "r"(h));
  return r;
}
#else
static inline float f16_to_f32(uint h) {
  ushort s = h;
  return vload_half(0, (__private const half*)&s);
}
#endif
"""


# 16 f16 bits to f32 at once: F16C where the device compiler targets AVX-512, else exact integer steps
OPENCL_F16X16_TO_F32 = """#if defined(__x86_64__) && defined(__AVX512F__)
static inline float16 f16x16_to_f32(ushort16 h) {
  float16 r;
  __asm__("vcvtph2ps %1, %0" : "=v"(r) : "v"(h));
  return r;
}
#else
static inline float16 f16x16_to_f32(ushort16 h) {
  uint16 u = convert_uint16(h), e = u & 0x7c00u, m = u & 0x3ffu, s = (u & 0x8000u) << 16;
  uint16 normal = s | (((u & 0x7fffu) + 0x1c000u) << 13);
  uint16 small = s | as_uint16(convert_float16(m) * 0x1p-24f);
  uint16 special = s | 0x7f800000u | (m << 13);
  return as_float16(select(select(normal, small, e == 0u), special, e == 0x7c00u));
}
#endif
"""
# x86 VPDPBUSD with its word broadcast from memory (defined only where the compiler targets AVX-512)
OPENCL_DPBUSD_AT = """#if defined(__x86_64__) && defined(__AVX512F__)
/* VPDPBUSD by inline assembly: PoCL compiles for the CPU model the VM reports (skylake-avx512),
   which has the registers but not the instruction; lowering uses it only where the host has it */
static inline int16 dpbusd_at(int16 acc, int16 u, __global const uchar* s) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(__global const int*)s));
  return acc;
}
#endif
"""


class OpenCLPrinter(CPrinter):
    name = "opencl"
    extension = "cl"
    vectors = True
    includes = "#pragma OPENCL EXTENSION cl_khr_byte_addressable_store : enable"
    kernel_prefix = "__kernel __attribute__((reqd_work_group_size({x}, {y}, {z}))) void"
    buffer_qualifier = "__global "
    restrict = "restrict"
    local_qualifier = "__local"
    function_qualifier = "static inline "
    scalar_names = {"f32": "float", "i16": "short", "i32": "int", "u32": "uint", "i64": "long", "bool": "bool"}
    element_names = {"f32": "float", "i32": "int", "i64": "long", "u8": "uchar", "u16": "ushort"}
    # OpenCL C has no int8 dot product in its core, no f16 arithmetic without cl_khr_fp16,
    # and PoCL converts f16 one value at a time in vload_half, in integer steps: these are
    # exact replacements (x86's own instructions where the device compiler targets them)
    runtime = """
static inline int dot4_i8(int a, int b, int acc) {
  return acc + (int)(char)a * (int)(char)b + (int)(char)(a >> 8) * (int)(char)(b >> 8)
       + (int)(char)(a >> 16) * (int)(char)(b >> 16) + (a >> 24) * (b >> 24);
}""" + OPENCL_F16_TO_F32 + OPENCL_F16X16_TO_F32 + OPENCL_DPBUSD_AT + """static inline float vsum2(float2 a) { return a.x + a.y; }
static inline float vsum4(float4 a) { return vsum2(a.lo + a.hi); }
static inline float vsum8(float8 a) { return vsum4(a.lo + a.hi); }
static inline float vsum16(float16 a) { return vsum8(a.lo + a.hi); }
static inline float round_f16(float v) {
  ushort h;
  vstore_half_rte(v, 0, (__private half*)&h);
  return vload_half(0, (__private const half*)&h);
}
"""

    def special(self, kind: str, axis: int) -> str:
        return f"((int)get_{'group' if kind == 'gid' else 'local'}_id({axis}))"

    def barrier(self) -> str:
        return "barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE)"

    def intrinsic(self, name: str, t: DT) -> str:
        return name  # OpenCL's math names are overloaded for float and its vectors

    def _expr(self, n: K):
        if n.op == "dpbusd_at":
            acc, u, byte = n.src
            word = f"{self._typed(self.params[n.arg], 'uchar')} + ({self.expr(byte)})"
            return f"dpbusd_at({self.expr(acc)}, {self.expr(u)}, {word})", 16
        return super()._expr(n)

    def minmax(self, op: str, t: DT) -> str:
        return ("fmin" if op == "min" else "fmax") if t.is_float else op

    def cast(self, t: DT, x: K) -> tuple[str, int]:
        if t.lanes > 1 and x.dtype.lanes == 1:
            return f"({self.type_name(t)})({self.expr(x)})", 16
        if t.lanes > 1 and x.op == "load" and x.arg[1] == "i8":  # bytes straight to wider lanes
            p = self.params[x.arg[0]]
            n = t.lanes
            return f"convert_{self.type_name(t)}(as_char{n}(vload{n}(0, {p.name} + ({self.expr(x.src[0])}))))", 16
        if t.lanes > 1:
            return f"convert_{self.type_name(t)}({self.expr(x)})", 16
        return super().cast(t, x)

    def array_run(self, name: str, index: str, lanes: int) -> str:
        return f"vload{lanes}(0, {name} + ({index}))"

    def array_run_store(self, name: str, index: str, value: str, lanes: int) -> str:
        return f"vstore{lanes}({value}, 0, {name} + ({index}))"

    def bitcast(self, t: DT, x: str, src: DT) -> str:
        return f"as_{self.type_name(t)}({x})"

    def vsum(self, x: str, t: DT) -> str:
        return f"vsum{t.lanes}({x})"

    def load(self, p: Param, view: str, index: str, lanes: int) -> str:
        if lanes > 1:
            return self._vector_load(p, view, index, lanes)
        if view == p.ctype:
            return f"((int){p.name}[{index}])" if view in ("u8", "u16") else f"{p.name}[{index}]"
        if view == "i8":
            return f"((int)(char){p.name}[{index}])"
        if view == "u16":
            return f"((int){self._typed(p, 'ushort')}[{index}])"
        if view == "f16":
            return f"f16_to_f32({self._typed(p, 'ushort')}[{index}])"
        if view == "bf16":
            return f"as_float((uint){self._typed(p, 'ushort')}[{index}] << 16)"
        raise ValueError(f"no {view} view of a {p.ctype} buffer")

    def _vector_load(self, p: Param, view: str, index: str, lanes: int) -> str:
        n = lanes
        if view == "f32" == p.ctype:
            return f"vload{n}(0, {p.name} + ({index}))"
        if view == "i8":
            return f"convert_int{n}(as_char{n}(vload{n}(0, {p.name} + ({index}))))"
        if view == "i32" and p.ctype == "u8":  # 4-byte words of a byte buffer (index in words)
            return f"vload{n}(0, {self._typed(p, 'int')} + ({index}))"
        if view == "u16":
            return f"convert_int{n}(vload{n}(0, {self._typed(p, 'ushort')} + ({index})))"
        if view == "f16":
            if n != 16:
                raise ValueError("f16 vector loads are 16 wide")
            return f"f16x16_to_f32(vload16(0, {self._typed(p, 'ushort')} + ({index})))"
        raise ValueError(f"no {lanes}-wide {view} view of a {p.ctype} buffer")

    def store(self, p: Param, view: str, index: str, value: str, lanes: int) -> str:
        if lanes > 1 and view in ("u8", "i8") and p.ctype == "u8":  # values that fit a signed byte
            return f"vstore{lanes}(convert_char{lanes}({value}), 0, {self._typed(p, 'char')} + ({index}))"
        if lanes > 1:
            if view != "f32":
                raise ValueError(f"no {lanes}-wide {view} store")
            return f"vstore{lanes}({value}, 0, {p.name} + ({index}))"
        if view == "f16":
            return f"vstore_half_rte({value}, {index}, {self._typed(p, 'half')})"
        if view in ("u8", "u16"):
            return f"{p.name}[{index}] = ({self.element_names[view]})({value})"
        return f"{p.name}[{index}] = {value}"


class _CudaLikePrinter(CPrinter):
    kernel_prefix = 'extern "C" __global__ void __launch_bounds__({threads})'
    restrict = "__restrict__"
    local_qualifier = "__shared__"
    function_qualifier = "static __device__ __forceinline__ "
    dot4 = ""

    def special(self, kind: str, axis: int) -> str:
        return f"((int){'blockIdx' if kind == 'gid' else 'threadIdx'}.{'xyz'[axis]})"

    def barrier(self) -> str:
        return "__syncthreads()"

    def intrinsic(self, name: str, t: DT) -> str:
        return self.dot4 if name == "dot4_i8" else super().intrinsic(name, t)

    def _expr(self, n: K):
        if n.op == "call" and n.arg == "round_f16":
            return f"__half2float(__float2half_rn({self.expr(n.src[0])}))", 16
        return super()._expr(n)

    def bitcast(self, t: DT, x: str, src: DT) -> str:
        if t.scalar == "f32":
            return f"__uint_as_float((unsigned int)({x}))"
        if src.scalar == "f32":
            return f"(({self.type_name(t)})__float_as_uint({x}))"
        return f"(({self.type_name(t)})({x}))"

    def load(self, p: Param, view: str, index: str, lanes: int) -> str:
        if view == p.ctype:
            return f"((int){p.name}[{index}])" if view in ("u8", "u16") else f"{p.name}[{index}]"
        if view == "i8":
            return f"((int)(signed char){p.name}[{index}])"
        if view == "u16":
            return f"((int){self._typed(p, 'unsigned short')}[{index}])"
        if view == "f16":
            return f"__half2float({self._typed(p, '__half')}[{index}])"
        if view == "bf16":
            return f"__uint_as_float((unsigned int){self._typed(p, 'unsigned short')}[{index}] << 16)"
        raise ValueError(f"no {view} view of a {p.ctype} buffer")

    def store(self, p: Param, view: str, index: str, value: str, lanes: int) -> str:
        if view == "f16":
            return f"{self._typed(p, '__half')}[{index}] = __float2half_rn({value})"
        if view in ("u8", "u16"):
            return f"{p.name}[{index}] = ({self.element_names[view]})({value})"
        return f"{p.name}[{index}] = {value}"


class CUDAPrinter(_CudaLikePrinter):
    name = "cuda"
    extension = "cu"
    includes = "#include <cuda_fp16.h>"
    dot4 = "__dp4a"


class HIPPrinter(_CudaLikePrinter):
    name = "hip"
    extension = "hip"
    includes = "#include <hip/hip_runtime.h>\n#include <hip/hip_fp16.h>"
    runtime = """
// sdot4 exists on the CDNA and RDNA2 ISAs we build for (gfx90a, gfx1030)
static __device__ __forceinline__ int sdot4_i8(int a, int b, int acc) {
  return __builtin_amdgcn_sdot4(a, b, acc, false);
}
"""
    dot4 = "sdot4_i8"


PRINTERS = {p.name: p() for p in (OpenCLPrinter, CUDAPrinter, HIPPrinter)}

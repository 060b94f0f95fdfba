"""What a hand-written loop nest (cpu_schedules.py) leaves to the target it runs on, supplied
when its TVMScript is parsed. The nests are written once, for a CPU, and run through TVM's
llvm target (its runtime's threads) and through its OpenCL target on a CPU device (PoCL),
whose C has no f16 type (no cl_khr_fp16) and no prefetch of its own (both come from
helpers in the target's `prelude`, put before TVM's source, as do 16-lane float loads and
stores faster than PoCL's), whose parallel loop is the
work-group index, and whose vector loads TVM only emits at offsets it can prove aligned
(Q8_0's quants sit 2 bytes into 34-byte blocks). On PoCL the F16C helper and the prefetches
took the decode GEMVs from ~2.0x of the native kernels to 1.2-1.45x and the 35B MoE from
2.7x (one row) and 2.4x (16) to 1.6x and 1.7x (kernels suite, exact, alternated):

  tasks(n)         the loop over a nest's n independent tasks
  vectorized(n)    a loop over n vector lanes (OpenCL C's vectors have 2, 3, 4, 8 or 16)
  SCRATCH          the storage scope of a task's small arrays (kept in registers)
  f16(bits)        f32 of f16 bits (a uint16): F16C on both (OpenCL C calls the native
                   kernels' helper)
  prefetch(addr)   a hint to fetch the cache line at `addr` (an address_of)
  f16x16(bits)     f32x16 of 16 f16 bits (a uint16x16): F16C on both
  load_as(t, w, at)
                   the bytes of uint8 buffer w from `at` as one vector of TVM type t (int32x16,
                   uint16x16), at any alignment (TVM's OpenCL C gathers a vector from a buffer
                   declared over another's data, element by element)
  dpbusd(acc, u, x, at)
                   VPDPBUSD (AVX-512 VNNI): acc (int32x16) plus, per lane, the dot of u's four
                   unsigned bytes with the four signed bytes x[at .. at + 3] (any alignment),
                   the word broadcast from memory by the instruction (only where the host has
                   the extension: cpu_schedules.q8_product_nest's caller decides)

and `device_rewrite`, a pass over the lowered device module before its source is printed
(OpenCL C: byte vectors at offsets TVM cannot prove aligned, _opencl_byte_vectors).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..kir.c import OPENCL_DPBUSD_AT, OPENCL_F16_TO_F32, OPENCL_F16X16_TO_F32


@dataclass(frozen=True)
class NestTarget:
    name: str
    tasks: Callable[[Any], Any]
    vectorized: Callable[[int], Any]
    scratch: str
    f16: Callable[[Any], Any]
    prefetch: Callable[[Any], Any]
    f16x16: Callable[[Any], Any]
    load_as: Callable[[str, Any, Any], Any]
    dpbusd: Callable[[Any, Any, Any, Any], Any]
    prelude: str = ""  # target source the nests' primitives call, put before TVM's
    device_rewrite: Callable[[Any], Any] | None = None

    def parse(self, script: str):
        """The PrimFunc of a nest's script with this target's primitives."""
        import tvm
        from tvm.script.parser import tirx as T

        names = {"T": T, "tasks": self.tasks, "vectorized": self.vectorized, "SCRATCH": self.scratch,
                 "f16": self.f16, "prefetch": self.prefetch, "f16x16": self.f16x16, "load_as": self.load_as,
                 "dpbusd": self.dpbusd}
        return tvm.script.from_source(script, extra_vars=names)


def _f16_by_cpu(bits):  # F16C on x86
    import tvm
    return tvm.tirx.Cast("float32", tvm.tirx.reinterpret("float16", bits))


def _f16x16_by_cpu(bits):
    import tvm
    return tvm.tirx.Cast("float32x16", tvm.tirx.reinterpret("float16x16", bits))


def _llvm_load_as(t, w, at):
    import tvm
    from tvm import tirx
    nbytes = tvm.DataType(t).bits * tvm.DataType(t).lanes // 8
    return tirx.reinterpret(t, tirx.BufferLoad(w, [tirx.Ramp(at, 1, nbytes)]))


def _llvm_dpbusd(acc, u, x, at):
    """LLVM's intrinsic (its byte operands are <64 x i8> from LLVM 20, <16 x i32> before);
    LLVM folds the broadcast of the loaded word into the instruction."""
    import tvm
    from tvm import tirx
    word = tirx.Broadcast(tirx.reinterpret("int32", tirx.BufferLoad(x, [tirx.Ramp(at, 1, 4)])), 16)
    operands = "int8x64" if tvm.target.codegen.llvm_version_major() >= 20 else "int32x16"
    return tirx.call_llvm_pure_intrin("int32x16", "llvm.x86.avx512.vpdpbusd.512", acc,
                                      tirx.reinterpret(operands, u), tirx.reinterpret(operands, word))


def _llvm_prefetch(address):
    import tvm
    return tvm.tirx.call_llvm_intrin("void", "llvm.prefetch.p0", address, 0, 3, 1)


def _f16_by_helper(bits):  # OpenCL C on a CPU: the native kernels' helper (F16C), prepended
    import tvm
    return tvm.tirx.call_pure_extern("float32", "f16_to_f32", tvm.tirx.Cast("uint32", bits))


def _f16x16_by_helper(bits):  # the native kernels' helper (F16C)
    import tvm
    return tvm.tirx.call_pure_extern("float32x16", "f16x16_to_f32", bits)


# TVM vector types the OpenCL nests load from bytes (load_as), by their OpenCL C names
_CL_LOADED = {"int32x16": "int16", "uint16x16": "ushort16"}


def _cl_load_as(t, w, at):  # a prelude helper per type: an unaligned vector access
    import tvm
    return tvm.tirx.call_pure_extern(t, f"load_{_CL_LOADED[t]}", tvm.tirx.address_of(tvm.tirx.BufferLoad(w, [at])))


def _cl_dpbusd(acc, u, x, at):  # the native kernels' helper (inline assembly)
    import tvm
    return tvm.tirx.call_pure_extern("int32x16", "dpbusd_at", acc, u, tvm.tirx.address_of(tvm.tirx.BufferLoad(x, [at])))


def _cl_prefetch(address):  # OpenCL C on a CPU: clang's prefetch, by a prelude helper
    import tvm
    return tvm.tirx.call_extern("int32", "prefetch_line", address)


def _opencl_byte_vectors(mod):
    """The device module with each load of 2-16 consecutive bytes a vloadN call. TVM's
    OpenCL C reads a byte vector it cannot prove aligned (a block's fields, at any offset
    in blocks of 18-210 bytes) as shifts of one int, which computes garbage past four lanes;
    vloadN reads any alignment. A byte vector at other offsets (a gather) has no correct
    form there, so it is refused."""
    import tvm
    import tvm_ffi
    from tvm import tirx

    def load(node):
        t = tvm.DataType(str(node.ty))
        if t.bits != 8 or t.lanes == 1:
            return node
        index = node.indices[-1]
        if not (isinstance(index, tirx.Ramp) and isinstance(index.stride, tirx.IntImm) and int(index.stride) == 1
                and t.lanes in (2, 4, 8, 16)):
            raise ValueError(f"TVM's OpenCL C cannot gather the byte vector {node}")
        return tirx.call_pure_extern(str(t), f"vload{t.lanes}", 0, tirx.address_of(tirx.BufferLoad(node.source, [index.base])))

    return tvm_ffi.structural_map(mod, [(tvm.ir.expr.TensorLoad, load)])  # TIR's BufferLoad


def _parallel(n):
    from tvm.script.parser import tirx as T
    return T.parallel(n)


def _work_groups(n):
    from tvm.script.parser import tirx as T
    return T.thread_binding(n, thread="blockIdx.x")


def _vector(n):
    from tvm.script.parser import tirx as T
    return T.vectorized(n)


def _cl_vector(n):
    from tvm.script.parser import tirx as T
    return T.vectorized(n) if n in (1, 2, 3, 4, 8, 16) else T.unroll(n)


# TVM 0.27 makes a "global" buffer under 1 KiB inside a parallel loop a stack array of the
# task, which LLVM keeps in registers ("local" would be a heap workspace per iteration)
LLVM = NestTarget("llvm", _parallel, _vector, "global", _f16_by_cpu, _llvm_prefetch, _f16x16_by_cpu, _llvm_load_as,
                  _llvm_dpbusd)
# PoCL's vload16 / vstore16 of floats move a vector in 128-bit pieces, and a row stored so
# then read back (the delta rule's state) stalls on store forwarding: the nests' float
# vectors are read and written as unaligned 16-lane values instead (clang's aligned(4)
# vector type); other element types keep the built-ins (overloads that forward to them,
# defined before the names are taken over). tvm-opencl's 16-row delta rule went from
# 1.9-2.1x of opencl to 0.9x (alternated)
def _opencl_vectors() -> str:
    def overloads(t: str, load: str, store: str) -> list[str]:
        return [f"static inline __attribute__((overloadable)) {t}16 nest_vload16(size_t o, const {space} {t}* p) "
                f"{{ return {load.format(space=space)}; }}\n"
                f"static inline __attribute__((overloadable)) void nest_vstore16({t}16 v, size_t o, {space} {t}* p) "
                f"{{ {store.format(space=space)}; }}" for space in ("__global", "__private")]
    lines = []
    for t in ("float", "int"):
        lines += [f"typedef {t} {t}16_u __attribute__((ext_vector_type(16), aligned(4)));",
                  *overloads(t, f"*(const {{space}} {t}16_u*)(p + 16 * o)", f"*({{space}} {t}16_u*)(p + 16 * o) = v")]
    for t in ("char", "uchar", "short", "ushort", "uint", "long", "ulong"):
        lines += overloads(t, "vload16(o, p)", "vstore16(v, o, p)")
    for t in _CL_LOADED.values():
        lines += [f"typedef {t[:-2]} {t}_b __attribute__((ext_vector_type(16), aligned(1)));",
                  f"static inline {t} load_{t}(const __global uchar* p) {{ return *(const __global {t}_b*)p; }}"]
    return "\n".join(["", *lines, "#undef vload16", "#undef vstore16", "#define vload16 nest_vload16",
                      "#define vstore16 nest_vstore16", ""])


OPENCL_CPU = NestTarget("opencl-cpu", _work_groups, _cl_vector, "local", _f16_by_helper, _cl_prefetch,
                        _f16x16_by_helper, _cl_load_as, _cl_dpbusd,
                        OPENCL_F16_TO_F32 + OPENCL_F16X16_TO_F32 + OPENCL_DPBUSD_AT + """
static inline int prefetch_line(const __global void* p) {
  __builtin_prefetch(p);
  return 0;
}
""" + _opencl_vectors(), _opencl_byte_vectors)

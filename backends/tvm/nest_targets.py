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
  gathered(n)      the same where the lanes' loads are bytes a block decoder picks (TVM's
                   OpenCL C makes an unaligned byte vector shifts of an int: unrolled there)
  SCRATCH          the storage scope of a task's small arrays (kept in registers)
  f16(bits)        f32 of f16 bits (a uint16): F16C on both (OpenCL C calls the native
                   kernels' helper)
  prefetch(addr)   a hint to fetch the cache line at `addr` (an address_of)
  bytes16(w, at)   w[at .. at + 15] of a uint8 buffer as one uint8x16, at any alignment
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..kir.c import OPENCL_F16_TO_F32


@dataclass(frozen=True)
class NestTarget:
    name: str
    tasks: Callable[[Any], Any]
    vectorized: Callable[[int], Any]
    gathered: Callable[[int], Any]
    scratch: str
    f16: Callable[[Any], Any]
    prefetch: Callable[[Any], Any]
    bytes16: Callable[[Any, Any], Any]
    prelude: str = ""  # target source the nests' primitives call, put before TVM's

    def parse(self, script: str):
        """The PrimFunc of a nest's script with this target's primitives."""
        import tvm
        from tvm.script.parser import tirx as T

        names = {"T": T, "tasks": self.tasks, "vectorized": self.vectorized, "gathered": self.gathered,
                 "SCRATCH": self.scratch, "f16": self.f16, "prefetch": self.prefetch, "bytes16": self.bytes16}
        return tvm.script.from_source(script, extra_vars=names)


def _f16_by_cpu(bits):  # F16C on x86
    import tvm
    return tvm.tirx.Cast("float32", tvm.tirx.reinterpret("float16", bits))


def _llvm_prefetch(address):
    import tvm
    return tvm.tirx.call_llvm_intrin("void", "llvm.prefetch.p0", address, 0, 3, 1)


def _f16_by_helper(bits):  # OpenCL C on a CPU: the native kernels' helper (F16C), prepended
    import tvm
    return tvm.tirx.call_pure_extern("float32", "f16_to_f32", tvm.tirx.Cast("uint32", bits))


def _cl_prefetch(address):  # OpenCL C on a CPU: clang's prefetch, by a prelude helper
    import tvm
    return tvm.tirx.call_extern("int32", "prefetch_line", address)


def _ramp_load(w, at):
    import tvm
    return tvm.tirx.BufferLoad(w, [tvm.tirx.Ramp(at, 1, 16)])


def _vload16(w, at):
    import tvm
    return tvm.tirx.call_pure_extern("uint8x16", "vload16", 0, tvm.tirx.address_of(tvm.tirx.BufferLoad(w, [at])))


def _parallel(n):
    from tvm.script.parser import tirx as T
    return T.parallel(n)


def _work_groups(n):
    from tvm.script.parser import tirx as T
    return T.thread_binding(n, thread="blockIdx.x")


def _vector(n):
    from tvm.script.parser import tirx as T
    return T.vectorized(n)


def _unrolled(n):
    from tvm.script.parser import tirx as T
    return T.unroll(n)


def _cl_vector(n):
    from tvm.script.parser import tirx as T
    return T.vectorized(n) if n in (1, 2, 3, 4, 8, 16) else T.unroll(n)


# TVM 0.27 makes a "global" buffer under 1 KiB inside a parallel loop a stack array of the
# task, which LLVM keeps in registers ("local" would be a heap workspace per iteration)
LLVM = NestTarget("llvm", _parallel, _vector, _vector, "global", _f16_by_cpu, _llvm_prefetch, _ramp_load)
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
    lines = ["typedef float float16_u __attribute__((ext_vector_type(16), aligned(4)));",
             *overloads("float", "*(const {space} float16_u*)(p + 16 * o)", "*({space} float16_u*)(p + 16 * o) = v")]
    for t in ("char", "uchar", "short", "ushort", "int", "uint", "long", "ulong"):
        lines += overloads(t, "vload16(o, p)", "vstore16(v, o, p)")
    return "\n".join(["", *lines, "#undef vload16", "#undef vstore16", "#define vload16 nest_vload16",
                      "#define vstore16 nest_vstore16", ""])


OPENCL_CPU = NestTarget("opencl-cpu", _work_groups, _cl_vector, _unrolled, "local", _f16_by_helper, _cl_prefetch,
                        _vload16, OPENCL_F16_TO_F32 + """
static inline int prefetch_line(const __global void* p) {
  __builtin_prefetch(p);
  return 0;
}
""" + _opencl_vectors())

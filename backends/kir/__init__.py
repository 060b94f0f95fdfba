"""The kernel layer: kernels as trees built by Python code (ir.py, build.py), simplified by
the graph rewrite engine's matcher (simplify.py), lowered for targets that lack vectors or
subgroup reductions (lower.py), and printed by thin per-language printers (c.py for OpenCL,
CUDA and HIP; glsl.py for Vulkan). Launch sizes are the same trees printed as plan text
(size.py)."""
from .build import (BOOL, DT, F32, I16, I32, I64, U32, VOID, Array, Buffer, KernelBuilder, bitcast, call, call_function,
                    cast, const, dot4_i8, dpbusd_at, function, lift, maximum, minimum, select, var, vsum)
from .ir import K, Kernel, Param

__all__ = ["K", "Kernel", "Param", "KernelBuilder", "Buffer", "Array", "const", "lift", "cast", "bitcast", "select",
           "call", "call_function", "dot4_i8", "dpbusd_at", "function", "maximum", "minimum", "var", "vsum",
           "F32", "I16", "I32", "U32", "I64", "BOOL", "VOID", "DT"]

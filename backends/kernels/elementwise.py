"""Elementwise ops: one generated kernel family, one thread per output element, with numpy
broadcasting resolved at compile time into index expressions."""
from __future__ import annotations

from dflash_ir.dtypes import DType

from ..lowering import NodeCtx, lowers
from .common import broadcast_index, f32, flat_launch, read, write

_BINARY = {"add": "a + b", "sub": "a - b", "mul": "a * b", "div": "a / b",
           "swiglu": "a * sigmoid_f32(a) * b", "sigmoid_gate": "a * sigmoid_f32(b)"}
_UNARY = {"neg": "-a", "exp": "expf(a)", "sigmoid": "sigmoid_f32(a)", "silu": "a * sigmoid_f32(a)",
          "softplus": "softplus_f32(a)"}



@lowers(*_BINARY)
def binary(ctx: NodeCtx) -> None:
    a, b = ctx.ins
    shape = ctx.outs[0].type.shape
    ctype = "int" if a.type.dtype is DType.I32 else "float"
    flat_launch(ctx, f"  {ctype} a = x0[{broadcast_index('i', shape, a.type.shape)}], "
               f"b = x1[{broadcast_index('i', shape, b.type.shape)}];\n  out[i] = {_BINARY[ctx.node.op]};\n")


@lowers(*_UNARY)
def unary(ctx: NodeCtx) -> None:
    flat_launch(ctx, f"  float a = x0[i];\n  out[i] = {_UNARY[ctx.node.op]};\n")


@lowers("scale")
def scale(ctx: NodeCtx) -> None:
    flat_launch(ctx, f"  out[i] = x0[i] * {f32(ctx.attr['factor'])};\n")


_CASTS = {
    (DType.F32, DType.F16): "STORE_HALF(out, i, x0[i]);",
    (DType.F16, DType.F32): "out[i] = HALF_AT(x0, i);",
    (DType.F32, DType.I32): "out[i] = I32(x0[i]);",
    (DType.I32, DType.F32): "out[i] = F32(x0[i]);",
}


@lowers("cast")
def cast(ctx: NodeCtx) -> None:
    x, out = ctx.ins[0], ctx.outs[0]
    same = write(out, "out", "i", read(x, "x0", "i"))
    flat_launch(ctx, f"  {_CASTS.get((x.type.dtype, out.type.dtype), same)}\n")

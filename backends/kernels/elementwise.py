"""Elementwise ops: one thread per output element, numpy broadcasting resolved at compile
time into index expressions."""
from __future__ import annotations

from dflash_ir import activations
from dflash_ir.dtypes import DType

from ..kir import F32, I32, cast
from ..lowering import NodeCtx, lowers
from .access import KERNEL, read, write
from .shapes import broadcast_index, flat_launch


@lowers(*activations.BINARY)
def binary(ctx: NodeCtx) -> None:
    a, b = ctx.ins
    shape = ctx.outs[0].type.shape
    fn = activations.BINARY[ctx.node.op]

    def compute(kb, i, xs, out):
        out[i] = fn(KERNEL, *(x[broadcast_index(i, shape, v.type.shape)] for x, v in zip(xs, (a, b))))
    flat_launch(ctx, compute)


@lowers(*activations.UNARY)
def unary(ctx: NodeCtx) -> None:
    fn = activations.UNARY[ctx.node.op]

    def compute(kb, i, xs, out):
        out[i] = fn(KERNEL, xs[0][i])
    flat_launch(ctx, compute)


@lowers("scale")
def scale(ctx: NodeCtx) -> None:
    factor = float(ctx.attr["factor"])

    def compute(kb, i, xs, out):
        out[i] = xs[0][i] * factor
    flat_launch(ctx, compute)


@lowers("cast")
def cast_(ctx: NodeCtx) -> None:
    x, out_value = ctx.ins[0], ctx.outs[0]
    kinds = (x.type.dtype, out_value.type.dtype)

    def compute(kb, i, xs, out):
        if kinds == (DType.F32, DType.F16):
            out.store(i, xs[0][i], "f16")
        elif kinds == (DType.F16, DType.F32):
            out[i] = xs[0].load(i, "f16")
        elif kinds in ((DType.F32, DType.I32), (DType.I32, DType.F32)):
            out[i] = cast(I32 if kinds[1] is DType.I32 else F32, xs[0][i])
        else:
            write(out_value, out, i, read(x, xs[0], i))
    flat_launch(ctx, compute)

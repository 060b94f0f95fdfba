"""Elementwise ops as one spatial block over the output, broadcasting resolved into indices."""
from __future__ import annotations

from dflash_ir import activations
from dflash_ir.dtypes import DType

from .lowering import TVMNodeCtx, lowers
from .tir import activation, block, broadcast, dim, f32, flat, float_to_half, half_to_float


def axes(shape) -> list[tuple[str, str]]:
    """(block var, extent) per output dim."""
    return [(f"v{a}", dim(d)) for a, d in enumerate(shape)]


def spatial(ctx: TVMNodeCtx, op: str, inputs, out, value) -> None:
    """out[i] = value(read) where read(n) is input n at out's coords (broadcast)."""
    shape = out.type.shape
    grid = axes(shape)
    coords = [v for v, _ in grid]

    def read(n: int) -> str:
        return f"x{n}[{broadcast(coords, shape, inputs[n].type.shape)}]"

    body = f"out[{flat(coords, shape)}] = {value(read)}"
    ctx.kernel(op, [(f"x{n}", v, False) for n, v in enumerate(inputs)] + [("out", out, True)], block(grid, body))


@lowers(*activations.BINARY, *activations.UNARY)
def elementwise(ctx: TVMNodeCtx) -> None:
    op = ctx.node.op
    spatial(ctx, op, ctx.ins, ctx.outs[0], lambda r: activation(op, *(r(n) for n in range(len(ctx.ins)))))


@lowers("scale")
def scale(ctx: TVMNodeCtx) -> None:
    spatial(ctx, "scale", ctx.ins, ctx.outs[0], lambda r: f"{r(0)} * {f32(ctx.attr['factor'])}")


_CAST = {DType.F32: "float32", DType.I32: "int32", DType.I64: "int64"}


@lowers("cast")
def cast(ctx: TVMNodeCtx) -> None:
    """f16 values are bits: converted exactly (to f32) or rounded to nearest even (from f32)."""
    src, dst = ctx.ins[0].type.dtype, ctx.outs[0].type.dtype
    if src is dst:
        spatial(ctx, "copy", ctx.ins, ctx.outs[0], lambda r: r(0))
    elif src is DType.F16:
        spatial(ctx, "cast", ctx.ins, ctx.outs[0], lambda r: f'T.Cast("{_CAST[dst]}", {half_to_float(r(0))})')
    elif dst is DType.F16:
        spatial(ctx, "cast", ctx.ins, ctx.outs[0], lambda r: float_to_half(f'T.Cast("float32", {r(0)})'))
    else:
        spatial(ctx, "cast", ctx.ins, ctx.outs[0], lambda r: f'T.Cast("{_CAST[dst]}", {r(0)})')

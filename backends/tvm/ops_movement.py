"""Data movement: reshape is a view; slice, concat, transpose, gather and repeat are one
spatial block over the output reading the source element each output coordinate maps to."""
from __future__ import annotations

from .lowering import TVMNodeCtx, lowers
from .ops_elementwise import axes
from .tir import block, dim, flat


def _copy(ctx: TVMNodeCtx, op: str, inputs, source) -> None:
    """out[coords] = source(coords) for every output coordinate."""
    out = ctx.outs[0]
    grid = axes(out.type.shape)
    coords = [v for v, _ in grid]
    body = f"out[{flat(coords, out.type.shape)}] = {source(coords)}"
    ctx.kernel(op, [(f"x{n}", v, False) for n, v in enumerate(inputs)] + [("out", out, True)], block(grid, body))


def _axis(ctx: TVMNodeCtx) -> int:
    return ctx.attr["axis"] % ctx.ins[0].type.rank


@lowers("reshape")
def reshape(ctx: TVMNodeCtx) -> None:
    ctx.alias(ctx.outs[0], ctx.ins[0])


@lowers("slice")
def slice_(ctx: TVMNodeCtx) -> None:
    a, x = _axis(ctx), ctx.ins[0]
    start = ctx.attr["start"]
    _copy(ctx, "slice", [x], lambda c: f"x0[{flat(c[:a] + [f'{c[a]} + {start}'] + c[a + 1:], x.type.shape)}]")


@lowers("concat")
def concat(ctx: TVMNodeCtx) -> None:
    a = _axis(ctx)

    def source(c):
        parts, start = [], "0"
        for n, x in enumerate(ctx.ins):
            at = f"x{n}[{flat(c[:a] + [f'T.max({c[a]} - ({start}), 0)'] + c[a + 1:], x.type.shape)}]"
            start = f"{start} + {dim(x.type.shape[a])}"
            parts.append((f"{c[a]} < {start}", at))
        expr = parts[-1][1]
        for cond, at in reversed(parts[:-1]):
            expr = f"T.if_then_else({cond}, {at}, {expr})"
        return expr

    _copy(ctx, "concat", ctx.ins, source)


@lowers("transpose")
def transpose(ctx: TVMNodeCtx) -> None:
    x = ctx.ins[0]
    perm = ctx.attr["perm"]

    def source(c):
        src = [""] * len(perm)
        for d, p in enumerate(perm):
            src[p] = c[d]
        return f"x0[{flat(src, x.type.shape)}]"

    _copy(ctx, "transpose", [x], source)


@lowers("gather")
def gather(ctx: TVMNodeCtx) -> None:
    a = _axis(ctx)
    x, idx = ctx.ins
    ctx.check("index", idx, size=dim(x.type.shape[a]))
    r = idx.type.rank
    _copy(ctx, "gather", [x, idx],
          lambda c: f"x0[{flat(c[:a] + [f'x1[{flat(c[a:a + r], idx.type.shape)}]'] + c[a + r:], x.type.shape)}]")


@lowers("repeat")
def repeat(ctx: TVMNodeCtx) -> None:
    a, x = _axis(ctx), ctx.ins[0]
    n = dim(x.type.shape[a])
    src = "{} % " + n if ctx.attr.get("mode", "tile") == "tile" else "{} // " + str(ctx.attr["repeats"])
    _copy(ctx, "repeat", [x], lambda c: f"x0[{flat(c[:a] + [src.format(c[a])] + c[a + 1:], x.type.shape)}]")

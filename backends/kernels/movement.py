"""Data movement: reshape is a view; concat, slice, transpose, gather and repeat are copies,
one thread per output element reading the source element its index maps to."""
from __future__ import annotations

from typing import Sequence

from dflash_ir.ir import Value
from dflash_ir.types import Dim

from ..lowering import NodeCtx, lowers
from .common import coord, dim, flat_launch, prod, read, write



def _split(shape: Sequence[Dim], axis: int) -> str:
    """Statements binding o (outer), j (position on `axis`), r (inner) for output element i."""
    return _split_sizes(prod(shape[axis + 1:]), dim(shape[axis]))


def _split_sizes(inner: str, n: str) -> str:
    return f"  int r = i % {inner}, j = (i / {inner}) % {n}, o = i / ({inner} * {n});\n"


def _copy(ctx: NodeCtx, x: Value, src: str, buf: str = "x0") -> str:
    """out[i] = buf[src], in the element type of `x` (the output's)."""
    return write(ctx.outs[0], "out", "i", read(x, buf, src))


def _axis(ctx: NodeCtx) -> int:
    return ctx.attr["axis"] % ctx.ins[0].type.rank


@lowers("reshape")
def reshape(ctx: NodeCtx) -> None:
    ctx.alias(ctx.outs[0], ctx.ins[0])


@lowers("slice")
def slice_(ctx: NodeCtx) -> None:
    a, (x,) = _axis(ctx), ctx.ins
    inner = prod(x.type.shape[a + 1:])
    src = f"(o * {dim(x.type.shape[a])} + j + {ctx.attr['start']}) * {inner} + r"
    flat_launch(ctx, _split(ctx.outs[0].type.shape, a) + f"  {_copy(ctx, x, src)}\n")


@lowers("concat")
def concat(ctx: NodeCtx) -> None:
    a = _axis(ctx)
    inner = prod(ctx.outs[0].type.shape[a + 1:])
    lines, start = [], 0
    for n, x in enumerate(ctx.ins):
        size = x.type.shape[a]
        lines.append(f"if (j < {start + size}) {_copy(ctx, x, f'(o * {size} + j - {start}) * {inner} + r', f'x{n}')}")
        start += size
    flat_launch(ctx, _split(ctx.outs[0].type.shape, a) + "  " + "\n  else ".join(lines) + "\n")


@lowers("transpose")
def transpose(ctx: NodeCtx) -> None:
    src = ctx.ins[0].type.shape
    out = ctx.outs[0].type.shape
    terms = [f"{coord('i', out, d)} * {prod(src[p + 1:])}" for d, p in enumerate(ctx.attr["perm"])]
    flat_launch(ctx, f"  {_copy(ctx, ctx.ins[0], ' + '.join(terms) or '0')}\n")


@lowers("gather")
def gather(ctx: NodeCtx) -> None:
    a = _axis(ctx)
    x, idx = ctx.ins
    ctx.check("index", idx, size=dim(x.type.shape[a]))
    inner = prod(x.type.shape[a + 1:])
    src = f"(I64(o) * {dim(x.type.shape[a])} + x1[j]) * {inner} + r"
    flat_launch(ctx, _split_sizes(inner, prod(idx.type.shape)) + f"  {_copy(ctx, x, src)}\n")


@lowers("repeat")
def repeat(ctx: NodeCtx) -> None:
    a, (x,) = _axis(ctx), ctx.ins
    n = dim(x.type.shape[a])
    src = f"j % {n}" if ctx.attr.get("mode", "tile") == "tile" else f"j / {ctx.attr['repeats']}"
    flat_launch(ctx, _split(ctx.outs[0].type.shape, a) +
                f"  {_copy(ctx, x, f'(o * {n} + {src}) * {prod(x.type.shape[a + 1:])} + r')}\n")

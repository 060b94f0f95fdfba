"""Data movement: reshape is a view; concat, slice, transpose, gather and repeat are copies,
one thread per output element reading the source element its index maps to."""
from __future__ import annotations

from typing import Callable

from ..kir import I64, K, KernelBuilder, cast, const
from ..kir.build import Buffer
from ..lowering import NodeCtx, dim, lowers
from .access import read, write
from .shapes import coord, flat_launch, prod


def _split(kb: KernelBuilder, i: K, inner: K, n: K) -> tuple[K, K, K]:
    """o (outer index), j (position on an axis of n) and r (inner index, over the `inner`
    elements after that axis) of flat index i."""
    r = kb.let("r", i % inner)
    j = kb.let("j", i / inner % n)
    return kb.let("o", i / (inner * n)), j, r


def _copy(ctx: NodeCtx, out: Buffer, i: K, buf: Buffer, index: K) -> None:
    """out[i] = buf[index], raw elements of the output's dtype (every input's): copies keep
    the bits."""
    write(ctx.outs[0], out, i, read(ctx.outs[0], buf, index))


def _axis_copy(ctx: NodeCtx, inner: K, n: K, source: Callable[[K, K, K, list[Buffer]], K]) -> None:
    """A copy from the node's first input, a thread per output element i split as (o, j, r)
    on an axis of n: `source(o, j, r, xs)` is the index it reads."""
    def compute(kb, i, xs, out):
        _copy(ctx, out, i, xs[0], source(*_split(kb, i, inner, n), xs))
    flat_launch(ctx, compute)


def _axis(ctx: NodeCtx) -> int:
    return ctx.attr["axis"] % ctx.ins[0].type.rank


@lowers("reshape")
def reshape(ctx: NodeCtx) -> None:
    ctx.alias(ctx.outs[0], ctx.ins[0])


@lowers("slice")
def slice_(ctx: NodeCtx) -> None:
    a, (x,) = _axis(ctx), ctx.ins
    n, inner, start = dim(x.type.shape[a]), prod(x.type.shape[a + 1:]), ctx.attr["start"]
    _axis_copy(ctx, inner, dim(ctx.outs[0].type.shape[a]), lambda o, j, r, xs: (o * n + j + start) * inner + r)


@lowers("concat")
def concat(ctx: NodeCtx) -> None:
    """Output position j on the axis comes from the first input whose positions end after it."""
    a = _axis(ctx)
    shape = ctx.outs[0].type.shape
    inner = prod(shape[a + 1:])
    sizes = [x.type.shape[a] for x in ctx.ins]  # static: a concat axis has no symbols

    def compute(kb, i, xs, out):
        o, j, r = _split(kb, i, inner, dim(shape[a]))

        def copy_from(n: int) -> None:
            start, size = sum(sizes[:n]), sizes[n]
            with kb.if_(j < start + size):
                _copy(ctx, out, i, xs[n], (o * size + j - start) * inner + r)
            if n + 1 < len(sizes):
                with kb.else_():
                    copy_from(n + 1)
        copy_from(0)
    flat_launch(ctx, compute)


@lowers("transpose")
def transpose(ctx: NodeCtx) -> None:
    src = ctx.ins[0].type.shape
    shape = ctx.outs[0].type.shape

    def compute(kb, i, xs, out):
        index = sum((coord(i, shape, d) * prod(src[p + 1:]) for d, p in enumerate(ctx.attr["perm"])), const(0))
        _copy(ctx, out, i, xs[0], index)
    flat_launch(ctx, compute)


@lowers("gather")
def gather(ctx: NodeCtx) -> None:
    a = _axis(ctx)
    x, idx = ctx.ins
    n = dim(x.type.shape[a])
    ctx.check("index", idx, size=n)
    inner = prod(x.type.shape[a + 1:])
    _axis_copy(ctx, inner, prod(idx.type.shape), lambda o, j, r, xs: (cast(I64, o) * n + xs[1][j]) * inner + r)


@lowers("repeat")
def repeat(ctx: NodeCtx) -> None:
    a, (x,) = _axis(ctx), ctx.ins
    n, inner = dim(x.type.shape[a]), prod(x.type.shape[a + 1:])
    tile, repeats = ctx.attr.get("mode", "tile") == "tile", ctx.attr["repeats"]
    _axis_copy(ctx, inner, dim(ctx.outs[0].type.shape[a]),
               lambda o, j, r, xs: (o * n + (j % n if tile else j / repeats)) * inner + r)

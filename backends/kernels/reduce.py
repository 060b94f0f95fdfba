"""Reductions: row-wise norms and softmax (a work-group per row, tree reduction in local
memory), argmax (a work-group per row), top-k (a thread per row: k is small), and sum
(a thread per output, Kahan-compensated in f32). On a CPU that keeps vectors the norms and
argmax take a work-item per row instead (row_per_item)."""
from __future__ import annotations

from dflash_ir import activations
from dflash_ir.dtypes import DType
from dflash_ir.ops.reduce import precedes

from ..kir import F32, I32, I64, K, call, cast, const, maximum, select, var, vsum
from ..lowering import NodeCtx, dim, lowers
from . import access
from .shapes import FLAT, cdiv, flat_index, flat_launch, pow2_threads, prod


LANES = 16  # CPU: elements of a row one work-item takes at once (a 512-bit vector of f32)


def row_threads(n) -> int:
    return pow2_threads(n) if isinstance(n, int) else 256


def row_per_item(ctx: NodeCtx, n) -> bool:
    """Whether a row-wise kernel runs a work-item per row, LANES elements at a time: on a CPU
    that keeps vectors (PoCL), where a work-group's tree pays barriers that cost more than the
    row (argmax over 16 x 32768: 1.1 ms against 0.07), for rows a whole number of vectors."""
    return ctx.profile == "cpu" and ctx.row_streams > 1 and isinstance(n, int) and n % LANES == 0


def inverse_rms_lanes(kb, x, xr: K, n: int, eps: float, mean: bool = True, name: str = "ss") -> K:
    """inverse_rms of the row at xr summed by one work-item LANES wide (row_per_item): on the
    CPU every kernel that normalises a row (norms, norm-fed quantisation and tiles) sums so."""
    ss = kb.let(name, cast(F32.vec(LANES), 0.0))
    with kb.loop("c", 0, n, LANES) as c:
        v = kb.let("xv", x.load(xr + c, lanes=LANES))
        kb.set(ss, call("fma", v, v, ss))
    return kb.let(f"{name}_r", activations.inverse_rms(access.KERNEL, vsum(ss), float(n) if mean else None, float(eps)))


def inverse_rms(kb, x, xr: K, n: K, threads: int, eps: float, mean: bool = True) -> K:
    """1 / sqrt(mean(x²) + eps) (sum with mean=False) of the row at xr, summed by the
    work-group's `threads` in a tree: every kernel that normalises a row gets the same bits."""
    lid = kb.lid(0)
    red = kb.array("red", F32, threads, "local")
    acc = kb.let("acc", 0.0)
    with kb.loop("k", lid, n, threads) as k:
        kb.set(acc, acc + x[xr + k] * x[xr + k])
    red[lid] = acc
    kb.wg_reduce(red, threads, "sum")
    return kb.let("r", activations.inverse_rms(access.KERNEL, red[0], n if mean else None, float(eps)))


def _norm(ctx: NodeCtx, mean: bool) -> None:
    x_value = ctx.ins[0]
    n = x_value.type.shape[-1]
    w_value = ctx.ins[1] if len(ctx.ins) > 1 else None
    if row_per_item(ctx, n) and (w_value is None or w_value.type.dtype is DType.F32):
        _norm_rows(ctx, n, mean)
        return
    L, N = row_threads(n), dim(n)
    kb = ctx.kernel(ctx.node.op, local=(L,))
    x = kb.bind("x", x_value)
    w = kb.bind("w", w_value) if w_value else None
    out = kb.bind("out", ctx.outs[0], writes=True)
    row, lid = kb.let("row", kb.gid(0)), kb.let("lid", kb.lid(0))
    xr = kb.let("xr", cast(I64, row) * N)
    r = inverse_rms(kb, x, xr, N, L, ctx.attr["eps"], mean)
    with kb.loop("k", lid, N, L) as k:
        value = x[xr + k] * r
        out[xr + k] = value * access.weight_at(w_value.type.dtype, w, const(0), k, n) if w else value
    kb.launch([prod(x_value.type.shape[:-1])])


def _norm_rows(ctx: NodeCtx, n: int, mean: bool) -> None:
    """_norm with a work-item per row (row_per_item): the same products, x * r * w."""
    x_value, w_value = ctx.ins[0], ctx.ins[1] if len(ctx.ins) > 1 else None
    kb = ctx.kernel(ctx.node.op, local=(1,))
    x = kb.bind("x", x_value)
    w = kb.bind("w", w_value) if w_value else None
    out = kb.bind("out", ctx.outs[0], writes=True)
    xr = kb.let("xr", cast(I64, kb.gid(0)) * n)
    r = inverse_rms_lanes(kb, x, xr, n, ctx.attr["eps"], mean)
    with kb.loop("k", 0, n, LANES) as k:
        value = x.load(xr + k, lanes=LANES) * r
        out.store(xr + k, value * w.load(k, lanes=LANES) if w else value)
    kb.launch([prod(x_value.type.shape[:-1])])


@lowers("rmsnorm")
def rmsnorm(ctx: NodeCtx) -> None:
    _norm(ctx, mean=True)


@lowers("l2norm")
def l2norm(ctx: NodeCtx) -> None:
    _norm(ctx, mean=False)


def _along(o: K, n: K, k: K, inner: K, r: K) -> K:
    """Flat index of element k of the line (o, r) along an axis of n, with `inner` elements
    after that axis; the product with `inner` is 64-bit, where a tensor may pass 2^31 elements."""
    return cast(I64, o * n + k) * inner + r


@lowers("softmax")
def softmax(ctx: NodeCtx) -> None:
    """A work-group per line along the axis: max, then the sum of exponentials, each reduced
    in local memory."""
    x_value = ctx.ins[0]
    shape = x_value.type.shape
    a = ctx.attr.get("axis", -1) % len(shape)
    n, inner = shape[a], prod(shape[a + 1:])
    L, N = row_threads(n), dim(n)
    kb = ctx.kernel("softmax", local=(L,))
    x, out = kb.bind("x", x_value), kb.bind("out", ctx.outs[0], writes=True)
    line, lid = kb.let("line", kb.gid(0)), kb.let("lid", kb.lid(0))
    o, r = kb.let("o", line / inner), kb.let("r", line % inner)
    red = kb.array("red", F32, L, "local")
    m, s = kb.let("m", float("-inf")), kb.let("s", 0.0)
    with kb.loop("k", lid, N, L) as k:
        kb.set(m, maximum(m, x[_along(o, N, k, inner, r)]))
    red[lid] = m
    kb.wg_reduce(red, L, "max")
    kb.set(m, red[0])
    kb.barrier()  # every thread has read red[0] before it is overwritten
    with kb.loop("k", lid, N, L) as k:
        kb.set(s, s + call("exp", x[_along(o, N, k, inner, r)] - m))
    red[lid] = s
    kb.wg_reduce(red, L, "sum")
    kb.set(s, red[0])
    with kb.loop("k", lid, N, L) as k:
        at = _along(o, N, k, inner, r)
        out[at] = call("exp", x[at] - m) / s
    kb.launch([prod(shape[:a] + shape[a + 1:])])


@lowers("argmax")
def argmax(ctx: NodeCtx) -> None:
    """A work-group per row: each thread's first maximum, then a tree over (value, index)
    pairs in local memory that keeps the lower index on ties, as numpy does. On a CPU that
    keeps vectors, one work-item per row instead (_argmax_lanes)."""
    x_value = ctx.ins[0]
    n = x_value.type.shape[-1]
    if ctx.profile == "cpu" and ctx.row_streams > 1 and isinstance(n, int) and n >= LANES:
        _argmax_lanes(ctx, n)
        return
    L, N = row_threads(n), dim(n)
    kb = ctx.kernel("argmax", local=(L,))
    x, out = kb.bind("x", x_value), kb.bind("out", ctx.outs[0], writes=True)
    row, lid = kb.let("row", kb.gid(0)), kb.let("lid", kb.lid(0))
    xr = kb.let("xr", cast(I64, row) * N)
    best_v, best_i = kb.array("bv", F32, L, "local"), kb.array("bi", I32, L, "local")
    v, at = kb.let("v", float("-inf")), kb.let("at", N)
    with kb.loop("k", lid, N, L) as k:
        with kb.if_((x[xr + k] > v) | at.eq(N)):
            kb.set(v, x[xr + k])
            kb.set(at, k)
    best_v[lid], best_i[lid] = v, at
    kb.barrier()
    s = var("s")
    with kb.loop("s", L // 2, cond=s > 0, next=s >> 1):
        other = lid + s
        with kb.if_((lid < s) & precedes(access.KERNEL, best_v[other], best_i[other], best_v[lid], best_i[lid])):
            best_v[lid], best_i[lid] = best_v[other], best_i[other]
        kb.barrier()
    with kb.if_(lid.eq(0)):
        out[row] = best_i[0]
    kb.launch([prod(x_value.type.shape[:-1])])


def _argmax_lanes(ctx: NodeCtx, n: int) -> None:
    """A work-item per row keeps each of LANES lanes' first maximum over the row's
    elements at that lane's positions (a strictly greater value replaces it), then takes the
    lanes' best, the lowest index on ties, then the elements past the last whole vector: the
    first maximum, as numpy's. A work-group of threads pays the tree's barriers per row,
    which on a CPU cost more than the row (16 rows of 32768: 1.1 ms against ~0.1)."""
    x_value, lanes = ctx.ins[0], LANES
    main = n - n % lanes
    kb = ctx.kernel("argmax", local=(1,))
    x, out = kb.bind("x", x_value), kb.bind("out", ctx.outs[0], writes=True)
    row = kb.let("row", kb.gid(0))
    xr = kb.let("xr", cast(I64, row) * n)
    lane = kb.array("lane", I32, lanes, init=list(range(lanes))).vec(0, lanes)
    bv, bi = kb.let("bv", x.load(xr, lanes=lanes)), kb.let("bi", lane)
    with kb.loop("k", lanes, main, lanes) as k:
        xv = kb.let("xv", x.load(xr + k, lanes=lanes))
        kb.set(bi, select(xv > bv, lane + k, bi))
        kb.set(bv, select(xv > bv, xv, bv))
    values, indices = kb.array("values", F32, lanes), kb.array("indices", I32, lanes)
    kb.set(values.vec(0, lanes), bv)
    kb.set(indices.vec(0, lanes), bi)
    v, at = kb.let("v", values[0]), kb.let("at", indices[0])
    with kb.loop("j", 1, lanes) as j:
        with kb.if_(precedes(access.KERNEL, values[j], indices[j], v, at)):
            kb.set(v, values[j])
            kb.set(at, indices[j])
    with kb.loop("k", main, n) as k:
        with kb.if_(x[xr + k] > v):
            kb.set(v, x[xr + k])
            kb.set(at, k)
    out[row] = at
    kb.launch([prod(x_value.type.shape[:-1])])


@lowers("topk")
def topk(ctx: NodeCtx) -> None:
    """A thread per row (k is small). Pass p picks the first element, in the order `precedes`
    defines (ties to the lower index, as a stable descending sort), that comes after pass
    p-1's pick."""
    x_value = ctx.ins[0]
    k, N = ctx.attr["k"], dim(x_value.type.shape[-1])
    rows = prod(x_value.type.shape[:-1])
    kb = ctx.kernel("topk", local=(FLAT,))
    x = kb.bind("x", x_value)
    values, indices = kb.bind("values", ctx.outs[0], writes=True), kb.bind("indices", ctx.outs[1], writes=True)
    row = flat_index(kb, rows, "row")
    xr = kb.let("xr", cast(I64, row) * N)
    prev_v, prev_i = kb.let("pv", float("inf")), kb.let("pi", -1)
    with kb.loop("p", 0, k) as p:
        best_v, best_i = kb.let("bv", float("-inf")), kb.let("bi", -1)
        with kb.loop("j", 0, N) as j:
            v = kb.let("v", x[xr + j])
            with kb.if_(precedes(access.KERNEL, prev_v, prev_i, v, j) & ((best_i < 0) | (v > best_v))):
                kb.set(best_v, v)
                kb.set(best_i, j)
        values[row * k + p], indices[row * k + p] = best_v, best_i
        kb.set(prev_v, best_v)
        kb.set(prev_i, best_i)
    kb.launch([cdiv(rows, FLAT)])


@lowers("sum")
def sum_(ctx: NodeCtx) -> None:
    """A thread per output element; floats Kahan-compensated, so the sum stays within an ulp
    or two whatever the length."""
    x_value = ctx.ins[0]
    shape = x_value.type.shape
    a = ctx.attr["axis"] % len(shape)
    n, inner = dim(shape[a]), prod(shape[a + 1:])

    def compute(kb, i, xs, out):
        o, r = kb.let("o", i / inner), kb.let("r", i % inner)
        exact = x_value.type.dtype is DType.I32
        s = kb.let("s", 0 if exact else 0.0)
        c = None if exact else kb.let("c", 0.0)
        with kb.loop("j", 0, n) as j:
            value = xs[0][_along(o, n, j, inner, r)]
            if exact:
                kb.set(s, s + value)
            else:
                y = kb.let("y", value - c)
                t = kb.let("t", s + y)
                kb.set(c, (t - s) - y)
                kb.set(s, t)
        out[i] = s
    flat_launch(ctx, compute)

"""Reductions: norms and softmax as reduction blocks feeding a spatial block (dlight's
reduction rules schedule them on GPUs); argmax and top-k as a sequential scan per row
(ties to the lower index, as the reference's stable order); sum as one reduction block."""
from __future__ import annotations

from dflash_ir import activations
from dflash_ir.dtypes import DType
from dflash_ir.ops.reduce import precedes
from dflash_ir.types import TensorType

from .lowering import TVMNodeCtx, lowers
from .tir import TIR, _Text, block, dim, f32, prod, weight_at


def _norm(ctx: TVMNodeCtx, mean: bool) -> None:
    x = ctx.ins[0]
    n = x.type.shape[-1]
    N, rows = dim(n), prod(x.type.shape[:-1])
    ss = ctx.temp(TensorType(DType.F32, x.type.shape[:-1]))
    ctx.kernel(f"{ctx.node.op}_sumsq", [("x", x, False), ("ss", ss, True)],
               block([("r", rows)], f"ss[r] = ss[r] + x[r * {N} + k] * x[r * {N} + k]", reduce=[("k", N)],
                     init="ss[r] = T.float32(0)"))
    scale = activations.inverse_rms(TIR, _Text("ss[r]"), _Text(f"T.float32({N})") if mean else None,
                                    float(ctx.attr["eps"]))
    value = f"x[r * {N} + k] * {scale}"
    buffers = [("x", x, False), ("ss", ss, False)]
    if len(ctx.ins) > 1:
        w = ctx.ins[1]
        value += f" * {weight_at(w.type.dtype, 'w', '0', 'k', n)}"
        buffers.append(("w", w, False))
    ctx.kernel(ctx.node.op, buffers + [("out", ctx.outs[0], True)],
               block([("r", rows), ("k", N)], f"out[r * {N} + k] = {value}"))


@lowers("rmsnorm")
def rmsnorm(ctx: TVMNodeCtx) -> None:
    _norm(ctx, mean=True)


@lowers("l2norm")
def l2norm(ctx: TVMNodeCtx) -> None:
    _norm(ctx, mean=False)


def _lines(shape, axis: int) -> tuple[str, str, str, tuple]:
    """(outer, length, inner) extents around `axis` and the shape of one value per line."""
    return prod(shape[:axis]), dim(shape[axis]), prod(shape[axis + 1:]), shape[:axis] + shape[axis + 1:]


@lowers("softmax")
def softmax(ctx: TVMNodeCtx) -> None:
    x, out = ctx.ins[0], ctx.outs[0]
    a = ctx.attr.get("axis", -1) % x.type.rank
    outer, n, inner, line_shape = _lines(x.type.shape, a)
    m, s = (ctx.temp(TensorType(DType.F32, line_shape)) for _ in range(2))
    at = f"x[(o * {n} + k) * {inner} + r]"
    line = f"o * {inner} + r"
    grid = [("o", outer), ("r", inner)]
    ctx.kernel("softmax_max", [("x", x, False), ("m", m, True)],
               block(grid, f"m[{line}] = T.max(m[{line}], {at})", reduce=[("k", n)], init=f"m[{line}] = {f32(float('-inf'))}"))
    ctx.kernel("softmax_sum", [("x", x, False), ("m", m, False), ("s", s, True)],
               block(grid, f"s[{line}] = s[{line}] + T.exp({at} - m[{line}])", reduce=[("k", n)],
                     init=f"s[{line}] = T.float32(0)"))
    ctx.kernel("softmax", [("x", x, False), ("m", m, False), ("s", s, False), ("out", out, True)],
               block(grid + [("k", n)], f"out[(o * {n} + k) * {inner} + r] = T.exp({at} - m[{line}]) / s[{line}]"))


@lowers("argmax")
def argmax(ctx: TVMNodeCtx) -> None:
    x, out = ctx.ins[0], ctx.outs[0]
    N = dim(x.type.shape[-1])
    at = f"x[row * {N} + k]"
    body = (f"best[0] = {f32(float('-inf'))}\nbest[1] = T.float32(-1)\n"
            f"for k in range({N}):\n"
            f"    if T.Or({at} > best[0], best[1] < T.float32(0)):\n"
            f"        best[0] = {at}\n        best[1] = T.Cast(\"float32\", k)\n"
            f"out[row] = T.Cast(\"int32\", best[1])")
    ctx.sequential("argmax", [("x", x, False), ("out", out, True)], [("row", prod(x.type.shape[:-1]))], body,
                   [("best", 2)])


def topk_lines(v: str, k: int, n, emit) -> str:
    """Statements picking the k largest of v (an expression of j, over j < n), largest first,
    ties to the lower index: pass q picks the first element, in the order `precedes`
    defines, that comes after pass q-1's pick, into st[2] (value) and st[3] (index, as f32),
    then emit(q)'s lines run (st: an f32 scratch of 4)."""
    after = precedes(TIR, _Text("st[0]"), _Text("st[1]"), _Text(v), _Text('T.Cast("float32", j)'))
    return "\n".join([
        f"st[0] = {f32(float('inf'))}", "st[1] = T.float32(-1)", f"for q in range({k}):",
        f"    st[2] = {f32(float('-inf'))}", "    st[3] = T.float32(-1)", f"    for j in range({n}):",
        f"        if T.And({after}, T.Or(st[3] < T.float32(0), {v} > st[2])):",
        f"            st[2] = {v}", "            st[3] = T.Cast(\"float32\", j)",
        *[f"    {line}" for line in emit("q")], "    st[0] = st[2]", "    st[1] = st[3]"])


@lowers("topk")
def topk(ctx: TVMNodeCtx) -> None:
    x = ctx.ins[0]
    values, indices = ctx.outs
    k, N = ctx.attr["k"], dim(x.type.shape[-1])
    body = topk_lines(f"x[row * {N} + j]", k, N, lambda q: [f"values[row * {k} + {q}] = st[2]",
                                                               f'indices[row * {k} + {q}] = T.Cast("int32", st[3])'])
    ctx.sequential("topk", [("x", x, False), ("values", values, True), ("indices", indices, True)],
                   [("row", prod(x.type.shape[:-1]))], body, [("st", 4)])


@lowers("sum")
def sum_(ctx: TVMNodeCtx) -> None:
    x, out = ctx.ins[0], ctx.outs[0]
    a = ctx.attr["axis"] % x.type.rank
    outer, n, inner, _ = _lines(x.type.shape, a)
    zero = "T.int32(0)" if x.type.dtype is DType.I32 else "T.float32(0)"
    line = f"o * {inner} + r"
    ctx.kernel("sum", [("x", x, False), ("out", out, True)],
               block([("o", outer), ("r", inner)], f"out[{line}] = out[{line}] + x[(o * {n} + j) * {inner} + r]",
                     reduce=[("j", n)], init=f"out[{line}] = {zero}"))

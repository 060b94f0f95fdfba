"""Reductions: row-wise norms and softmax (a work-group per row, tree reduction in local
memory), argmax (a work-group per row), top-k (a thread per row: k is small), and sum
(a thread per output, Kahan-compensated in f32)."""
from __future__ import annotations

from dflash_ir.dtypes import DType

from ..kir import F32, I64, call as kcall, cast as kcast, const as kconst
from ..lowering import NodeCtx, dim as kdim, lowers
from . import access
from .shapes import prod as kprod
from .common import FLAT, cdiv, dim, f32, flat_launch, group_reduce, pow2_threads, prod, weight_at


def _row_threads(n) -> int:
    return pow2_threads(n) if isinstance(n, int) else 256


def _norm(ctx: NodeCtx, mean: bool) -> None:
    x_value = ctx.ins[0]
    n = x_value.type.shape[-1]
    L, N = _row_threads(n), kdim(n)
    kb = ctx.kernel(ctx.node.op, local=(L,))
    x = kb.bind("x", x_value)
    w_value = ctx.ins[1] if len(ctx.ins) > 1 else None
    w = kb.bind("w", w_value) if w_value else None
    out = kb.bind("out", ctx.outs[0], writes=True)
    row, lid = kb.let("row", kb.gid(0)), kb.let("lid", kb.lid(0))
    xr = kb.let("xr", kcast(I64, row) * N)
    red = kb.array("red", F32, L, "local")
    acc = kb.let("acc", 0.0)
    with kb.loop("k", lid, N, L) as k:
        kb.set(acc, acc + x[xr + k] * x[xr + k])
    red[lid] = acc
    kb.wg_reduce(red, L, "sum")
    r = kb.let("r", 1.0 / kcall("sqrt", (red[0] / N if mean else red[0]) + float(ctx.attr["eps"])))
    with kb.loop("k", lid, N, L) as k:
        value = x[xr + k] * r
        out[xr + k] = value * access.weight_at(w_value.type.dtype, w, kconst(0), k, n) if w else value
    kb.launch([kprod(x_value.type.shape[:-1])])


@lowers("rmsnorm")
def rmsnorm(ctx: NodeCtx) -> None:
    _norm(ctx, mean=True)


@lowers("l2norm")
def l2norm(ctx: NodeCtx) -> None:
    _norm(ctx, mean=False)


@lowers("softmax")
def softmax(ctx: NodeCtx) -> None:
    x = ctx.ins[0]
    shape = x.type.shape
    a = ctx.attr.get("axis", -1) % len(shape)
    n, inner = shape[a], prod(shape[a + 1:])
    L, N = _row_threads(n), dim(n)
    at = f"(I64(o * {N} + k) * {inner} + r)"
    body = (f"  int line = GID(0), lid = LID(0), o = line / {inner}, r = line % {inner};\n"
            f"  LOCAL float red[{L}];\n  float m = -INFINITY, s = 0.0f;\n"
            f"  for (int k = lid; k < {N}; k += {L}) m = fmaxf(m, x[{at}]);\n  red[lid] = m;\n"
            + group_reduce("red", L, "max") +
            f"  m = red[0];\n  BARRIER();\n"
            f"  for (int k = lid; k < {N}; k += {L}) s += expf(x[{at}] - m);\n  red[lid] = s;\n"
            + group_reduce("red", L, "sum") +
            f"  s = red[0];\n"
            f"  for (int k = lid; k < {N}; k += {L}) out[{at}] = expf(x[{at}] - m) / s;\n")
    ctx.launch("softmax", body, buffers=[("x", x, False), ("out", ctx.outs[0], True)],
               groups=[prod(shape[:a] + shape[a + 1:])], local=(L,))


@lowers("argmax")
def argmax(ctx: NodeCtx) -> None:
    x = ctx.ins[0]
    n = x.type.shape[-1]
    L, N = _row_threads(n), dim(n)
    body = (f"  int row = GID(0), lid = LID(0);\n  i64 xr = I64(row) * {N};\n"
            f"  LOCAL float bv[{L}];\n  LOCAL int bi[{L}];\n  float v = -INFINITY;\n  int at = {N};\n"
            f"  for (int k = lid; k < {N}; k += {L}) if (x[xr + k] > v || at == {N}) {{ v = x[xr + k]; at = k; }}\n"
            f"  bv[lid] = v;\n  bi[lid] = at;\n  BARRIER();\n"
            f"  for (int s = {L // 2}; s > 0; s >>= 1) {{\n"
            f"    if (lid < s && (bv[lid + s] > bv[lid] || (bv[lid + s] == bv[lid] && bi[lid + s] < bi[lid]))) {{\n"
            f"      bv[lid] = bv[lid + s];\n      bi[lid] = bi[lid + s];\n    }}\n    BARRIER();\n  }}\n"
            f"  if (lid == 0) out[row] = bi[0];\n")
    ctx.launch("argmax", body, buffers=[("x", x, False), ("out", ctx.outs[0], True)],
               groups=[prod(x.type.shape[:-1])], local=(L,))


@lowers("topk")
def topk(ctx: NodeCtx) -> None:
    """Pass p picks the largest (value, -index) strictly after pass p-1's pick in that order,
    so ties go to the lower index as in a stable descending sort."""
    x = ctx.ins[0]
    k, N = ctx.attr["k"], dim(x.type.shape[-1])
    rows = prod(x.type.shape[:-1])
    body = (f"  int row = GID(0) * {FLAT} + LID(0);\n  if (row >= {rows}) return;\n"
            f"  i64 xr = I64(row) * {N};\n  float pv = INFINITY;\n  int pi = -1;\n"
            f"  for (int p = 0; p < {k}; ++p) {{\n    float bv = -INFINITY;\n    int bi = -1;\n"
            f"    for (int j = 0; j < {N}; ++j) {{\n      float v = x[xr + j];\n"
            f"      if ((v < pv || (v == pv && j > pi)) && (bi < 0 || v > bv)) {{ bv = v; bi = j; }}\n    }}\n"
            f"    values[row * {k} + p] = bv;\n    indices[row * {k} + p] = bi;\n    pv = bv;\n    pi = bi;\n  }}\n")
    values, indices = ctx.outs
    ctx.launch("topk", body, buffers=[("x", x, False), ("values", values, True), ("indices", indices, True)],
               groups=[cdiv(rows, FLAT)])


@lowers("sum")
def sum_(ctx: NodeCtx) -> None:
    x = ctx.ins[0]
    shape = x.type.shape
    a = ctx.attr["axis"] % len(shape)
    n, inner = dim(shape[a]), prod(shape[a + 1:])
    at = f"x0[I64(o * {n} + j) * {inner} + r]"
    if x.type.dtype is DType.I32:
        loop = f"  int s = 0;\n  for (int j = 0; j < {n}; ++j) s += {at};\n"
    else:  # Kahan: the sum stays within an ulp or two whatever the length
        loop = (f"  float s = 0.0f, c = 0.0f;\n"
                f"  for (int j = 0; j < {n}; ++j) {{ float y = {at} - c, t = s + y; c = (t - s) - y; s = t; }}\n")
    flat_launch(ctx, f"  int o = i / {inner}, r = i % {inner};\n{loop}  out[i] = s;\n")

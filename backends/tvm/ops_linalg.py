"""Weight-consuming ops: dequantize, embedding, matmul (f32/f16/bf16/Q8_0 weights read in
their storage: Q8_0 blocks of an f16 scale + 32 int8 quants), the specialised matmuls
(optional residual; x may be Q8_0 blocks, made by quantize_q8_0 as quantize_row_q8_0) and
expert_matmul. Products are reduction blocks, which dlight's GEMV / matmul rules schedule;
on the cpu profile those of an f32 x (weights of any dtype, K a multiple of 32) and those of
a Q8_0 x over quant.Q8_X_TYPES weights (read from their dp4 pack, as the native VNNI tiles
read them) take cpu_schedules.py's loop nests."""
from __future__ import annotations

from dflash_ir.dtypes import DType
from dflash_ir.ir import Value
from dflash_ir.ops.specialised import OPS
from dflash_ir.quant import Q8_X_TYPES, cols16_layout
from dflash_ir.types import TensorType

from .cpu_schedules import expert_order, expert_product, expert_q8_x_product, product_nest, q8_product_nest
from .lowering import TVMNodeCtx, lowers
from .tir import block, dim, float_to_half, prod, q8_quant, q8_scale, round_half_away, weight_at


@lowers("dequantize")
def dequantize(ctx: TVMNodeCtx) -> None:
    w = ctx.ins[0]
    k = w.type.shape[-1]
    ctx.kernel("dequantize", [("w", w, False), ("out", ctx.outs[0], True)],
               block([("r", prod(w.type.shape[:-1])), ("c", dim(k))],
                     f"out[r * {dim(k)} + c] = {weight_at(w.type.dtype, 'w', 'r', 'c', k)}"))


@lowers("embedding")
def embedding(ctx: TVMNodeCtx) -> None:
    table, ids = ctx.ins
    k = table.type.shape[1]
    ctx.check("index", ids, size=dim(table.type.shape[0]))
    ctx.kernel("embedding", [("table", table, False), ("ids", ids, False), ("out", ctx.outs[0], True)],
               block([("t", prod(ids.type.shape)), ("c", dim(k))],
                     f"out[t * {dim(k)} + c] = {weight_at(table.type.dtype, 'table', 'ids[t]', 'c', k)}"))


def _product(ctx: TVMNodeCtx, op: str, buffers, m: str, n, k, term: str, out, cpu_body: str = "") -> None:
    """out[row, col] = sum over c of `term` (an expression of row, col, c)."""
    ctx.kernel(op, buffers + [("out", out, True)],
               block([("row", m), ("col", dim(n))], f"out[row * {dim(n)} + col] = out[row * {dim(n)} + col] + {term}",
                     reduce=[("c", dim(k))], init=f"out[row * {dim(n)} + col] = T.float32(0)"), cpu_body=cpu_body)


def _residual(ctx: TVMNodeCtx, product, residual, m: str, n) -> None:
    ctx.kernel("add_residual", [("product", product, False), ("residual", residual, False), ("out", ctx.outs[0], True)],
               block([("i", f"{m} * {dim(n)}")], "out[i] = product[i] + residual[i]"))


@lowers("matmul", *OPS.values())
def matmul(ctx: TVMNodeCtx) -> None:
    """x @ wᵀ [+ residual]: the specialised forms' `form` attr is a hint the rows decide."""
    x, w, *res = ctx.ins
    n, k = w.type.shape
    m = prod(x.type.shape[:-1])
    K = dim(k)
    product = ctx.temp(ctx.outs[0].type) if res else ctx.outs[0]  # then out = product + residual
    dtype = w.type.dtype
    q8_nest = (q8_product_nest(m, n, k, "avx512_vnni" in ctx.isa, dtype) if ctx.profile == "cpu"
               and x.type.dtype is DType.Q8_0 and dtype in Q8_X_TYPES else None)
    if q8_nest:  # integer sub-block sums over the dp4 pack, as the native tiles
        packed = ctx.packed([w], cols16_layout(dtype, dp4=True))
        ctx.kernel(f"matmul_q8_0_{dtype.value}", [("x", x, False), ("w", packed, False), ("out", product, True)], q8_nest,
                   cpu_body=q8_nest)
    elif x.type.dtype is DType.Q8_0 and dtype is DType.Q8_0:  # quants times both blocks' scales
        term = (f"{q8_quant('x', 'row', 'c', k)} * {q8_quant('w', 'col', 'c', k)} * "
                f"{q8_scale('x', 'row', 'c // 32', k)} * {q8_scale('w', 'col', 'c // 32', k)}")
        _product(ctx, "matmul_q8_0_q8_0", [("x", x, False), ("w", w, False)], m, n, k, term, product)
    elif x.type.dtype is DType.Q8_0:  # x's values d_x * q
        term = f"{weight_at(DType.Q8_0, 'x', 'row', 'c', k)} * {weight_at(dtype, 'w', 'col', 'c', k)}"
        _product(ctx, "matmul_q8_x", [("x", x, False), ("w", w, False)], m, n, k, term, product)
    else:  # with the llvm target's nest of an f32 x, where it has one
        term = f"x[row * {K} + c] * {weight_at(dtype, 'w', 'col', 'c', k)}"
        _product(ctx, "matmul", [("x", x, False), ("w", w, False)], m, n, k, term, product,
                 product_nest(m, n, k, dtype) or "")
    if res:
        _residual(ctx, product, res[0], m, n)


@lowers("quantize_q8_0")
def quantize_q8_0(ctx: TVMNodeCtx) -> None:
    x = ctx.ins[0]
    if ctx.attr.get("norm_eps") is not None:  # the norm prologue: the rmsnorm first, into a temporary
        x = ctx.sub("rmsnorm", x, ctx.ins[1], eps=ctx.attr["norm_eps"])
    quantize_rows(ctx, "quantize_q8_0", [("x", x)], lambda at: f"x[{at}]", ctx.outs[0])


def quantize_rows(ctx: TVMNodeCtx, op: str, inputs, element, out: Value) -> None:
    """Q8_0 blocks of the rows of out's shape whose element at flat index `at` is element(at)
    (over `inputs`, (param name, value) pairs), a point per 32-block: scale amax / 127 stored
    as f16 bits, quants round-half-away of each element times the unrounded scale's inverse
    (quantize_row_q8_0)."""
    k = out.type.shape[-1]
    blocks = k // 32
    at = element(f"row * {k} + b * 32 + e")
    base = f"(row * {blocks} + b) * 34"
    bits = float_to_half("s[1]")
    body = ("s[0] = T.float32(0)\n"
            f"for e in range(32):\n    s[0] = T.max(s[0], T.fabs({at}))\n"
            "s[1] = s[0] / T.float32(127)\n"
            "s[2] = T.if_then_else(s[1] == T.float32(0), T.float32(0), T.float32(1) / s[1])\n"
            f'out[{base}] = T.Cast("uint8", T.bitwise_and({bits}, T.uint16(255)))\n'
            f'out[{base} + 1] = T.Cast("uint8", T.shift_right({bits}, T.uint16(8)))\n'
            f"for e in range(32):\n"
            f'    out[{base} + 2 + e] = T.reinterpret("uint8", T.Cast("int8", {round_half_away(f"{at} * s[2]")}))')
    ctx.sequential(op, [(name, v, False) for name, v in inputs] + [("out", out, True)],
                   [("row", prod(out.type.shape[:-1])), ("b", str(blocks))], body, [("s", 3)])


@lowers("expert_matmul")
def expert_matmul(ctx: TVMNodeCtx) -> None:
    """out[t, s] = x[t (, s)] @ w[ids[t, s]]ᵀ: only the selected expert's rows are read; a Q8_0
    x read as its values d_x * q, as matmul's. On the cpu profile the experts take the expert
    nests (of an f32 x over any weights the dense nest takes, or of a Q8_0 x over a
    Q8_X_TYPES type's dp4 pack), after a launch that sorts the pairs by expert."""
    x, w, ids = ctx.ins
    out = ctx.outs[0]
    experts, n, k = w.type.shape
    dtype = w.type.dtype
    slots = dim(ids.type.shape[1])
    N, K = dim(n), dim(k)
    rows = prod(ids.type.shape)
    if (ctx.profile == "cpu" and all(isinstance(d, int) for d in (experts, n, k)) and k % 32 == 0
            and (x.type.dtype is DType.F32 or x.type.dtype is DType.Q8_0 and dtype in Q8_X_TYPES)):
        def sort() -> tuple[Value, Value]:
            count, order = ctx.temp(TensorType(DType.I32, (experts + 2,))), ctx.temp(TensorType(DType.I32, ids.type.shape))
            ctx.sequential("expert_order", [("ids", ids, False), ("count", count, True), ("order", order, True)], [],
                           expert_order(rows, experts))
            return count, order
        count, order = ctx.once(("expert_order", ids.name), sort)  # a fused MoE's products share it
        if x.type.dtype is DType.Q8_0:  # integer sub-block sums over the dp4 pack, as the dense products
            w = ctx.packed([w], cols16_layout(dtype, dp4=True))
            nest = expert_q8_x_product(n, k, experts, slots, x.type.rank == 2, "avx512_vnni" in ctx.isa, dtype)
        else:
            nest = expert_product(n, k, experts, slots, x.type.rank == 2, dtype)
        ctx.kernel("expert_matmul", [("x", x, False), ("w", w, False), ("count", count, False), ("order", order, False),
                                     ("out", out, True)], nest, cpu_body=nest)
        return
    xrow = f"(p // {slots})" if x.type.rank == 2 else "p"
    xv = weight_at(DType.Q8_0, "x", xrow, "c", k) if x.type.dtype is DType.Q8_0 else f"x[{xrow} * {K} + c]"
    term = f"{xv} * {weight_at(w.type.dtype, 'w', f'ids[p] * {N} + col', 'c', k)}"
    ctx.kernel("expert_matmul", [("x", x, False), ("w", w, False), ("ids", ids, False), ("out", out, True)],
               block([("p", rows), ("col", N)], f"out[p * {N} + col] = out[p * {N} + col] + {term}",
                     reduce=[("c", K)], init=f"out[p * {N} + col] = T.float32(0)"))


@lowers("matmul_group")
def matmul_group(ctx: TVMNodeCtx) -> None:
    """The group as its members' matmuls, one kernel each."""
    x, *weights = ctx.ins
    a = ctx.attr
    for w, out, n in zip(weights, ctx.outs, a["Ns"]):
        ctx.sub(a["op"], x, w, outputs=[out], form=a["form"], K=a["K"], N=n, layout=a["layout"])

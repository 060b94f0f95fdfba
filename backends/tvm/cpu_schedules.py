"""Hand-scheduled TensorIR for the llvm target: the Q8_0 product as an explicit loop nest.

dlight's CPU GEMV rule sees one reduction over K whose every element decodes its block's
f16 scale again, and vectorises nothing; this nest is what the product needs on a CPU with
wide vectors (AVX-512 here: 16 f32 lanes, one 32-quant block is two vectors):

- parallel over groups of output columns (N is >= 256 in every model layer, so the
  threads have work without splitting K: split-K would only add a reduction pass);
- per column and 32-block: the f16 scale converted once (F16C), the block's quants
  widened to f32 and scaled: the block scale is applied per block, to the weights;
- those dequantised vectors then serve every row of a pass (up to 16 rows: a DFlash
  verify block) each keeping LANES partial sums per column in registers, so a weight is
  read and decoded once per pass, not once per row; fewer rows take more columns per
  task (PASSES), one row (decode) four, to keep several weight streams in flight.

The partial sums are reduced across lanes at the end of each column. The interpreter and
the native kernels sum in other orders: results agree to rounding (tests/kernel_cases.py).
"""
from __future__ import annotations

from dflash_ir.types import Dim

LANES = 16  # f32 lanes of one AVX-512 vector
# (rows per pass, columns per task): a pass keeps rows x columns vectors of partial sums in
# registers (16 of AVX-512's 32); a product takes the most rows per pass that its rows fill
PASSES = ((8, 2), (4, 4), (2, 4), (1, 4))


def _nest(rows: int, cols: int, m: str, n: int, k: int) -> list[str]:
    """Loop nest lines for passes of `rows` rows (m >= rows) over `cols` columns per task.
    The last pass starts at m - rows, recomputing some rows of the one before (the same
    values): every row of a pass is real, so its x rows sit at constant offsets from one
    pointer. Each row's partial sums are a small buffer of its own, rows unrolled here:
    TVM 0.27 makes a "global" buffer under 1 KiB inside a parallel loop a stack array of
    the task (a "local" one is a heap workspace per iteration), which LLVM keeps in registers."""
    blocks, stride = k // 32, k // 32 * 34
    first = f"T.min(r0 * {rows}, {m} - {rows})"
    at = f"(cg * {cols} + c) * {stride} + b * 34"
    scale = (f'T.Cast("float32", T.reinterpret("float16", T.bitwise_or(T.Cast("uint16", w[{at}]), '
             f'T.shift_left(T.Cast("uint16", w[{at} + 1]), T.uint16(8)))))')
    quant = f'T.Cast("float32", T.reinterpret("int8", w[{at} + 2 + h * {LANES} + l]))'

    def acc(r: int) -> str:
        return f"acc{r}[c * {LANES} + l]"

    def out(r: int) -> str:
        return f"out[({first} + {r}) * {n} + cg * {cols} + c]"

    lines = [f"for cg in T.parallel({n // cols}):",
             f"    for r0 in range(({m} + {rows - 1}) // {rows}):",
             f'        wq = T.alloc_buffer(({LANES},), "float32", scope="global")',
             f'        lanes = T.alloc_buffer(({LANES},), "float32", scope="global")']
    lines += [f'        acc{r} = T.alloc_buffer(({cols * LANES},), "float32", scope="global")' for r in range(rows)]
    lines += [f"        for c in T.unroll({cols}):", f"            for l in T.vectorized({LANES}):"]
    lines += [f"                {acc(r)} = T.float32(0)" for r in range(rows)]
    lines += [f"        for b in range({blocks}):",
              f"            for c in T.unroll({cols}):",
              "                for h in T.unroll(2):",
              f"                    for l in T.vectorized({LANES}):",
              f"                        wq[l] = {scale} * {quant}",
              f"                    for l in T.vectorized({LANES}):"]
    lines += [f"                        {acc(r)} = {acc(r)} + x[({first} + {r}) * {k} + b * 32 + h * {LANES} + l] * wq[l]"
              for r in range(rows)]
    lines += [f"        for c in T.unroll({cols}):"]
    for r in range(rows):  # lanes summed through a buffer of their own: acc's stay whole vectors
        lines += [f"            for l in T.vectorized({LANES}):", f"                lanes[l] = {acc(r)}",
                  f"            {out(r)} = T.float32(0)", f"            for l in T.unroll({LANES}):",
                  f"                {out(r)} = {out(r)} + lanes[l]"]
    return lines


def q8_product(m: str, n: Dim, k: Dim) -> str | None:
    """PrimFunc body computing out[m, n] = x[m, k] @ w[n, k]ᵀ with w in Q8_0 blocks, or None
    when the shape is not one the nest covers (symbolic N or K)."""
    if not isinstance(n, int) or not isinstance(k, int):
        return None
    variants = [(rows, _nest(rows, cols if n % cols == 0 else 1, m, n, k)) for rows, cols in PASSES]
    if m.isdigit():  # rows fixed at compile time
        return "\n".join(_indent(next(nest for rows, nest in variants if int(m) >= rows), 1)) + "\n"
    lines = []
    for i, (rows, nest) in enumerate(variants[:-1]):
        lines += [("el" if i else "") + f"if {m} >= {rows}:", *_indent(nest, 1)]
    return "\n".join(_indent(lines + ["else:", *_indent(variants[-1][1], 1)], 1)) + "\n"


def _indent(lines: list[str], levels: int) -> list[str]:
    return ["    " * levels + s for s in lines]

"""C-expression helpers shared by the kernel builders (dims, indexing, weight loads, reductions).

Size expressions are written so the same text is valid C (kernel bodies, int params named
`n_<symbol>`) and a plan size expression (`compile_expr`): ints, symbol names, `*`, `+`.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from dflash_ir.dtypes import DType
from dflash_ir.ir import Value
from dflash_ir.types import Dim

from ..lowering import CTYPES
from ..plan import symbol_param

FLAT = 256  # work-group size of one-thread-per-element kernels


def dim(d: Dim) -> str:
    return str(d) if isinstance(d, int) else symbol_param(d)


def prod(dims: Sequence[Dim]) -> str:
    """Product of dims as an expression; ints folded, "1" when empty."""
    const = math.prod(d for d in dims if isinstance(d, int))
    names = [dim(d) for d in dims if not isinstance(d, int)]
    if not names:
        return str(const)
    terms = names + ([str(const)] if const != 1 else [])
    return "(" + "*".join(terms) + ")"


def cdiv(total: str, by: int) -> str:
    return f"cdiv({total}, {by})"


def f32(x: float) -> str:
    """A float32 constant as a C literal that round-trips exactly."""
    v = np.float32(x)
    if np.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    return f"{float(v)!r}f"  # the shortest decimal of the f32 value parses back to it


def f32_table(values) -> str:
    return "{" + ", ".join(f32(v) for v in values) + "}"


def flat_launch(ctx, statements: str, *, inputs=None, op: str | None = None) -> None:
    """Launch a one-thread-per-output-element kernel: `statements` compute out[i] from the
    inputs x0, x1, ... (the node's, by default) for i in [0, number of output elements)."""
    out = ctx.outs[0]
    total = prod(out.type.shape)
    body = f"  int i = GID(0) * {FLAT} + LID(0);\n  if (i >= {total}) return;\n{statements}"
    inputs = ctx.ins if inputs is None else inputs
    buffers = [(f"x{n}", v, False) for n, v in enumerate(inputs)] + [("out", out, True)]
    ctx.launch(op or ctx.node.op, body, buffers=buffers, groups=[cdiv(total, FLAT)])


def coord(i: str, dims: Sequence[Dim], axis: int) -> str:
    """Coordinate `axis` of flat row-major index i over `dims`."""
    inner = prod(dims[axis + 1:])
    q = i if inner == "1" else f"({i} / {inner})"
    return q if axis == 0 else f"({q} % {dim(dims[axis])})"


def broadcast_index(i: str, out: Sequence[Dim], src: Sequence[Dim]) -> str:
    """Flat index into `src` of output element i, numpy broadcasting `src` to `out`."""
    src = (1,) * (len(out) - len(src)) + tuple(src)
    if tuple(src) == tuple(out):
        return i
    kept = [a for a in range(len(out)) if src[a] != 1]
    if not kept:
        return "0"
    # runs of consecutive kept axes collapse into one coordinate
    runs, start = [], kept[0]
    for a, b in zip(kept, kept[1:] + [None]):
        if b != a + 1:
            runs.append((start, a))
            start = b
    terms = []
    for lo, hi in runs:
        outer = prod(out[hi + 1:])
        q = i if outer == "1" else f"({i} / {outer})"
        if lo > 0:
            q = f"({q} % {prod(out[lo:hi + 1])})"
        stride = prod([d for a, d in enumerate(src) if a > hi and d != 1])
        terms.append(q if stride == "1" else f"{q} * {stride}")
    return " + ".join(terms)


def weight_at(dtype: DType, buf: str, row: str, col: str, k: Dim) -> str:
    """f32 value of element (row, col) of a weight buffer stored as `dtype` with row length k."""
    flat = f"I64({row}) * {dim(k)} + ({col})"
    if dtype is DType.F32:
        return f"{buf}[{flat}]"
    if dtype is DType.F16:
        return f"HALF_AT({buf}, {flat})"
    if dtype is DType.BF16:
        return f"BF16_AT({buf}, {flat})"
    if dtype is DType.Q8_0:
        return f"Q8_0_AT({buf}, I64({row}) * {q8_row_bytes(k)}, {col})"
    raise ValueError(f"{dtype} is not a weight dtype")


def q8_0_split_at(buf: str, row: str, col: str, k: int, blocks: int) -> str:
    """f32 value of element (row, col) of a Q8_0 weight with rows of k in the split layout
    (`blocks` blocks in all: their quants, then their scales; plan.LAYOUTS)."""
    return (f"(F32(LD_I8({buf}, I64({row}) * {k} + ({col}))) * "
            f"HALF_AT_BYTE({buf}, {blocks * 32} + (I64({row}) * {k // 32} + ({col}) / 32) * 2))")


def read(v: Value, buf: str, index: str) -> str:
    """Element `index` of `v`'s buffer `buf`, any dtype: narrow elements go through the
    LD_ macros (GLSL may store them packed in 32-bit words)."""
    narrow = _NARROW_LOADS.get(CTYPES[v.type.dtype])
    return f"{narrow}({buf}, {index})" if narrow else f"{buf}[{index}]"


def write(v: Value, buf: str, index: str, value: str) -> str:
    """The statement storing `value` (as `read` returns it) at element `index` of `buf`."""
    narrow = _NARROW_STORES.get(CTYPES[v.type.dtype])
    return f"{narrow}({buf}, {index}, {value});" if narrow else f"{buf}[{index}] = {value};"


_NARROW_LOADS = {"u8": "LD_U8", "u16": "LD_U16"}
_NARROW_STORES = {"u8": "ST_U8", "u16": "ST_U16"}


def q8_row_bytes(k: Dim) -> str:
    return f"({dim(k)} / 32 * 34)"


def group_reduce(buf: str, n: int, op: str) -> str:
    """In-place work-group reduction ("sum" or "max") of LOCAL `buf[n]` (n a power of two,
    the work-group size, indexed by `lid`) into buf[0]; ends with a barrier."""
    return f"  WG_{op.upper()}({buf}, {n});\n"


def pow2_threads(n: int, most: int = 256, least: int = 32) -> int:
    """Work-group size for a reduction over n elements: a power of two in [least, most]."""
    return max(least, min(most, 1 << max(0, (n - 1).bit_length())))

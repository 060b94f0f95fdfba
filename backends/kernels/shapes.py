"""Index arithmetic shared by the kernel builders, as kernel-tree expressions: dims (a
constant or the symbol's int parameter), products, ceiling division, coordinates of a
flat index, numpy broadcasting, and the one-thread-per-output-element launch."""
from __future__ import annotations

import math
from typing import Callable, Sequence

from dflash_ir.ir import Value
from dflash_ir.types import Dim

from ..kir import K, KernelBuilder, const
from ..kir.build import Buffer
from ..lowering import KernelSpec, NodeCtx, dim

FLAT = 256  # work-group size of one-thread-per-element kernels

__all__ = ["FLAT", "dim", "prod", "cdiv", "coord", "broadcast_index", "flat_launch", "flat_index",
           "pow2_threads"]


def prod(dims: Sequence[Dim]) -> K:
    """The product of dims (constants folded)."""
    out = const(math.prod(d for d in dims if isinstance(d, int)))
    for d in dims:
        if not isinstance(d, int):
            out = dim(d) * out
    return out


def cdiv(total: K | int, by: int) -> K:
    return (total + (by - 1)) / by


def coord(i: K, dims: Sequence[Dim], axis: int) -> K:
    """Coordinate `axis` of flat row-major index i over `dims`."""
    q = i / prod(dims[axis + 1:])
    return q if axis == 0 else q % dim(dims[axis])


def broadcast_index(i: K, out: Sequence[Dim], src: Sequence[Dim]) -> K:
    """Flat index into `src` of output element i, numpy broadcasting `src` to `out`."""
    src = (1,) * (len(out) - len(src)) + tuple(src)
    if tuple(src) == tuple(out):
        return i
    kept = [a for a in range(len(out)) if src[a] != 1]
    if not kept:
        return const(0)
    runs, start = [], kept[0]  # runs of consecutive kept axes collapse into one coordinate
    for a, b in zip(kept, kept[1:] + [None]):
        if b != a + 1:
            runs.append((start, a))
            start = b
    total = const(0)
    for lo, hi in runs:
        q = i / prod(out[hi + 1:])
        if lo > 0:
            q = q % prod(out[lo:hi + 1])
        total = total + q * prod([d for a, d in enumerate(src) if a > hi and d != 1])
    return total


def flat_launch(ctx: NodeCtx, compute: Callable[[KernelSpec, K, list[Buffer], Buffer], None], *,
                inputs: Sequence[Value] | None = None, op: str | None = None) -> None:
    """Launch a one-thread-per-output-element kernel: `compute(kb, i, xs, out)` adds to kb
    the statements storing out[i] from the input buffers xs (the node's inputs, by
    default) for i in [0, number of output elements)."""
    out_value = ctx.outs[0]
    kb = ctx.kernel(op or ctx.node.op, local=(FLAT,))
    xs = [kb.bind(f"x{n}", v) for n, v in enumerate(ctx.ins if inputs is None else inputs)]
    out = kb.bind("out", out_value, writes=True)
    total = prod(out_value.type.shape)
    compute(kb, flat_index(kb, total), xs, out)
    kb.launch([cdiv(total, FLAT)])


def flat_index(kb: KernelBuilder, total: K, name: str = "i") -> K:
    """This thread's index in a launch of cdiv(total, FLAT) groups of FLAT threads; the
    threads past `total` return."""
    i = kb.let(name, kb.gid(0) * FLAT + kb.lid(0))
    kb.return_if(i >= total)
    return i


def pow2_threads(n: int, most: int = 256, least: int = 32) -> int:
    """Work-group size for a reduction over n elements: a power of two in [least, most]."""
    return max(least, min(most, 1 << max(0, (n - 1).bit_length())))

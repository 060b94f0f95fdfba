"""Data movement: concat, slice, reshape, transpose, gather, repeat.

Result dims must be nameable: an int or a symbol carried through unchanged. Ops that would
produce a derived size from a symbol (T + 16, T - 1, 2T) reject it in their rule.
"""
from __future__ import annotations

import math

import numpy as np

from ..dtypes import DType
from ..types import Dim, TensorType, format_shape
from .linalg import check_indices
from .rules import check, choice_attr, defop, expect_dtype, expect_same, int_attr, normalize_axis

# block-quantised values move only through the ops that dequantise them
_DATA_DTYPES = tuple(d for d in DType if not d.is_block)


def _prefer_int(dims) -> Dim:
    """Of dims known to be equal, the int if there is one (a symbol bound to it is that int)."""
    return next((d for d in dims if isinstance(d, int)), dims[0])


def _concat_rule(*xs: TensorType, axis) -> TensorType:
    check(len(xs) >= 1, "needs at least one input")
    first = xs[0]
    a = normalize_axis(axis, first.rank)
    for x in xs:
        expect_dtype("input", x, *_DATA_DTYPES)
        check(x.dtype == first.dtype and x.rank == first.rank,
              f"inputs must share dtype and rank: {', '.join(map(str, xs))}")
    shape = []
    for i in range(first.rank):
        dims = [x.shape[i] for x in xs]
        if i == a:
            check(all(isinstance(d, int) for d in dims),
                  f"axis {a} sizes {dims} include symbols, so the result size has no name")
            shape.append(sum(dims))
        else:
            for d in dims[1:]:
                expect_same(f"dim {i}", d, f"dim {i}", dims[0], xs)
            shape.append(_prefer_int(dims))
    return TensorType(first.dtype, tuple(shape))


@defop("concat", _concat_rule)
def concat(*xs, axis):
    """The inputs joined along `axis` (a static-size axis)."""
    return np.concatenate(xs, axis=axis)


def _slice_rule(x: TensorType, *, axis, start, stop) -> TensorType:
    expect_dtype("x", x, *_DATA_DTYPES)
    a = normalize_axis(axis, x.rank)
    int_attr("start", start, minimum=0)
    if stop is not None:
        int_attr("stop", stop, minimum=start)
    dim = x.shape[a]
    if isinstance(dim, int):
        end = dim if stop is None else stop
        check(end <= dim, f"stop {end} is past the end of axis {a} of {x}")
        size: Dim = end - start
    elif stop is None:
        check(start == 0, f"slicing symbolic axis {a} of {x} from {start} to its end has no nameable size")
        size = dim
    else:
        size = stop - start
    return TensorType(x.dtype, x.shape[:a] + (size,) + x.shape[a + 1:])


@defop("slice", _slice_rule)
def slice_(x, *, axis, start, stop=None):
    """Rows [start, stop) of `axis` (stop=None: to the end); static, non-negative bounds."""
    end = x.shape[axis] if stop is None else stop
    if end > x.shape[axis]:
        raise ValueError(f"slice: stop {end} is past the end of axis {axis} (size {x.shape[axis]})")
    index = [slice(None)] * x.ndim
    index[axis] = slice(start, end)
    return x[tuple(index)]


def _reshape_rule(x: TensorType, *, shape) -> TensorType:
    """Symbols may only form a leading prefix of the target, equal to x's leading dims (so
    they are carried through unchanged and the reference can read them off x); the rest of
    x must be ints, and the tails must hold the same number of elements (one -1 allowed)."""
    expect_dtype("x", x, *_DATA_DTYPES)
    check(isinstance(shape, (tuple, list)), f"shape must be a tuple, got {shape!r}")
    shape = tuple(shape)
    lead = next((i for i, d in enumerate(shape) if not isinstance(d, str)), len(shape))
    tail = shape[lead:]
    for d in tail:
        check(not isinstance(d, str), f"symbols must lead the target shape {format_shape(shape)}")
        int_attr("shape entry", d, minimum=-1)
    check(tuple(x.shape[:lead]) == shape[:lead],
          f"target {format_shape(shape)} must start with x's leading dims {format_shape(x.shape[:lead])}")
    source_tail = x.shape[lead:]
    check(all(isinstance(d, int) for d in source_tail),
          f"symbols of {x} beyond the target's leading {format_shape(shape[:lead])} are not carried through")
    check(tail.count(-1) <= 1, f"at most one -1 in {format_shape(shape)}")
    elements = math.prod(source_tail)
    known = math.prod(d for d in tail if d != -1)
    if -1 in tail:
        check(known > 0 and elements % known == 0, f"cannot reshape {x} to {format_shape(shape)}")
        tail = tuple(elements // known if d == -1 else d for d in tail)
    check(math.prod(tail) == elements, f"cannot reshape {x} to {format_shape(shape)}: element counts differ")
    return TensorType(x.dtype, shape[:lead] + tail)


@defop("reshape", _reshape_rule)
def reshape(x, *, shape):
    """x with a new shape; leading symbols in `shape` keep x's leading sizes."""
    lead = next((i for i, d in enumerate(shape) if not isinstance(d, str)), len(shape))
    return x.reshape(x.shape[:lead] + tuple(shape[lead:]))


def _transpose_rule(x: TensorType, *, perm) -> TensorType:
    expect_dtype("x", x, *_DATA_DTYPES)
    check(isinstance(perm, (tuple, list)) and sorted(perm) == list(range(x.rank)),
          f"perm {perm!r} is not a permutation of the {x.rank} axes of {x}")
    return TensorType(x.dtype, tuple(x.shape[p] for p in perm))


@defop("transpose", _transpose_rule)
def transpose(x, *, perm):
    """Axes reordered: result axis i is x's axis perm[i]."""
    return np.transpose(x, perm)


def _gather_rule(x: TensorType, idx: TensorType, *, axis) -> TensorType:
    expect_dtype("x", x, *_DATA_DTYPES)
    expect_dtype("idx", idx, DType.I32)
    a = normalize_axis(axis, x.rank)
    return TensorType(x.dtype, x.shape[:a] + idx.shape + x.shape[a + 1:])


@defop("gather", _gather_rule)
def gather(x, idx, *, axis):
    """np.take(x, idx, axis): idx's shape replaces `axis`. Indices are bounds-checked."""
    check_indices("gather", "index", idx, x.shape[axis])
    return np.take(x, idx, axis=axis)


REPEAT_MODES = ("tile", "interleave")


def _repeat_rule(x: TensorType, *, axis, repeats, mode) -> TensorType:
    expect_dtype("x", x, *_DATA_DTYPES)
    a = normalize_axis(axis, x.rank)
    int_attr("repeats", repeats, minimum=1)
    choice_attr("mode", mode, REPEAT_MODES)
    dim = x.shape[a]
    check(isinstance(dim, int) or repeats == 1, f"repeating symbolic axis {a} of {x} has no nameable size")
    return TensorType(x.dtype, x.shape[:a] + ((dim * repeats) if isinstance(dim, int) else dim,) + x.shape[a + 1:])


@defop("repeat", _repeat_rule)
def repeat(x, *, axis, repeats, mode="tile"):
    """`repeats` copies along `axis`: tile [a, b, a, b] or interleave [a, a, b, b]."""
    if mode == "interleave":
        return np.repeat(x, repeats, axis=axis)
    return np.concatenate([x] * repeats, axis=axis)

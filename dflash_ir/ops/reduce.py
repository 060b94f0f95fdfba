"""Reductions over a tensor's last dim (norms, softmax, top-k, argmax) and `sum`."""
from __future__ import annotations

import numpy as np

from .. import activations
from ..activations import NUMPY
from ..dtypes import DType
from ..types import TensorType
from .linalg import as_f32
from .rules import (
    WEIGHT_DTYPES,
    bool_attr,
    check,
    defop,
    expect_dtype,
    expect_min_rank,
    expect_rank,
    expect_same,
    f32,
    i32,
    int_attr,
    normalize_axis,
    number_attr,
)

F32 = np.float32


def _rmsnorm_rule(x: TensorType, w: TensorType | None = None, *, eps) -> TensorType:
    expect_dtype("x", x, DType.F32)
    expect_min_rank("x", x, 1)
    number_attr("eps", eps)
    if w is not None:
        expect_dtype("w", w, *WEIGHT_DTYPES)
        expect_rank("w", w, 1)
        expect_same("w size", w.shape[0], "x last dim", x.shape[-1], (x, w))
    return x


@defop("rmsnorm", _rmsnorm_rule)
def rmsnorm(x, w=None, *, eps):
    """x * rsqrt(mean(x²) + eps) [* w] over the last dim (GGUF norm weights carry the +1)."""
    y = x * activations.inverse_rms(NUMPY, np.sum(x * x, axis=-1, keepdims=True), x.shape[-1], F32(eps))
    return y if w is None else y * as_f32(w)


def _l2norm_rule(x: TensorType, *, eps) -> TensorType:
    expect_dtype("x", x, DType.F32)
    expect_min_rank("x", x, 1)
    number_attr("eps", eps)
    return x


@defop("l2norm", _l2norm_rule)
def l2norm(x, *, eps=1e-6):
    """x * rsqrt(sum(x²) + eps) over the last dim (HF/FLA convention used for GDN q and k)."""
    return x * activations.inverse_rms(NUMPY, np.sum(x * x, axis=-1, keepdims=True), None, F32(eps))


def _softmax_rule(x: TensorType, *, axis) -> TensorType:
    expect_dtype("x", x, DType.F32)
    normalize_axis(axis, x.rank)
    return x


@defop("softmax", _softmax_rule)
def softmax(x, *, axis=-1):
    """exp(x - max) / sum along `axis`."""
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _topk_rule(x: TensorType, *, k) -> tuple[TensorType, TensorType]:
    expect_dtype("x", x, DType.F32)
    expect_min_rank("x", x, 1)
    int_attr("k", k, minimum=1)
    if isinstance(x.shape[-1], int):
        check(k <= x.shape[-1], f"k={k} exceeds the last dim of {x}")
    shape = x.shape[:-1] + (k,)
    return f32(shape), i32(shape)


@defop("topk", _topk_rule)
def topk(x, *, k):
    """The k largest values along the last dim, descending; ties go to the lower index."""
    order = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(x, order, axis=-1), order.astype(np.int32)


def precedes(m, v, i, w, j):
    """Whether (value v, index i) comes before (w, j) in the order topk and argmax pick in:
    the larger value first, the lower index on ties (numpy's stable descending sort, its
    argmax's first maximum). Every selection kernel compares by this (argmax's trees and
    lanes, topk's passes, the MoE routing's), with its math `m` (dflash_ir/activations.py)."""
    return m.either(v > w, m.both(m.equal(v, w), i < j))


def _argmax_rule(x: TensorType) -> TensorType:
    expect_dtype("x", x, DType.F32)
    expect_min_rank("x", x, 1)
    return i32(x.shape[:-1])


@defop("argmax", _argmax_rule)
def argmax(x):
    """Index of the first maximum along the last dim."""
    return np.asarray(np.argmax(x, axis=-1), dtype=np.int32)


def _sum_rule(x: TensorType, *, axis, keepdims) -> TensorType:
    expect_dtype("x", x, DType.F32, DType.I32)
    a = normalize_axis(axis, x.rank)
    bool_attr("keepdims", keepdims)
    return TensorType(x.dtype, x.shape[:a] + ((1,) if keepdims else ()) + x.shape[a + 1:])


@defop("sum", _sum_rule)
def sum_(x, *, axis, keepdims=False):
    """Sum along `axis`, in the input dtype."""
    return np.asarray(np.sum(x, axis=axis, keepdims=keepdims, dtype=x.dtype))

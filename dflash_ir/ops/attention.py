"""Softmax attention over a fixed-capacity KV cache, and the cache write.

Caches have a static capacity C; `kv_len` says how many leading rows are valid, so the
same graph serves every call. The T queries are the last T of the kv_len positions
(query t sits at absolute position kv_len - T + t), which is what causal and window
masks are relative to.
"""
from __future__ import annotations

import numpy as np

from ..activations import NUMPY
from ..dtypes import DType
from ..errors import ContextOverflowError
from ..types import TensorType
from .rules import (
    bool_attr,
    check,
    defop,
    expect_dtype,
    expect_min_rank,
    expect_rank,
    expect_same,
    int_attr,
    number_attr,
)

F32 = np.float32


def _attention_rule(q: TensorType, k: TensorType, v: TensorType, kv_len: TensorType, *,
                    scale, causal, window) -> TensorType:
    for name, t in (("q", q), ("k", k), ("v", v)):
        expect_dtype(name, t, DType.F32)
        expect_rank(name, t, 3)
    expect_dtype("kv_len", kv_len, DType.I32)
    expect_rank("kv_len", kv_len, 0)
    shapes = (q, k, v)
    expect_same("q head dim", q.shape[2], "k head dim", k.shape[2], shapes)
    expect_same("k rows", k.shape[0], "v rows", v.shape[0], shapes)
    expect_same("k heads", k.shape[1], "v heads", v.shape[1], shapes)
    hq, hkv = q.shape[1], k.shape[1]
    if isinstance(hq, int) and isinstance(hkv, int):
        check(hkv > 0 and hq % hkv == 0, f"q heads ({hq}) must be a multiple of kv heads ({hkv}) in {q}, {k}")
    number_attr("scale", scale)
    bool_attr("causal", causal)
    int_attr("window", window, minimum=0)
    return TensorType(DType.F32, (q.shape[0], q.shape[1], v.shape[2]))


def visible_range(m, n, query_pos, causal: bool, window: int):
    """Keys [lo, hi) a query at `query_pos` sees among the first n cache rows: up to its own
    position when causal, at most `window` back (window 0: no limit). Every attention
    schedule (the reference's, the kernel layer's, TVM's) masks by this, with its math `m`
    (dflash_ir/activations.py) and operands."""
    hi = m.minimum(n, query_pos + 1) if causal else n
    lo = m.maximum(0, query_pos - (window - 1)) if window else 0
    return lo, hi


@defop("attention", _attention_rule)
def attention(q, k, v, kv_len, *, scale, causal=True, window=0):
    """softmax(q kᵀ · scale + mask) v over the first kv_len cache rows, f32 with max
    subtraction. GQA: q head h reads kv head h // (Hq/Hkv). Each query row is computed over
    its visible keys only (one contiguous run), so its result depends neither on the rows
    beside it nor on masked keys past it (numpy's sums group their terms by length): a
    verify block alone and the same block padded in a batched verify agree bit for bit."""
    n_queries, n_heads, _ = q.shape
    n = int(kv_len)
    if not 0 < n <= k.shape[0]:
        raise ValueError(f"attention: kv_len {n} is outside (0, {k.shape[0]}] (the cache capacity)")
    if (causal or window) and n < n_queries:
        raise ValueError(f"attention: {n_queries} queries cannot be the last rows of kv_len {n}")
    kv_head = np.arange(n_heads) // (n_heads // k.shape[1])
    keys = k[:n, kv_head].transpose(1, 2, 0)          # [Hq, D, n]
    values = v[:n, kv_head].transpose(1, 0, 2)        # [Hq, n, Dv]
    out = np.empty((n_queries, n_heads, values.shape[2]), F32)
    for t in range(n_queries):
        lo, hi = visible_range(NUMPY, n, n - n_queries + t, causal, window)
        scores = (q[t][:, None, :] @ keys[:, :, lo:hi]) * F32(scale)  # [Hq, 1, visible]
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out[t] = (weights @ values[:, lo:hi])[:, 0]
    return out


def _kv_write_rule(cache: TensorType, new: TensorType, pos: TensorType) -> TensorType:
    expect_min_rank("cache", cache, 1)
    check(new.dtype == cache.dtype and new.rank == cache.rank, f"new rows {new} do not match the cache {cache}")
    for axis in range(1, cache.rank):
        expect_same(f"new dim {axis}", new.shape[axis], f"cache dim {axis}", cache.shape[axis], (cache, new))
    expect_dtype("pos", pos, DType.I32)
    expect_rank("pos", pos, 0)
    return cache


@defop("kv_write", _kv_write_rule)
def kv_write(cache, new, pos):
    """A copy of `cache` with rows [pos, pos + T) replaced by `new`."""
    start = int(pos)
    end = start + new.shape[0]
    if start < 0:
        raise ValueError(f"kv_write: negative position {start}")
    if end > cache.shape[0]:
        raise ContextOverflowError(
            f"context overflow: writing {new.shape[0]} rows at position {start} needs rows up to {end} "
            f"but the cache holds {cache.shape[0]}")
    out = cache.copy()
    out[start:end] = new
    return out

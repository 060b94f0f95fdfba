"""Weight-consuming ops: dequantize, embedding lookup, Linear-style matmul, per-expert matmul.

Weights arrive as their storage arrays (see `dflash_ir.quant`); each op dequantises only
what it reads, so a reference run never materialises a whole vocab or expert bank in f32.
"""
from __future__ import annotations

import numpy as np

from ..blocks import DECODERS
from ..dtypes import DType
from ..quant import Q8_X_TYPES, block_parts
from ..quant import dequantize as _dequantize_storage
from ..types import TensorType
from .rules import (
    WEIGHT_DTYPES,
    defop,
    expect_block_aligned,
    expect_dtype,
    expect_min_rank,
    expect_rank,
    expect_same,
    f32,
)

F32 = np.float32
_STORAGE_DTYPES = {d.numpy(): d for d in WEIGHT_DTYPES}

# rows of a weight dequantised at a time by `matmul`: bounds the f32 copy to ~64 MiB
_CHUNK_ELEMENTS = 1 << 24
# weight rows handled at once by the product with Q8_0 x (bounds its [blocks, T, rows] temporaries)
_Q8_X_ROWS = 256


def storage_dtype(storage: np.ndarray) -> DType:
    """The weight dtype a storage array holds (the numpy storage dtypes are distinct)."""
    try:
        return _STORAGE_DTYPES[storage.dtype]
    except KeyError:
        raise ValueError(f"{storage.dtype} arrays are not weight storage "
                         f"({', '.join(str(d) for d in WEIGHT_DTYPES)})") from None


def as_f32(storage: np.ndarray) -> np.ndarray:
    """Float32 values of a weight storage array; f32 storage is returned as is (read-only use)."""
    storage = np.asarray(storage)
    if storage.dtype == F32:
        return storage
    return _dequantize_storage(storage, storage_dtype(storage))


def _dequantize_rule(w: TensorType) -> TensorType:
    expect_dtype("w", w, *WEIGHT_DTYPES)
    expect_block_aligned("w", w)
    return f32(w.shape)


@defop("dequantize", _dequantize_rule)
def dequantize(w):
    """Float32 values of a weight, same logical shape."""
    return as_f32(w)


def _embedding_rule(table: TensorType, ids: TensorType) -> TensorType:
    expect_dtype("table", table, *WEIGHT_DTYPES)
    expect_rank("table", table, 2)
    expect_block_aligned("table", table)
    expect_dtype("ids", ids, DType.I32)
    expect_rank("ids", ids, 1)
    return f32((ids.shape[0], table.shape[1]))


@defop("embedding", _embedding_rule)
def embedding(table, ids):
    """Rows `ids` of `table` as f32; only the gathered rows are dequantised."""
    check_indices("embedding", "token id", ids, table.shape[0])
    return as_f32(table[ids])


def check_indices(op: str, what: str, ids: np.ndarray, size: int) -> None:
    """Runtime bounds check naming the first offending index (numpy would wrap negatives)."""
    bad = np.flatnonzero((ids < 0) | (ids >= size))
    if bad.size:
        raise ValueError(f"{op}: {what} {int(ids.flat[bad[0]])} is out of range [0, {size})")


def expect_activations(x: TensorType, w: TensorType) -> None:
    """x is f32, or Q8_0 where w's type has products with Q8_0 x (quant.Q8_X_TYPES)."""
    if x.dtype is DType.Q8_0 and w.dtype in Q8_X_TYPES:
        return
    expect_dtype("x", x, DType.F32)


def _matmul_rule(x: TensorType, w: TensorType) -> TensorType:
    expect_min_rank("x", x, 1)
    expect_dtype("w", w, *WEIGHT_DTYPES)
    expect_activations(x, w)
    expect_rank("w", w, 2)
    expect_block_aligned("w", w)
    expect_same("x inner dim", x.shape[-1], "w inner dim", w.shape[1], (x, w))
    return f32(x.shape[:-1] + (w.shape[0],))


@defop("matmul", _matmul_rule)
def matmul(x, w):
    """x @ wᵀ (PyTorch Linear layout w[N, K]); w is dequantised in row chunks. Each row of x
    is its own matrix-vector product: a BLAS matrix-matrix kernel orders a row's sums by the
    row's place in its register tile (OpenBLAS 0.3.31 on AVX-512 does), so a row's result
    would depend on the rows beside it (a verify block against a decode step). A Q8_0 x
    (storage bytes) takes q8_x_product."""
    if x.dtype == np.uint8:
        return q8_x_product(x, w)
    n, k = w.shape[0], x.shape[-1]
    rows = max(1, _CHUNK_ELEMENTS // max(k, 1))
    flat = x.reshape(-1, k)
    out = np.empty((len(flat), n), dtype=F32)
    for start in range(0, n, rows):
        out[:, start:start + rows] = _rowwise_product(flat, as_f32(w[start:start + rows]))
    return out.reshape(x.shape[:-1] + (n,))


def q8_x_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Q8_0 x times a weight of quant.Q8_X_TYPES, as llama.cpp's products with quantised
    activations: per sub-block of w (32 elements, or 16) the integer dot of x's quants and w's
    codes (exact in f32: |sum| <= 32·127² < 2^24) times d_x·scale, plus offset·(d_x·Σ q_x)
    where w's type has one. The integers do not depend on how a kernel orders them."""
    dtype = storage_dtype(w)
    lead = x.shape[:-1]
    dx, qx, _ = block_parts(x.reshape(-1, x.shape[-1]), DType.Q8_0)  # [T, K/32], [T, K/32, 32]
    sub = 32 if dtype is DType.Q8_0 else DECODERS[dtype].sub  # w's sub-blocks: 32 or 16 elements
    dx, qx = np.repeat(dx, 32 // sub, axis=1), qx.reshape(qx.shape[0], -1, sub)  # per sub-block
    out = np.empty((qx.shape[0], w.shape[0]), dtype=F32)
    qx_b = qx.transpose(1, 0, 2)  # [nb, T, sub]
    x_sums = dx * qx.sum(axis=-1)  # [T, nb], exact integer sums times d_x
    for start in range(0, w.shape[0], _Q8_X_ROWS):
        dw, qw, mw = block_parts(w[start:start + _Q8_X_ROWS], dtype)  # [n, nb], [n, nb, sub], [n, nb]
        sums = qx_b @ qw.transpose(1, 2, 0)  # [nb, T, n]
        part = np.einsum("btn,tb,nb->tn", sums, dx, dw, dtype=F32)
        out[:, start:start + _Q8_X_ROWS] = part if mw is None else part + np.einsum("tb,nb->tn", x_sums, mw,
                                                                                     dtype=F32)
    return out.reshape(*lead, w.shape[0])


def _rowwise_product(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x[M, K] @ w[N, K]ᵀ as M matrix-vector products (numpy runs a stacked product with a
    one-row matrix as one GEMV per stack item, inside one call)."""
    return (x[:, None, :] @ w.T)[:, 0]


def _expert_matmul_rule(x: TensorType, w: TensorType, ids: TensorType) -> TensorType:
    expect_rank("x", x, 2, 3)
    expect_dtype("w", w, *WEIGHT_DTYPES)
    expect_activations(x, w)
    expect_rank("w", w, 3)
    expect_block_aligned("w", w)
    expect_dtype("ids", ids, DType.I32)
    expect_rank("ids", ids, 2)
    shapes = (x, w, ids)
    expect_same("x rows", x.shape[0], "ids rows", ids.shape[0], shapes)
    if x.rank == 3:
        expect_same("x slots", x.shape[1], "ids slots", ids.shape[1], shapes)
    expect_same("x inner dim", x.shape[-1], "w inner dim", w.shape[2], shapes)
    return f32((ids.shape[0], ids.shape[1], w.shape[1]))


@defop("expert_matmul", _expert_matmul_rule)
def expert_matmul(x, w, ids):
    """out[t, s] = x[t] (or x[t, s]) @ w[ids[t, s]]ᵀ. Rows are grouped by expert, and only
    the selected experts' slices of w are read and dequantised; products as `matmul`'s, so a
    row's result does not depend on how many rows chose the same expert (x in Q8_0: as
    q8_x_product)."""
    check_indices("expert_matmul", "expert id", ids, w.shape[0])
    slots = ids.shape[1]
    rows = x if x.ndim == 3 else np.broadcast_to(x[:, None, :], (x.shape[0], slots, x.shape[1]))
    out = np.empty(ids.shape + (w.shape[1],), dtype=F32)
    for expert in np.unique(ids):
        t, s = np.nonzero(ids == expert)
        out[t, s] = q8_x_product(rows[t, s], w[expert]) if x.dtype == np.uint8 else \
            _rowwise_product(rows[t, s], as_f32(w[expert]))
    return out

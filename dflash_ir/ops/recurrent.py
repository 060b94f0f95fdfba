"""Ops with carried state (Gated DeltaNet): depthwise causal conv1d and the gated delta rule.

Both take the incoming state and return the new one (a speculative verify's rollback runs
them again over the accepted rows: runtime/target_runner.py). All state math is float32, as
in HF and llama.cpp.
"""
from __future__ import annotations

import numpy as np

from .. import activations
from ..activations import NUMPY
from ..dtypes import DType
from ..types import TensorType
from .linalg import as_f32
from .rules import (
    WEIGHT_DTYPES,
    check,
    choice_attr,
    defop,
    expect_block_aligned,
    expect_dtype,
    expect_rank,
    expect_same,
    int_attr,
    number_attr,
)

F32 = np.float32


ACTIVATIONS = ("none", "silu")


def _conv_rule(x: TensorType, w: TensorType, state: TensorType, *, activation):
    expect_dtype("x", x, DType.F32)
    expect_rank("x", x, 2)
    expect_dtype("w", w, *WEIGHT_DTYPES)
    expect_rank("w", w, 2)
    expect_block_aligned("w", w)
    expect_dtype("state", state, DType.F32)
    expect_rank("state", state, 2)
    shapes = (x, w, state)
    expect_same("x channels", x.shape[1], "w channels", w.shape[0], shapes)
    expect_same("state channels", state.shape[1], "x channels", x.shape[1], shapes)
    width = w.shape[1]
    if isinstance(width, int):
        check(width >= 1, f"kernel width must be >= 1 in {w}")
        expect_same("state rows", state.shape[0], "kernel width - 1", width - 1, shapes)
    choice_attr("activation", activation, ACTIVATIONS)
    return x, state


@defop("causal_conv1d", _conv_rule)
def causal_conv1d(x, w, state, *, activation="none"):
    """Depthwise causal conv over xx = concat(state, x): y[t, c] = Σ_j w[c, j]·xx[t+j, c],
    then silu(y) with activation="silu" (Gated DeltaNet's conv; the states hold xx rows,
    never y). Returns (y, last K-1 rows of xx)."""
    width = w.shape[1]
    rows = np.concatenate([state, x]).astype(F32)
    windows = np.lib.stride_tricks.sliding_window_view(rows, width, axis=0)  # [T, C, K]
    y = np.sum(windows * as_f32(w), axis=-1, dtype=F32)
    if activation == "silu":
        y = np.asarray(activations.silu(NUMPY, y), dtype=F32)
    return y, rows[len(x):].copy()


HEAD_MAPS = ("tiled", "grouped")


def _gdn_rule(q: TensorType, k: TensorType, v: TensorType, g: TensorType, beta: TensorType, state: TensorType, *,
              scale, head_map, chunk_size):
    for name, t, rank in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2), ("state", state, 3)):
        expect_dtype(name, t, DType.F32)
        expect_rank(name, t, rank)
    shapes = (q, k, v, g, beta, state)
    for axis, what in enumerate(("rows", "heads", "dim")):
        expect_same(f"k {what}", k.shape[axis], f"q {what}", q.shape[axis], shapes)
    for name, t in (("v", v), ("g", g), ("beta", beta)):
        expect_same(f"{name} rows", t.shape[0], "q rows", q.shape[0], shapes)
        expect_same(f"{name} heads", t.shape[1], "state heads", state.shape[0], shapes)
    expect_same("state key dim", state.shape[1], "k dim", k.shape[2], shapes)
    expect_same("state value dim", state.shape[2], "v dim", v.shape[2], shapes)
    hk, hv = k.shape[1], v.shape[1]
    if isinstance(hk, int) and isinstance(hv, int):
        check(hk > 0 and hv % hk == 0, f"v heads ({hv}) must be a multiple of k heads ({hk})")
    number_attr("scale", scale)
    choice_attr("head_map", head_map, HEAD_MAPS)
    int_attr("chunk_size", chunk_size, minimum=0)
    return v, state


def key_heads(n_value_heads: int, n_key_heads: int, head_map: str) -> np.ndarray:
    """The k head each v head reads: h % Hk (GGUF qwen35 "tiled") or h // (Hv/Hk) (HF "grouped")."""
    h = np.arange(n_value_heads)
    return h % n_key_heads if head_map == "tiled" else h // (n_value_heads // n_key_heads)


@defop("gated_delta_rule", _gdn_rule)
def gated_delta_rule(q, k, v, g, beta, state, *, scale, head_map="tiled", chunk_size=0):
    """Gated delta rule per v head: S <- e^g S + k (β(v - e^g Sᵀk))ᵀ; o = Sᵀ(q·scale).
    q, k arrive L2-normalised. chunk_size > 0 evaluates the same thing in chunked (WY) form.
    Returns (o, new_state)."""
    heads = key_heads(v.shape[1], k.shape[1], head_map)
    q = q[:, heads] * F32(scale)
    k = k[:, heads]
    if chunk_size:
        return _chunked(q, k, v, g, beta, state.astype(F32), chunk_size)
    return _recurrent(q, k, v, g, beta, state.astype(F32))


def delta_error(v, ks, decay, beta):
    """A state column's correction for a token, β(v − e^g·kᵀS), where kᵀS is summed over the
    state before its decay: HF decays S first and sums over the decayed S, the same maths
    with the decay applied once per column rather than once per cell, and a pass over the
    state fewer on a CPU that streams it (one pass sums kᵀS, the next updates the cells).
    Every schedule of the rule (the reference, the kernel layer's, TVM's) calls this and
    delta_update, so all compute one order; how kᵀS and the output's Sᵀq are summed is each
    schedule's."""
    return beta * (v - decay * ks)


def delta_update(s, k, delta, decay):
    """A state cell after the token: e^g·s + k·δ (δ from delta_error)."""
    return decay * s + k * delta


def _recurrent(q, k, v, g, beta, s):
    """Token by token, all heads at once; q is already scaled and everything is per v head."""
    out = np.empty(v.shape, dtype=F32)
    decay = np.exp(g)
    for t in range(len(q)):
        delta = delta_error(v[t], np.einsum("hkv,hk->hv", s, k[t]), decay[t][:, None], beta[t][:, None])
        s = delta_update(s, k[t][:, :, None], delta[:, None, :], decay[t][:, None, None])
        out[t] = np.einsum("hkv,hk->hv", s, q[t])
    return out, s


def _chunked(q, k, v, g, beta, s, size):
    """QWEN35.md §5.4: per chunk of `size` rows (zero-padded tail: g = β = 0 rows change
    nothing), a unit-lower-triangular solve gives U and W, then the state is carried across
    chunks. Exponents are always differences γ_i - γ_j with i >= j, so none overflows."""
    n = len(q)
    pad = -n % size

    def chunks(a):  # [T, H, ...] -> [chunks, H, size, ...]
        a = np.concatenate([a, np.zeros((pad,) + a.shape[1:], dtype=F32)])
        return np.moveaxis(a.reshape((-1, size) + a.shape[1:]), 1, 2)

    out = []
    lower = np.tril(np.ones((size, size), dtype=bool))
    for qc, kc, vc, gc, bc in zip(*map(chunks, (q, k, v, g, beta))):
        gamma = np.cumsum(gc, axis=-1)                                       # [H, size]
        diff = gamma[:, :, None] - gamma[:, None, :]
        decay = np.exp(np.where(lower, diff, -np.inf)).astype(F32)           # D_ij, zero above the diagonal
        a = np.tril((bc[:, :, None] * kc) @ kc.transpose(0, 2, 1) * decay, k=-1)
        rhs = np.concatenate([bc[:, :, None] * vc, (bc * np.exp(gamma))[:, :, None] * kc], axis=-1)
        solved = _unit_lower_solve(a, rhs)
        u, w = solved[..., :vc.shape[-1]], solved[..., vc.shape[-1]:]
        v_new = u - w @ s
        out.append((qc * np.exp(gamma)[:, :, None]) @ s + (qc @ kc.transpose(0, 2, 1) * decay) @ v_new)
        last = gamma[:, -1:]
        s = np.exp(last)[:, :, None] * s + (kc * np.exp(last - gamma)[:, :, None]).transpose(0, 2, 1) @ v_new
    o = np.concatenate([np.moveaxis(c, 1, 0) for c in out])[:n]
    return o.astype(F32), s.astype(F32)


def _unit_lower_solve(a: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """x with (I + a) x = rhs for strictly-lower a[..., n, n], by forward substitution."""
    x = rhs.copy()
    for i in range(1, a.shape[-1]):
        x[..., i, :] -= np.einsum("...j,...jd->...d", a[..., i, :i], x[..., :i, :])
    return x

"""Fused ops made by the optimisation passes: one node per kernel a backend launches.

Each op's rule and reference are compositions of the unfused ops' rules and references, so
a fused graph computes bit-for-bit what the unfused graph computed; a backend kernel for
a fused op is tested against this reference like any other.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .. import activations
from ..activations import NUMPY
from ..dtypes import DType
from ..quant import quantize_q8_0
from ..types import TensorType
from .attention import attention, kv_write
from .linalg import as_f32, expert_matmul, matmul
from .position import rope
from .recurrent import causal_conv1d, gated_delta_rule
from .reduce import l2norm, rmsnorm, softmax, sum_, topk
from .registry import get_op
from .rules import (
    WEIGHT_DTYPES,
    bool_attr,
    check,
    choice_attr,
    defop,
    expect_dtype,
    expect_rank,
    expect_same,
    f32,
    int_attr,
)

F32 = np.float32
Q8_VALUES = DType.Q8_0.block_size
VARIANTS = ("decode", "block", "prefill")


def _infer(op: str, *inputs: TensorType, **attrs) -> tuple[TensorType, ...]:
    return get_op(op).output_types(inputs, attrs)


ATTENTION_INPUTS = ("q", "k", "v", "q_norm", "k_norm", "positions", "pos", "kv_len", "k_cache", "v_cache")


def _q8_rows(y: TensorType, q8_out, head_dim) -> TensorType:
    """Output y as it leaves the kernel: f32, or with `q8_out` (the q8 numerics, whose next
    product takes Q8_0 x) its rows flattened and quantised to Q8_0 by the kernel itself, a
    head's row at a time, so a block must not straddle two heads."""
    if not bool_attr("q8_out", q8_out):
        return y
    check(isinstance(head_dim, int) and head_dim % Q8_VALUES == 0,
          f"q8_out quantises each head's row in blocks of {Q8_VALUES}: the head dim {head_dim} must be a multiple")
    return _infer("quantize_q8_0", f32((y.shape[0], math.prod(y.shape[1:]))))[0]


def _q8_reference(y: np.ndarray, q8_out: bool) -> np.ndarray:
    return quantize_q8_0(y.reshape(len(y), -1)) if q8_out else y


def attention_input_names(normed: bool) -> tuple[str, ...]:
    """fused_attention's inputs: q_norm and k_norm are there only when q and k are normalised
    (`eps` not None; llama's layers have no q/k norm)."""
    return ATTENTION_INPUTS if normed else tuple(n for n in ATTENTION_INPUTS if n not in ("q_norm", "k_norm"))


def attention_inputs(inputs: Sequence, eps) -> dict:
    """fused_attention's inputs by name (attention_input_names)."""
    names = attention_input_names(eps is not None)
    check(len(inputs) == len(names), f"takes {len(names)} inputs ({', '.join(names)}) with eps={eps}, "
                                     f"got {len(inputs)}")
    return dict(zip(names, inputs))


def _fused_attention_rule(*inputs, eps, n_rot, theta, sections, interleaved, pairs, freq_factors, scale, causal,
                          window, gated, persist, variant, q8_out=False):
    x = attention_inputs(inputs, eps)
    q, k, v, positions = x["q"], x["k"], x["v"], x["positions"]
    expect_rank("q", q, 3)
    expect_rank("k", k, 3)
    expect_rank("v", v, 3)
    if bool_attr("gated", gated):
        widths = (q.shape[2], k.shape[2], v.shape[2])
        check(all(isinstance(w, int) for w in widths) and widths[0] == widths[1] + widths[2],
              f"gated q {q} must hold [q_h | gate_h] per head: k head dim + v head dim wide ({k}, {v})")
    bool_attr("persist", persist)
    choice_attr("variant", variant, VARIANTS)
    q_part = TensorType(q.dtype, q.shape[:2] + (k.shape[2],))
    rope_attrs = dict(n_rot=n_rot, theta=theta, sections=sections, interleaved=interleaved, pairs=pairs,
                      freq_factors=freq_factors)

    def normed(t: TensorType, norm: str) -> TensorType:
        return t if eps is None else _infer("rmsnorm", t, x[norm], eps=eps)[0]

    (q_rot,) = _infer("rope", normed(q_part, "q_norm"), positions, **rope_attrs)
    (k_rot,) = _infer("rope", normed(k, "k_norm"), positions, **rope_attrs)
    (k_all,) = _infer("kv_write", x["k_cache"], k_rot, x["pos"])
    (v_all,) = _infer("kv_write", x["v_cache"], v, x["pos"])
    (o,) = _infer("attention", q_rot, k_all, v_all, x["kv_len"], scale=scale, causal=causal, window=window)
    check(isinstance(o.shape[1], int) and isinstance(o.shape[2], int), f"heads and head dim of {o} must be ints")
    out = _q8_rows(f32((o.shape[0], o.shape[1] * o.shape[2])), q8_out, o.shape[2])
    return (out, k_all, v_all) if persist else out


@defop("fused_attention", _fused_attention_rule)
def fused_attention(*inputs, eps, n_rot, theta, sections=(), interleaved=False, pairs="halves", freq_factors=(), scale,
                    causal=True, window=0, gated=False, persist=True, variant="prefill", q8_out=False):
    """One attention layer on ATTENTION_INPUTS: rmsnorm (with eps; none with eps None and
    no q_norm, k_norm inputs) + RoPE of q and k, k and v written into the caches at
    `pos`, softmax attention over the first kv_len rows, heads flattened to [T, H*Dv], and
    with `gated` o * sigmoid(gate) where q is [T, H, D + Dv] holding [q_h | gate_h] per head.
    Returns (o, k_cache', v_cache') with `persist`, else o alone (the draft block: its K/V
    live past the cache length for this call only). `variant` (decode: T=1, block: a
    verify or draft block of a few rows, prefill: long) picks a kernel, not the math.
    `q8_out`: o leaves as its Q8_0 blocks (_q8_rows)."""
    x = attention_inputs(inputs, eps)
    q, k, v, positions, pos = x["q"], x["k"], x["v"], x["positions"], x["pos"]
    d = k.shape[2]
    q_part = q[..., :d] if gated else q
    rope_attrs = dict(n_rot=n_rot, theta=theta, sections=sections, interleaved=interleaved, pairs=pairs,
                      freq_factors=freq_factors)

    def normed(a: np.ndarray, norm: str) -> np.ndarray:
        return a if eps is None else rmsnorm(a, x[norm], eps=eps)

    q_rot = rope(normed(q_part, "q_norm"), positions, **rope_attrs)
    k_all = kv_write(x["k_cache"], rope(normed(k, "k_norm"), positions, **rope_attrs), pos)
    v_all = kv_write(x["v_cache"], v, pos)
    o = attention(q_rot, k_all, v_all, x["kv_len"], scale=scale, causal=causal, window=window)
    o = o.reshape(o.shape[0], -1)
    if gated:
        o = np.asarray(activations.sigmoid_gate(NUMPY, o, q[..., d:].reshape(o.shape)))
    o = _q8_reference(o, q8_out)
    return (o, k_all, v_all) if persist else o


def _fused_gdn_rule(mixed, a, b, dt_bias, ssm_a, state, *, key_heads, eps, scale, head_map, chunk_size):
    expect_rank("mixed", mixed, 2)
    expect_rank("state", state, 3)
    int_attr("key_heads", key_heads, minimum=1)
    hv, dk, dv = state.shape
    check(all(isinstance(d, int) for d in (hv, dk, dv, mixed.shape[1])),
          f"state {state} and channels of {mixed} must be static")
    expect_same("mixed channels", mixed.shape[1], "2 * key_heads * key dim + value heads * value dim",
                2 * key_heads * dk + hv * dv, (mixed, state))
    for name, t in (("dt_bias", dt_bias), ("ssm_a", ssm_a)):
        expect_dtype(name, t, DType.F32)
        expect_rank(name, t, 1)
        expect_same(f"{name} length", t.shape[0], "value heads", hv, (t, state))
    rows = mixed.shape[0]
    (qk,) = _infer("l2norm", f32((rows, key_heads, dk)), eps=eps)
    (g,) = _infer("mul", *_infer("softplus", *_infer("add", a, dt_bias)), ssm_a)
    (beta,) = _infer("sigmoid", b)
    return _infer("gated_delta_rule", qk, qk, f32((rows, hv, dv)), g, beta, state, scale=scale, head_map=head_map,
                  chunk_size=chunk_size)


@defop("fused_gated_delta_rule", _fused_gdn_rule)
def fused_gated_delta_rule(mixed, a, b, dt_bias, ssm_a, state, *, key_heads, eps, scale, head_map="tiled",
                           chunk_size=0):
    """A Gated DeltaNet layer's recurrence from its conv output: q and k are L2-normalised
    head slices of `mixed` (= [q | k | v] channels), the decay is softplus(a + dt_bias) ·
    ssm_a and β = sigmoid(b), then the gated delta rule. One kernel instead of the slices,
    norms and gate arithmetic around it."""
    rows, (hv, dk, dv) = len(mixed), state.shape
    kd = key_heads * dk
    q = l2norm(mixed[:, :kd].reshape(rows, key_heads, dk), eps=eps)
    k = l2norm(mixed[:, kd:2 * kd].reshape(rows, key_heads, dk), eps=eps)
    v = mixed[:, 2 * kd:].reshape(rows, hv, dv)
    g = _reference("mul", _reference("softplus", _reference("add", a, dt_bias)), ssm_a)
    return gated_delta_rule(q, k, v, g, _reference("sigmoid", b), state, scale=scale, head_map=head_map,
                            chunk_size=chunk_size)


def _fused_gdn_layer_rule(x, conv_w, conv_state, a, b, dt_bias, ssm_a, state, z, norm_w, *, key_heads, eps, norm_eps,
                          scale, head_map, chunk_size, q8_out=False):
    mixed, conv_new = _infer("causal_conv1d", x, conv_w, conv_state, activation="silu")
    o, new = _infer("fused_gated_delta_rule", mixed, a, b, dt_bias, ssm_a, state, key_heads=key_heads, eps=eps,
                    scale=scale, head_map=head_map, chunk_size=chunk_size)
    (normed,) = _infer("rmsnorm", o, norm_w, eps=norm_eps)
    expect_rank("z", z, 3)
    for axis, what in enumerate(("rows", "heads", "dim")):  # the gate multiplies elementwise: no broadcasting
        expect_same(f"z {what}", z.shape[axis], f"output {what}", o.shape[axis], (z, o))
    (y,) = _infer("mul", normed, *_infer("silu", z))
    return _q8_rows(y, q8_out, y.shape[2]), conv_new, new


@defop("fused_gated_deltanet", _fused_gdn_layer_rule)
def fused_gated_deltanet(x, conv_w, conv_state, a, b, dt_bias, ssm_a, state, z, norm_w, *, key_heads, eps, norm_eps,
                         scale, head_map="tiled", chunk_size=0, q8_out=False):
    """A Gated DeltaNet layer between its input projections and its out projection: the
    causal conv of x with SiLU (conv_w, conv_state), fused_gated_delta_rule on its output,
    then each v head's output row RMS-normalised with norm_w (norm_eps) times silu(z).
    Returns (y, conv_state', state'); with `q8_out` y leaves as its Q8_0 blocks (_q8_rows)."""
    mixed, conv_new = causal_conv1d(x, conv_w, conv_state, activation="silu")
    o, new = fused_gated_delta_rule(mixed, a, b, dt_bias, ssm_a, state, key_heads=key_heads, eps=eps,
                                    scale=scale, head_map=head_map, chunk_size=chunk_size)
    y = _reference("mul", rmsnorm(o, norm_w, eps=norm_eps), _reference("silu", z))
    return _q8_reference(y, q8_out), conv_new, new


def _reference(op: str, *arrays: np.ndarray) -> np.ndarray:
    """The unfused op's own reference, so the fused op computes exactly what it replaced."""
    return get_op(op).run(arrays, {})[0]


def _fused_moe_rule(x, router_w, gate_exps, up_exps, down_exps, shexp_gate_w, shexp_up_w, shexp_down_w,
                    shexp_gate_inp_w, xq=None, *, k):
    expect_rank("x", x, 2)
    int_attr("k", k, minimum=1)
    (probs,) = _infer("softmax", *_infer("matmul", x, router_w), axis=-1)
    _, ids = _infer("topk", probs, k=k)
    if xq is not None:
        check(xq == TensorType(DType.Q8_0, x.shape), f"xq {xq} must be x {x} in Q8_0")
        x = xq
    (gate,) = _infer("expert_matmul", x, gate_exps, ids)
    (up,) = _infer("expert_matmul", x, up_exps, ids)
    check(gate == up, f"expert gate {gate} and up {up} projections differ")
    (down,) = _infer("expert_matmul", _activations(gate, xq), down_exps, ids)
    (sh_gate,) = _infer("matmul", x, shexp_gate_w)
    (sh_up,) = _infer("matmul", x, shexp_up_w)
    check(sh_gate == sh_up, f"shared expert gate {sh_gate} and up {sh_up} projections differ")
    (shared,) = _infer("matmul", _activations(sh_gate, xq), shexp_down_w)
    out = f32((x.shape[0], down.shape[2]))
    expect_same("shared expert width", shared.shape[1], "routed width", out.shape[1], (shared, down))
    expect_dtype("shexp_gate_inp_w", shexp_gate_inp_w, *WEIGHT_DTYPES)
    expect_rank("shexp_gate_inp_w", shexp_gate_inp_w, 1, 2)
    check(shexp_gate_inp_w.rank == 1 or shexp_gate_inp_w.shape[0] == 1,
          f"shared expert gate weight {shexp_gate_inp_w} must be one row")
    expect_same("shared gate width", shexp_gate_inp_w.shape[-1], "x width", x.shape[1], (shexp_gate_inp_w, x))
    return out


def _activations(t: TensorType, xq: TensorType | None) -> TensorType:
    """The down projections' input: the SwiGLU in Q8_0 where the products take Q8_0 x."""
    return t if xq is None else _infer("quantize_q8_0", t)[0]


@defop("fused_moe", _fused_moe_rule)
def fused_moe(x, router_w, gate_exps, up_exps, down_exps, shexp_gate_w, shexp_up_w, shexp_down_w, shexp_gate_inp_w,
              xq=None, *, k):
    """A Qwen3.5 MoE block: softmax router over all experts, top-k renormalised, SwiGLU of
    the selected experts only (their weights are the only expert weights read), weighted
    sum, plus the shared expert's SwiGLU scaled by sigmoid(x · shexp_gate_inp_w). With `xq`
    (x in Q8_0: the q8 numerics) the expert and shared-expert products take Q8_0 activations,
    as llama.cpp's CPU path does: xq for gate and up, each SwiGLU quantised for down; the
    router and the shared gate keep x."""
    top_p, ids = topk(softmax(matmul(x, router_w), axis=-1), k=k)
    weights = top_p / sum_(top_p, axis=-1, keepdims=True)
    src = x if xq is None else xq

    def down_input(act: np.ndarray) -> np.ndarray:
        return act if xq is None else quantize_q8_0(act)
    act = activations.swiglu(NUMPY, expert_matmul(src, gate_exps, ids), expert_matmul(src, up_exps, ids))
    routed = sum_(expert_matmul(down_input(act), down_exps, ids) * weights.reshape(len(x), k, 1), axis=1)
    shared = matmul(down_input(activations.swiglu(NUMPY, matmul(src, shexp_gate_w), matmul(src, shexp_up_w))),
                    shexp_down_w)
    shared_gate = activations.sigmoid(NUMPY, matmul(x, as_f32(shexp_gate_inp_w).reshape(1, -1)))
    return np.asarray(routed + shared * shared_gate)


def _gate_rule(x: TensorType, g: TensorType) -> TensorType:
    expect_dtype("x", x, DType.F32)
    return _infer("mul", x, g)[0]


@defop("swiglu", _gate_rule)
def swiglu(a, b):
    """silu(a) * b, numpy broadcasting."""
    return np.asarray(activations.swiglu(NUMPY, np.asarray(a), np.asarray(b)))


@defop("sigmoid_gate", _gate_rule)
def sigmoid_gate(x, g):
    """x * sigmoid(g), numpy broadcasting."""
    return np.asarray(activations.sigmoid_gate(NUMPY, np.asarray(x), np.asarray(g)))

"""Rotary embedding and the Gated DeltaNet state ops.

rope: one element per block point; the f32 inverse frequency is computed in the kernel as
the reference rounds it (f32 exponent, f64 power, f32 result), cos/sin are taken in f64 of
the f32 angle, as the reference does, and the pairs and their rotation are the op's
(RotaryPairs, rotate) written as TIR. causal_conv1d: a reduction block for y and copies
for the new (and per-row) states. gated_delta_rule: one sequential point per state column
(v head, value dim) keeping S[:, col] in local memory while it walks the rows; on the llvm
target a task per v head instead (cpu_schedules.delta_rule_nest). The fused
gated delta rule and the fused layer (fused_gated_deltanet) as their parts' kernels."""
from __future__ import annotations

import numpy as np


from dflash_ir.ops.position import RotaryPairs, frequency_components, rotate
from dflash_ir.ops.recurrent import delta_error, delta_update

from ..kernels.recurrent import gated_deltanet_parts
from .cpu_schedules import delta_rule_nest
from .lowering import TVMNodeCtx, lowers
from .tir import TIR, _IndexText, _Text, block, dim, f32, weight_at


def _select(index: str, values, literal=lambda v: str(int(v))) -> str:
    """values[index] for a small constant table, as a chain of selects over its runs, each
    value written by `literal`."""
    runs = []
    for j, v in enumerate(values):
        if runs and runs[-1][1] == v:
            runs[-1][0] = j + 1
        else:
            runs.append([j + 1, v])
    expr = literal(runs[-1][1])
    for end, v in reversed(runs[:-1]):
        expr = f"T.if_then_else({index} < {end}, {literal(v)}, {expr})"
    return expr


@lowers("rope")
def rope(ctx: TVMNodeCtx) -> None:
    x, pos = ctx.ins
    t, h, d = x.type.shape
    n_rot = ctx.attr["n_rot"]
    half = n_rot // 2
    components = frequency_components(half, tuple(ctx.attr.get("sections", ())), ctx.attr.get("interleaved", False))
    D, H = dim(d), dim(h)
    pairs = RotaryPairs(n_rot, ctx.attr.get("pairs", "halves"))
    j, is_first = pairs.of(_IndexText("dd"), TIR.select)
    first, second = pairs.dims(j)
    # inv_freq_f32's rounding (f32 exponent, f64 power, f32 result), computed here: TVM's OpenCL C
    # prints a float32 literal to ~7 digits, which a large position's angle would multiply
    theta = float(np.float64(np.float32(ctx.attr["theta"])))
    inv_freq = (f'(T.float32(1) / T.Cast("float32", T.pow(T.float64({theta!r}), '
                f'T.Cast("float64", T.Cast("float32", 2 * {j}) / T.float32({n_rot})))))')
    factors = ctx.attr.get("freq_factors", ())
    if factors:  # ops/position.py: the inverse frequency divided by its factor, in f32
        inv_freq = f"({inv_freq} / {_select(j, factors, lambda v: f32(float(v)))})"
    if pos.type.rank == 2:
        position = f"pos[ti * {dim(pos.type.shape[1])} + {_select(j, components)}]"
    else:
        position = "pos[ti]"
    angle = f'T.Cast("float64", T.Cast("float32", {position}) * {inv_freq})'
    c, s = f'T.Cast("float32", T.cos({angle}))', f'T.Cast("float32", T.sin({angle}))'
    base = f"(ti * {H} + hi) * {D}"
    lo, hi = _Text(f"x[{base} + {first}]"), _Text(f"x[{base} + {second}]")
    x_turned, y_turned = rotate(lo, hi, _Text(c), _Text(s))
    value = f"T.if_then_else(dd >= {n_rot}, x[{base} + dd], T.if_then_else({is_first}, {x_turned}, {y_turned}))"
    ctx.kernel("rope", [("x", x, False), ("pos", pos, False), ("out", ctx.outs[0], True)],
               block([("ti", dim(t)), ("hi", H), ("dd", D)], f"out[{base} + dd] = {value}"))


@lowers("causal_conv1d")
def causal_conv1d(ctx: TVMNodeCtx) -> None:
    """Over xx = concat(state, x): y[t, c] = sum_j w[c, j] xx[t + j, c]; the new state is
    xx's last K-1 rows."""
    x, w, state = ctx.ins
    y, new_state = ctx.outs
    t, c = x.type.shape
    width = w.type.shape[1]
    T, C, K1 = dim(t), dim(c), width - 1

    def xx(r: str) -> str:
        return (f"T.if_then_else({r} < {K1}, state[T.min({r}, {K1 - 1}) * {C} + ch], "
                f"x[T.max({r} - {K1}, 0) * {C} + ch])")

    sources = [("x", x, False), ("state", state, False)]
    silu = ctx.attr.get("activation", "none") == "silu"
    conv = ctx.temp(y.type) if silu else y
    ctx.kernel("causal_conv1d", sources + [("w", w, False), ("y", conv, True)],
               block([("row", T), ("ch", C)],
                     f"y[row * {C} + ch] = y[row * {C} + ch] + {xx('row + j')} * {weight_at(w.type.dtype, 'w', 'ch', 'j', width)}",
                     reduce=[("j", str(width))], init=f"y[row * {C} + ch] = T.float32(0)"))
    if silu:
        ctx.sub("silu", conv, outputs=[y])
    ctx.kernel("conv_state", sources + [("new_state", new_state, True)],
               block([("e", str(K1)), ("ch", C)], f"new_state[e * {C} + ch] = {xx(f'{T} + e')}"))


@lowers("gated_delta_rule")
def gated_delta_rule(ctx: TVMNodeCtx) -> None:
    """S <- e^g S + k δᵀ with δ = β(v - e^g Sᵀk) (ops/recurrent.py's delta_error and
    delta_update), o = Sᵀ(q scale), per state column. The chunked form (chunk_size > 0) is
    the same recurrence, so it runs this kernel too."""
    q, k, v, g, beta, state = ctx.ins
    o, new_state = ctx.outs
    t, hk, dk = q.type.shape
    hv, dv = v.type.shape[1], v.type.shape[2]
    T, DK, DV = dim(t), dim(dk), dim(dv)
    tiled = ctx.attr.get("head_map", "tiled") == "tiled"
    buffers = [("q", q, False), ("k", k, False), ("v", v, False), ("g", g, False), ("beta", beta, False),
               ("state", state, False), ("o", o, True), ("new_state", new_state, True)]
    if ctx.profile == "cpu" and isinstance(dk, int) and isinstance(dv, int):
        nest = delta_rule_nest(T, hk, hv, dk, dv, tiled, float(ctx.attr["scale"]))
        ctx.kernel("gated_delta_rule", buffers, nest, cpu_body=nest, noalias=False)
        return
    kh = f"h % {hk}" if tiled else f"h // {hv // hk}"
    cell = f"(h * {DK} + e) * {DV} + col"
    qk = f"(ti * {hk} + {kh}) * {DK} + e"
    tv = f"ti * {hv} + h"
    sums, delta, decay = _Text("a[0]"), _Text("a[1]"), _Text("a[3]")
    error = delta_error(_Text(f"v[({tv}) * {DV} + col]"), sums, decay, _Text(f"beta[{tv}]"))
    body = (f"for e in range({DK}):\n    S[e] = state[{cell}]\n"
            f"for ti in range({T}):\n"
            f"    {decay} = T.exp(g[{tv}])\n"
            f"    {sums} = T.float32(0)\n"
            f"    for e in range({DK}):\n        {sums} = {sums} + S[e] * k[{qk}]\n"
            f"    {delta} = {error}\n"
            f"    a[2] = T.float32(0)\n"
            f"    for e in range({DK}):\n        S[e] = {delta_update(_Text('S[e]'), _Text(f'k[{qk}]'), delta, decay)}\n"
            f"        a[2] = a[2] + S[e] * (q[{qk}] * {f32(ctx.attr['scale'])})\n"
            f"    o[({tv}) * {DV} + col] = a[2]\n"
            f"for e in range({DK}):\n    new_state[{cell}] = S[e]")
    ctx.sequential("gated_delta_rule", buffers,
                   [("h", str(hv)), ("col", DV)], body, [("S", dk), ("a", 4)])


@lowers("fused_gated_delta_rule")
def fused_gated_delta_rule(ctx: TVMNodeCtx) -> None:
    """The fused op as its parts' kernels (slices, norms, gate arithmetic, the rule)."""
    mixed, a, b, dt_bias, ssm_a, state = ctx.ins
    hv, dk, dv = state.type.shape
    rows, kd = mixed.type.shape[0], ctx.attr["key_heads"] * dk

    def part(start: int, stop: int, heads: int, width: int):
        return ctx.sub("reshape", ctx.sub("slice", mixed, axis=1, start=start, stop=stop), shape=(rows, heads, width))

    q, k = (ctx.sub("l2norm", part(i * kd, (i + 1) * kd, ctx.attr["key_heads"], dk), eps=ctx.attr["eps"])
            for i in (0, 1))
    g = ctx.sub("mul", ctx.sub("softplus", ctx.sub("add", a, dt_bias)), ssm_a)
    rule = {n: ctx.attr[n] for n in ("scale", "head_map", "chunk_size") if n in ctx.attr}
    ctx.sub("gated_delta_rule", q, k, part(2 * kd, mixed.type.shape[1], hv, dv), g, ctx.sub("sigmoid", b), state,
            outputs=ctx.outs, **rule)


lowers("fused_gated_deltanet")(gated_deltanet_parts)

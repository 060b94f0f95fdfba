"""Attention over a fixed-capacity KV cache, the cache write and the fused attention layer.

Attention is four reduction blocks and a scaling block over per-node temporaries (scores,
row max, row sum): kv_len is read on the device, so one kernel serves every cache fill,
and masked keys contribute an exact 0 (never 0 * whatever the unused cache rows hold).
On the llvm target (the cpu profile) it is one hand-written loop nest instead
(cpu_schedules.attention_nest)."""
from __future__ import annotations

from dflash_ir.dtypes import DType
from dflash_ir.ir import Value
from dflash_ir.ops.attention import visible_range
from dflash_ir.ops.fused import attention_inputs
from dflash_ir.ops.position import ROPE_DEFAULTS
from dflash_ir.types import TensorType

from .cpu_schedules import attention_nest
from .lowering import TVMNodeCtx, lowers
from .tir import TIR, _Text, block, dim, f32, prod


def attention_kernels(ctx: TVMNodeCtx, q: Value, k: Value, v: Value, kv_len: Value, out: Value, *, scale: float,
                      causal: bool, window: int) -> None:
    t, hq, d = q.type.shape
    cap, hkv, _ = k.type.shape
    dv = v.type.shape[2]
    ctx.check("attention", kv_len, size=dim(cap), rows=dim(t), flags=("ordered",) if causal or window else ())
    T, C, D, DV, group = dim(t), dim(cap), dim(d), dim(dv), hq // hkv
    if ctx.profile == "cpu":
        nest = attention_nest(T, C, hq, hkv, d, dv, scale, causal, window)
        ctx.kernel("attention", [("q", q, False), ("k", k, False), ("v", v, False), ("kv_len", kv_len, False),
                                 ("out", out, True)], nest, cpu_body=nest)
        return
    n = _Text(f"T.min(kv_len[0], {C})")
    lo, hi = visible_range(TIR, n, n - _Text(T) + _Text("row"), causal, window)
    visible = f"T.And(j >= {lo}, j < {hi})"
    scores = ctx.temp(TensorType(DType.F32, (t, hq, cap)))
    m, l = (ctx.temp(TensorType(DType.F32, (t, hq))) for _ in range(2))
    line, cell = f"row * {hq} + h", f"(row * {hq} + h) * {C} + j"
    ctx.kernel("attention_scores", [("q", q, False), ("k", k, False), ("s", scores, True)],
               block([("row", T), ("h", str(hq)), ("j", C)],
                     f"s[{cell}] = s[{cell}] + q[({line}) * {D} + e] * k[(j * {hkv} + h // {group}) * {D} + e]",
                     reduce=[("e", D)], init=f"s[{cell}] = T.float32(0)"))
    score = f"s[{cell}] * {f32(scale)}"
    ctx.kernel("attention_max", [("kv_len", kv_len, False), ("s", scores, False), ("m", m, True)],
               block([("row", T), ("h", str(hq))], f"m[{line}] = T.max(m[{line}], T.if_then_else({visible}, {score}, "
                     f"{f32(float('-inf'))}))", reduce=[("j", C)], init=f"m[{line}] = {f32(float('-inf'))}"))
    p = f"T.exp({score} - m[{line}])"
    ctx.kernel("attention_sum", [("kv_len", kv_len, False), ("s", scores, False), ("m", m, False), ("l", l, True)],
               block([("row", T), ("h", str(hq))], f"l[{line}] = l[{line}] + T.if_then_else({visible}, {p}, T.float32(0))",
                     reduce=[("j", C)], init=f"l[{line}] = T.float32(0)"))
    o = f"({line}) * {DV} + c"
    acc = ctx.temp(out.type)
    ctx.kernel("attention_values", [("kv_len", kv_len, False), ("s", scores, False), ("m", m, False), ("v", v, False),
                                    ("acc", acc, True)],
               block([("row", T), ("h", str(hq)), ("c", DV)],
                     f"acc[{o}] = acc[{o}] + T.if_then_else({visible}, {p} * v[(j * {hkv} + h // {group}) * {DV} + c], "
                     f"T.float32(0))", reduce=[("j", C)], init=f"acc[{o}] = T.float32(0)"))
    ctx.kernel("attention_normalise", [("l", l, False), ("acc", acc, False), ("out", out, True)],
               block([("row", T), ("h", str(hq)), ("c", DV)], f"out[{o}] = acc[{o}] / l[{line}]"))


@lowers("attention")
def attention(ctx: TVMNodeCtx) -> None:
    a = ctx.attr
    attention_kernels(ctx, *ctx.ins, ctx.outs[0], scale=a["scale"], causal=a.get("causal", True),
                      window=a.get("window", 0))


def copy(ctx: TVMNodeCtx, src: Value, dst: Value) -> None:
    ctx.kernel("copy", [("x", src, False), ("out", dst, True)], block([("i", prod(src.type.shape))], "out[i] = x[i]"))


def write_rows(ctx: TVMNodeCtx, new: Value, pos: Value, cache: Value) -> None:
    """cache rows [pos, pos + T) = new; rows past the capacity are dropped (the host check
    reports the overflow first)."""
    row = prod(cache.type.shape[1:])
    limit = f"{dim(cache.type.shape[0])} * {row}"
    body = f"if T.And(pos[0] >= 0, pos[0] * {row} + i < {limit}):\n    out[pos[0] * {row} + i] = new_rows[i]"
    ctx.sequential("kv_write", [("new_rows", new, False), ("pos", pos, False), ("out", cache, True)],
                   [("i", prod(new.type.shape))], body)


@lowers("kv_write")
def kv_write(ctx: TVMNodeCtx) -> None:
    """In place when nothing else reads the old cache (the usual case), else into a copy."""
    cache, new, pos = ctx.ins
    out = ctx.outs[0]
    ctx.check("kv_write", pos, size=dim(cache.type.shape[0]), rows=dim(new.type.shape[0]))
    if ctx.can_overwrite(cache):
        ctx.alias(out, cache)
    else:
        copy(ctx, cache, out)
    write_rows(ctx, new, pos, out)


def attention_prologue(ctx: TVMNodeCtx) -> tuple[Value, Value]:
    """q and k of a fused_attention node after their rmsnorm (none with eps None) and rope (q
    without its gate half)."""
    a = ctx.attr
    x = attention_inputs(ctx.ins, a["eps"])
    q, k = x["q"], x["k"]
    rope = {n: a[n] for n in ("n_rot", "theta", *ROPE_DEFAULTS) if n in a}
    q_part = ctx.sub("slice", q, axis=2, start=0, stop=k.type.shape[2]) if a.get("gated") else q

    def normed(value: Value, norm: str) -> Value:
        return value if a["eps"] is None else ctx.sub("rmsnorm", value, x[norm], eps=a["eps"])

    return tuple(ctx.sub("rope", normed(value, norm), x["positions"], **rope)
                 for value, norm in ((q_part, "q_norm"), (k, "k_norm")))


def attention_epilogue(ctx: TVMNodeCtx, o: Value) -> None:
    """The fused_attention output: o (rows, heads, dv) flattened, times sigmoid(gate) when
    gated, quantised to Q8_0 with `q8_out`."""
    q, k = ctx.ins[:2]
    rows, heads, dv = o.type.shape
    quantised = ctx.attr.get("q8_out", False)
    flat = ctx.sub("reshape", o, shape=(rows, heads * dv))
    if ctx.attr.get("gated"):
        gate = ctx.sub("reshape", ctx.sub("slice", q, axis=2, start=k.type.shape[2]), shape=(rows, heads * dv))
        flat = ctx.sub("sigmoid_gate", flat, gate, outputs=None if quantised else [ctx.outs[0]])
    if quantised:
        ctx.sub("quantize_q8_0", flat, outputs=[ctx.outs[0]])
    elif not ctx.attr.get("gated"):
        ctx.alias(ctx.outs[0], flat)


@lowers("fused_attention")
def fused_attention(ctx: TVMNodeCtx) -> None:
    """rmsnorm + rope of q and k, the cache writes (in place with `persist`, else into
    per-node copies of the caches), attention, then the optional sigmoid output gate."""
    a = ctx.attr
    x = attention_inputs(ctx.ins, a["eps"])
    q, v, pos, kv_len, k_cache, v_cache = (x[n] for n in ("q", "v", "pos", "kv_len", "k_cache", "v_cache"))
    rows, heads = q.type.shape[:2]
    q_rot, k_rot = attention_prologue(ctx)
    o = ctx.temp(TensorType(DType.F32, (rows, heads, v.type.shape[2])))
    kw = dict(scale=a["scale"], causal=a.get("causal", True), window=a.get("window", 0))
    if a.get("persist", True):
        k_all, v_all = ctx.outs[1:]
        ctx.sub("kv_write", k_cache, k_rot, pos, outputs=[k_all])
        ctx.sub("kv_write", v_cache, v, pos, outputs=[v_all])
    else:
        ctx.check("kv_write", pos, size=dim(k_cache.type.shape[0]), rows=dim(rows))
        k_all, v_all = ctx.temp(k_cache.type), ctx.temp(v_cache.type)
        for cache, new, dst in ((k_cache, k_rot, k_all), (v_cache, v, v_all)):
            copy(ctx, cache, dst)
            write_rows(ctx, new, pos, dst)
    attention_kernels(ctx, q_rot, k_all, v_all, kv_len, o, **kw)
    attention_epilogue(ctx, o)

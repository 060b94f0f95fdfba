"""Attention over a fixed-capacity KV cache, the cache write, and the fused attention layer.

Attention: a work-group per (query row, q head) walks the visible keys in tiles of its
thread count with an online softmax (running max and sum, flash-attention style): each
thread scores one key of the tile, and owns a slice of the output dims it accumulates.
kv_len is read on the device, so one launch serves every cache fill.
"""
from __future__ import annotations

from dflash_ir.ir import Value

from ..lowering import NodeCtx, lowers
from .common import FLAT, cdiv, dim, f32, flat_launch, prod, tree_reduce

THREADS = 64


def attention_launch(ctx: NodeCtx, q: Value, k: Value, v: Value, kv_len: Value, out: Value, *, scale: float,
                     causal: bool, window: int, new: tuple[Value, Value, Value] | None = None) -> None:
    """With `new` = (k rows, v rows, pos), cache rows [pos, pos + rows) are read from the new
    rows instead: attention over kv_write(cache, new, pos) without writing the cache."""
    t, hq, d = q.type.shape
    cap, hkv, _ = k.type.shape
    dv = v.type.shape[2]
    ctx.check("attention", kv_len, size=dim(cap), rows=dim(t), flags=("ordered",) if causal or window else ())
    L, T, D, DV = THREADS, dim(t), dim(d), dim(dv)
    per = -(-dv // L)
    hi = "min(n, qpos + 1)" if causal else "n"
    lo = f"max(0, qpos - {window - 1})" if window else "0"
    key, value = f"k + ((i64)j * {hkv} + kh) * {D}", f"v + ((i64)(base + jj) * {hkv} + kh) * {DV}"
    buffers = [("q", q, False), ("k", k, False), ("v", v, False), ("kv_len", kv_len, False)]
    if new:
        rows = dim(new[0].type.shape[0])
        key = f"(j >= p0 && j < p0 + {rows} ? kn + ((i64)(j - p0) * {hkv} + kh) * {D} : {key})"
        value = (f"(base + jj >= p0 && base + jj < p0 + {rows} ? vn + ((i64)(base + jj - p0) * {hkv} + kh) * {DV}"
                 f" : {value})")
        buffers += [("kn", new[0], False), ("vn", new[1], False), ("pos", new[2], False)]
    qpos = f", qpos = n - {T} + row" if causal or window else ""
    body = (f"  int row = GID(0), h = GID(1), lid = LID(0), kh = h / {hq // hkv};\n"
            f"  int n = min(kv_len[0], {dim(cap)}){qpos};\n"
            f"  int hi = {hi}, lo = {lo}{', p0 = pos[0]' if new else ''};\n"
            f"  LOCAL float qs[{d}];\n  LOCAL float p[{L}];\n  LOCAL float red[{L}];\n"
            f"  for (int e = lid; e < {D}; e += {L}) qs[e] = q[((i64)row * {hq} + h) * {D} + e];\n"
            f"  float m = -INFINITY, l = 0.0f, acc[{per}];\n"
            f"  for (int e = 0; e < {per}; ++e) acc[e] = 0.0f;\n"
            f"  for (int base = lo; base < hi; base += {L}) {{\n"
            f"    int j = base + lid;\n    float s = -INFINITY;\n    BARRIER();\n"
            f"    if (j < hi) {{\n      GLOBAL const float* kr = {key};\n"
            f"      float dot = 0.0f;\n      for (int e = 0; e < {D}; ++e) dot += qs[e] * kr[e];\n"
            f"      s = dot * {f32(scale)};\n    }}\n"
            f"    red[lid] = s;\n" + _indent(tree_reduce("red", L, "fmaxf(a, b)")) +
            "    float mt = fmaxf(m, red[0]);\n    float pj = j < hi ? expf(s - mt) : 0.0f;\n"
            "    BARRIER();\n    p[lid] = pj;\n    red[lid] = pj;\n" + _indent(tree_reduce("red", L, "a + b")) +
            f"    float alpha = expf(m - mt);\n    l = l * alpha + red[0];\n    m = mt;\n"
            f"    int count = min({L}, hi - base);\n"
            f"    for (int e = 0; e < {per}; ++e) {{\n      int c = lid + e * {L};\n      float a = acc[e] * alpha;\n"
            f"      if (c < {DV}) for (int jj = 0; jj < count; ++jj) a += p[jj] * ({value})[c];\n"
            f"      acc[e] = a;\n    }}\n  }}\n"
            f"  for (int e = 0; e < {per}; ++e) {{\n    int c = lid + e * {L};\n"
            f"    if (c < {DV}) out[((i64)row * {hq} + h) * {DV} + c] = acc[e] / l;\n  }}\n")
    ctx.launch("attention", body, buffers=buffers + [("out", out, True)], groups=[T, str(hq)], local=(L,))


def _indent(code: str) -> str:
    return "".join("  " + line + "\n" for line in code.splitlines())


@lowers("attention")
def attention(ctx: NodeCtx) -> None:
    a = ctx.attr
    attention_launch(ctx, *ctx.ins, ctx.outs[0], scale=a["scale"], causal=a.get("causal", True),
                     window=a.get("window", 0))


@lowers("kv_write")
def kv_write(ctx: NodeCtx) -> None:
    """Rows [pos, pos + T) of the cache replaced by `new`, written in place when nothing else
    reads the old cache (the usual case), else into a copy. Rows past the capacity are
    dropped on the device; the host check reports the overflow first."""
    cache, new, pos = ctx.ins
    out = ctx.outs[0]
    capacity, row, total = dim(cache.type.shape[0]), prod(cache.type.shape[1:]), prod(new.type.shape)
    ctx.check("kv_write", pos, size=capacity, rows=dim(new.type.shape[0]))
    if ctx.can_overwrite(cache):
        ctx.alias(out, cache)
    else:
        flat_launch(ctx, "  out[i] = x0[i];\n", inputs=[cache], op="copy")
    body = (f"  int i = GID(0) * {FLAT} + LID(0);\n  if (i >= {total}) return;\n"
            f"  i64 at = (i64)pos[0] * {row} + i;\n"
            f"  if (pos[0] >= 0 && at < (i64){capacity} * {row}) out[at] = new_rows[i];\n")
    ctx.launch("kv_write", body, buffers=[("new_rows", new, False), ("pos", pos, False), ("out", out, True)],
               groups=[cdiv(total, FLAT)])


@lowers("fused_attention")
def fused_attention(ctx: NodeCtx) -> None:
    """The layer as its parts' kernels: rmsnorm + rope of q and k, the cache writes (in place)
    or, without `persist`, attention reading the new rows beside the untouched caches, then
    the optional sigmoid output gate."""
    q, k, v, q_norm, k_norm, positions, pos, kv_len, k_cache, v_cache = ctx.ins
    a = ctx.attr
    rows, heads, _ = q.type.shape
    d, dv = k.type.shape[2], v.type.shape[2]
    rope = {n: a[n] for n in ("n_rot", "theta", "sections", "interleaved") if n in a}
    q_part = ctx.sub("slice", q, axis=2, start=0, stop=d) if a.get("gated") else q
    q_rot = ctx.sub("rope", ctx.sub("rmsnorm", q_part, q_norm, eps=a["eps"]), positions, **rope)
    k_rot = ctx.sub("rope", ctx.sub("rmsnorm", k, k_norm, eps=a["eps"]), positions, **rope)
    o = ctx.temp(q_rot.type.__class__(q_rot.type.dtype, (rows, heads, dv)))
    kw = dict(scale=a["scale"], causal=a.get("causal", True), window=a.get("window", 0))
    if a.get("persist", True):
        k_all, v_all = ctx.outs[1:]
        ctx.sub("kv_write", k_cache, k_rot, pos, outputs=[k_all])
        ctx.sub("kv_write", v_cache, v, pos, outputs=[v_all])
        attention_launch(ctx, q_rot, k_all, v_all, kv_len, o, **kw)
    else:
        ctx.check("kv_write", pos, size=dim(k_cache.type.shape[0]), rows=dim(rows))
        attention_launch(ctx, q_rot, k_cache, v_cache, kv_len, o, **kw, new=(k_rot, v, pos))
    flat = ctx.sub("reshape", o, shape=(rows, heads * dv))
    if a.get("gated"):
        gate = ctx.sub("reshape", ctx.sub("slice", q, axis=2, start=d), shape=(rows, heads * dv))
        ctx.sub("sigmoid_gate", flat, gate, outputs=[ctx.outs[0]])
    else:
        ctx.alias(ctx.outs[0], flat)

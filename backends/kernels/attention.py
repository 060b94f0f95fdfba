"""Attention over a fixed-capacity KV cache, the cache write, and the fused attention layer.

Attention: a work-group per (query row, q head) walks the visible keys in tiles of its
thread count with an online softmax (running max and sum, flash-attention style): each
thread scores one key of the tile, and owns a slice of the output dims it accumulates.
The CPU profile gives the whole (row, head) to one work-item instead (`_cpu_body`).
kv_len is read on the device, so one launch serves every cache fill.
"""
from __future__ import annotations

from dflash_ir.ir import Value

from ..lowering import NodeCtx, attention_epilogue, attention_prologue, lowers
from .common import FLAT, cdiv, dim, f32, flat_launch, group_reduce, prod, read, write

THREADS = 64
KEY_CHUNK = 32   # CPU schedule: keys scored between two rescales of the output row
LANES = 8        # CPU schedule: partial sums of a q.k dot product


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
    # key j's row starts at kr in k; value row r is read at column c
    key_row = f"      i64 kr = (I64(j) * {hkv} + kh) * {D};\n"
    key, value = "k[kr + e]", f"v[(I64(r) * {hkv} + kh) * {DV} + c]"
    buffers = [("q", q, False), ("k", k, False), ("v", v, False), ("kv_len", kv_len, False)]
    if new:
        rows = dim(new[0].type.shape[0])
        key_row = (f"      bool fresh = j >= p0 && j < p0 + {rows};\n"
                   f"      i64 kr = (I64(fresh ? j - p0 : j) * {hkv} + kh) * {D};\n")
        key = f"(fresh ? kn[kr + e] : {key})"
        value = f"(r >= p0 && r < p0 + {rows} ? vn[(I64(r - p0) * {hkv} + kh) * {DV} + c] : {value})"
        buffers += [("kn", new[0], False), ("vn", new[1], False), ("pos", new[2], False)]
    qpos = f", qpos = n - {T} + row" if causal or window else ""
    if ctx.profile == "cpu":
        body = _cpu_body(hq, hkv, d, dv, cap, qpos, hi, lo, ", p0 = pos[0]" if new else "", key_row, key, value, scale)
        ctx.launch("attention_rows", body, buffers=buffers + [("out", out, True)], groups=[T, str(hq)], local=(1,))
        return
    body = (f"  int row = GID(0), h = GID(1), lid = LID(0), kh = h / {hq // hkv};\n"
            f"  int n = min(kv_len[0], {dim(cap)}){qpos};\n"
            f"  int hi = {hi}, lo = {lo}{', p0 = pos[0]' if new else ''};\n"
            f"  LOCAL float qs[{d}];\n  LOCAL float p[{L}];\n  LOCAL float red[{L}];\n"
            f"  for (int e = lid; e < {D}; e += {L}) qs[e] = q[(I64(row) * {hq} + h) * {D} + e];\n"
            f"  float m = -INFINITY, l = 0.0f, acc[{per}];\n"
            f"  for (int e = 0; e < {per}; ++e) acc[e] = 0.0f;\n"
            f"  for (int base = lo; base < hi; base += {L}) {{\n"
            f"    int j = base + lid;\n    float s = -INFINITY;\n    BARRIER();\n"
            f"    if (j < hi) {{\n{key_row}"
            f"      float qk = 0.0f;\n      for (int e = 0; e < {D}; ++e) qk += qs[e] * {key};\n"
            f"      s = qk * {f32(scale)};\n    }}\n"
            f"    red[lid] = s;\n" + _indent(group_reduce("red", L, "max")) +
            "    float mt = fmaxf(m, red[0]);\n    float pj = j < hi ? expf(s - mt) : 0.0f;\n"
            "    BARRIER();\n    p[lid] = pj;\n    red[lid] = pj;\n" + _indent(group_reduce("red", L, "sum")) +
            f"    float alpha = expf(m - mt);\n    l = l * alpha + red[0];\n    m = mt;\n"
            f"    int count = min({L}, hi - base);\n"
            f"    for (int e = 0; e < {per}; ++e) {{\n      int c = lid + e * {L};\n      float a = acc[e] * alpha;\n"
            f"      if (c < {DV}) for (int jj = 0; jj < count; ++jj) {{ int r = base + jj; a += p[jj] * {value}; }}\n"
            f"      acc[e] = a;\n    }}\n  }}\n"
            f"  for (int e = 0; e < {per}; ++e) {{\n    int c = lid + e * {L};\n"
            f"    if (c < {DV}) out[(I64(row) * {hq} + h) * {DV} + c] = acc[e] / l;\n  }}\n")
    ctx.launch("attention", body, buffers=buffers + [("out", out, True)], groups=[T, str(hq)], local=(L,))


def _cpu_body(hq, hkv, d, dv, cap, qpos, hi, lo, p0, key_row, key, value, scale) -> str:
    """CPU schedule: one work-item per (query row, q head) walks the visible keys in chunks
    of KEY_CHUNK, scores them with LANES independent partial sums (a vectorisable dot
    product), then rescales its private output row once per chunk (online softmax)."""
    D, DV = dim(d), dim(dv)
    tail = "" if isinstance(d, int) and d % LANES == 0 else f" && e0 + e1 < {D}"
    return (f"  int row = GID(0), h = GID(1), kh = h / {hq // hkv};\n"
            f"  int n = min(kv_len[0], {dim(cap)}){qpos};\n"
            f"  int hi = {hi}, lo = {lo}{p0};\n"
            f"  i64 qr = (I64(row) * {hq} + h) * {D};\n"
            f"  float m = -INFINITY, l = 0.0f, acc[{dv}], sc[{KEY_CHUNK}], part[{LANES}];\n"
            f"  for (int c = 0; c < {DV}; ++c) acc[c] = 0.0f;\n"
            f"  for (int base = lo; base < hi; base += {KEY_CHUNK}) {{\n"
            f"    int count = min({KEY_CHUNK}, hi - base);\n    float mt = m;\n"
            f"    for (int jj = 0; jj < count; ++jj) {{\n      int j = base + jj;\n{key_row}"
            f"      for (int e = 0; e < {LANES}; ++e) part[e] = 0.0f;\n"
            f"      for (int e0 = 0; e0 < {D}; e0 += {LANES})\n"
            f"        for (int e1 = 0; e1 < {LANES}{tail}; ++e1) {{ int e = e0 + e1; part[e1] += q[qr + e] * {key}; }}\n"
            f"      float qk = 0.0f;\n      for (int e = 0; e < {LANES}; ++e) qk += part[e];\n"
            f"      sc[jj] = qk * {f32(scale)};\n      mt = fmaxf(mt, sc[jj]);\n    }}\n"
            f"    float alpha = expf(m - mt);\n    l *= alpha;\n"
            f"    for (int c = 0; c < {DV}; ++c) acc[c] *= alpha;\n"
            f"    for (int jj = 0; jj < count; ++jj) {{\n      int r = base + jj;\n      float pj = expf(sc[jj] - mt);\n"
            f"      l += pj;\n      for (int c = 0; c < {DV}; ++c) acc[c] += pj * {value};\n    }}\n"
            f"    m = mt;\n  }}\n"
            f"  i64 orow = (I64(row) * {hq} + h) * {DV};\n"
            f"  for (int c = 0; c < {DV}; ++c) out[orow + c] = acc[c] / l;\n")


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
        flat_launch(ctx, f"  {write(out, 'out', 'i', read(cache, 'x0', 'i'))}\n", inputs=[cache], op="copy")
    body = (f"  int i = GID(0) * {FLAT} + LID(0);\n  if (i >= {total}) return;\n"
            f"  i64 at = I64(pos[0]) * {row} + i;\n"
            f"  if (pos[0] >= 0 && at < I64({capacity}) * {row}) {write(out, 'out', 'at', read(new, 'new_rows', 'i'))}\n")
    ctx.launch("kv_write", body, buffers=[("new_rows", new, False), ("pos", pos, False), ("out", out, True)],
               groups=[cdiv(total, FLAT)])


@lowers("fused_attention")
def fused_attention(ctx: NodeCtx) -> None:
    """The layer as its parts' kernels: rmsnorm + rope of q and k, the cache writes (in place)
    or, without `persist`, attention reading the new rows beside the untouched caches, then
    the optional sigmoid output gate."""
    q, k, v, _, _, _, pos, kv_len, k_cache, v_cache = ctx.ins
    a = ctx.attr
    rows, heads = q.type.shape[:2]
    q_rot, k_rot = attention_prologue(ctx)
    o = ctx.temp(q_rot.type.__class__(q_rot.type.dtype, (rows, heads, v.type.shape[2])))
    kw = dict(scale=a["scale"], causal=a.get("causal", True), window=a.get("window", 0))
    if a.get("persist", True):
        k_all, v_all = ctx.outs[1:]
        ctx.sub("kv_write", k_cache, k_rot, pos, outputs=[k_all])
        ctx.sub("kv_write", v_cache, v, pos, outputs=[v_all])
        attention_launch(ctx, q_rot, k_all, v_all, kv_len, o, **kw)
    else:
        ctx.check("kv_write", pos, size=dim(k_cache.type.shape[0]), rows=dim(rows))
        attention_launch(ctx, q_rot, k_cache, v_cache, kv_len, o, **kw, new=(k_rot, v, pos))
    attention_epilogue(ctx, o)

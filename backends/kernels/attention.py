"""Attention over a fixed-capacity KV cache, the cache write, and the fused attention layer.

Attention: a work-group per (query row, q head) walks the visible keys in tiles of its
thread count with an online softmax (running max and sum, flash-attention style): each
thread scores one key of the tile, and owns a slice of the output dims it accumulates.
The CPU profile gives the whole (row, head) to one work-item instead (`_cpu_schedule`).
kv_len is read on the device, so one launch serves every cache fill.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dflash_ir.ir import Value
from dflash_ir.types import Dim

from ..kir import F32, I64, K, call, cast, maximum, minimum, select, var
from ..kir.build import Buffer
from ..lowering import KernelSpec, NodeCtx, attention_epilogue, attention_prologue, dim, lowers
from .access import read, write
from .shapes import FLAT, cdiv, flat_index, flat_launch, prod

THREADS = 64
KEY_CHUNK = 32   # CPU schedule: keys scored between two rescales of the output row
LANES = 8        # CPU schedule: partial sums of a q.k dot product
NEG_INF = float("-inf")


def _head_start(row: K, heads: int, head: K, width: Dim) -> K:
    """Offset of (row, head, 0) in a [rows, heads, width] tensor."""
    return (cast(I64, row) * heads + head) * dim(width)


@dataclass(frozen=True)
class _Cache:
    """The key and value rows of kv head `kh` as a kernel reads them: the cache's rows, or,
    with `new`, rows [p0, p0 + count) read from the new rows instead, so attention sees
    kv_write(cache, new, p0) without the cache being written."""

    k: Buffer
    v: Buffer
    heads: int
    kh: K
    d: Dim
    dv: Dim
    new: tuple[Buffer, Buffer, K, K] | None = None  # k rows, v rows, p0, their count

    def key(self, kb: KernelSpec, j: K) -> Callable[[K], K]:
        """Declares where key j's row starts; returns element e of that row."""
        if self.new is None:
            kr = kb.let("kr", self._start(j, self.d))
            return lambda e: self.k[kr + e]
        kn, _, p0, count = self.new
        fresh = kb.let("fresh", (j >= p0) & (j < p0 + count))
        kr = kb.let("kr", self._start(select(fresh, j - p0, j), self.d))
        return lambda e: select(fresh, kn[kr + e], self.k[kr + e])

    def value(self, r: K, c: K) -> K:
        """Element c of value row r."""
        cached = self.v[self._start(r, self.dv) + c]
        if self.new is None:
            return cached
        _, vn, p0, count = self.new
        return select((r >= p0) & (r < p0 + count), vn[self._start(r - p0, self.dv) + c], cached)

    def _start(self, r: K, width: Dim) -> K:
        return _head_start(r, self.heads, self.kh, width)


@dataclass(frozen=True)
class _Query:
    """What both schedules attend with: query row `row`, q head `h` of `heads`, over keys
    [lo, hi) of `cache`, the output row written to `out`."""

    q: Buffer
    out: Buffer
    row: K
    h: K
    heads: int
    lo: K
    hi: K
    cache: _Cache
    scale: float

    def q_start(self) -> K:
        return _head_start(self.row, self.heads, self.h, self.cache.d)

    def out_start(self) -> K:
        return _head_start(self.row, self.heads, self.h, self.cache.dv)


def attention_launch(ctx: NodeCtx, q: Value, k: Value, v: Value, kv_len: Value, out: Value, *, scale: float,
                     causal: bool, window: int, new: tuple[Value, Value, Value] | None = None) -> None:
    """With `new` = (k rows, v rows, pos), cache rows [pos, pos + rows) are read from the new
    rows instead: attention over kv_write(cache, new, pos) without writing the cache."""
    t, hq, d = q.type.shape
    cap, hkv, _ = k.type.shape
    dv = v.type.shape[2]
    ctx.check("attention", kv_len, size=dim(cap), rows=dim(t), flags=("ordered",) if causal or window else ())
    cpu = ctx.profile == "cpu"
    kb = ctx.kernel("attention_rows" if cpu else "attention", local=(1,) if cpu else (THREADS,))
    q_buf, k_buf, v_buf, kv_len_buf = (kb.bind(name, x) for name, x in zip(("q", "k", "v", "kv_len"),
                                                                           (q, k, v, kv_len)))
    new_bufs = [kb.bind(name, x) for name, x in zip(("kn", "vn", "pos"), new or ())]
    out_buf = kb.bind("out", out, writes=True)
    row, h = kb.let("row", kb.gid(0)), kb.let("h", kb.gid(1))
    lid = None if cpu else kb.let("lid", kb.lid(0))
    kh = kb.let("kh", h / (hq // hkv))
    lo, hi = _visible_keys(kb, minimum(kv_len_buf[0], dim(cap)), dim(t), row, causal, window)
    new_rows = None
    if new:
        kn, vn, pos = new_bufs
        new_rows = (kn, vn, kb.let("p0", pos[0]), dim(new[0].type.shape[0]))
    query = _Query(q_buf, out_buf, row, h, hq, lo, hi, _Cache(k_buf, v_buf, hkv, kh, d, dv, new_rows), scale)
    if cpu:
        _cpu_schedule(kb, query)
    else:
        _gpu_schedule(kb, query, lid)
    kb.launch([dim(t), hq])


def _visible_keys(kb: KernelSpec, kv_len: K, rows: K, row: K, causal: bool, window: int) -> tuple[K, K]:
    """Keys [lo, hi) that query `row` sees, the `rows` queries being the last rows of the
    first kv_len cache rows: up to its own position when causal, at most `window` back."""
    n = kb.let("n", kv_len)
    qpos = kb.let("qpos", n - rows + row) if causal or window else None
    hi = kb.let("hi", minimum(n, qpos + 1) if causal else n)
    lo = kb.let("lo", maximum(0, qpos - (window - 1)) if window else 0)
    return lo, hi


def _gpu_schedule(kb: KernelSpec, query: _Query, lid: K) -> None:
    """A work-group of THREADS per (row, head): each tile of keys is scored a key per
    thread, its max and sum reduced in local memory, then each thread adds the tile's
    weighted values to its output dims (lid, lid + THREADS, ...)."""
    d, dv, L = query.cache.d, query.cache.dv, THREADS
    per = -(-dv // L)
    qs = kb.array("qs", F32, d, "local")
    p = kb.array("p", F32, L, "local")
    red = kb.array("red", F32, L, "local")
    with kb.loop("e", lid, dim(d), L) as e:
        qs[e] = query.q[query.q_start() + e]
    m, l = kb.let("m", NEG_INF), kb.let("l", 0.0)
    acc = kb.array("acc", F32, per)
    with kb.loop("e", 0, per) as e:
        acc[e] = 0.0
    with kb.loop("base", query.lo, query.hi, L) as base:
        j = kb.let("j", base + lid)
        s = kb.let("s", NEG_INF)
        kb.barrier()
        with kb.if_(j < query.hi):
            key = query.cache.key(kb, j)
            qk = kb.let("qk", 0.0)
            with kb.loop("e", 0, dim(d)) as e:
                kb.set(qk, qk + qs[e] * key(e))
            kb.set(s, qk * query.scale)
        red[lid] = s
        kb.wg_reduce(red, L, "max")
        mt = kb.let("mt", maximum(m, red[0]))
        pj = kb.let("pj", select(j < query.hi, call("exp", s - mt), 0.0))
        kb.barrier()
        p[lid] = pj
        red[lid] = pj
        kb.wg_reduce(red, L, "sum")
        alpha = kb.let("alpha", call("exp", m - mt))
        kb.set(l, l * alpha + red[0])
        kb.set(m, mt)
        count = kb.let("count", minimum(L, query.hi - base))
        with kb.loop("e", 0, per) as e:
            c = kb.let("c", lid + e * L)
            acc_e = kb.let("a", acc[e] * alpha)
            with kb.if_(c < dim(dv)):
                with kb.loop("jj", 0, count) as jj:
                    r = kb.let("r", base + jj)
                    kb.set(acc_e, acc_e + p[jj] * query.cache.value(r, c))
            acc[e] = acc_e
    with kb.loop("e", 0, per) as e:
        c = kb.let("c", lid + e * L)
        with kb.if_(c < dim(dv)):
            query.out[query.out_start() + c] = acc[e] / l


def _cpu_schedule(kb: KernelSpec, query: _Query) -> None:
    """CPU schedule: one work-item per (query row, q head) walks the visible keys in chunks
    of KEY_CHUNK, scores them with LANES independent partial sums (a vectorisable dot
    product), then rescales its private output row once per chunk (online softmax)."""
    d, dv = query.cache.d, query.cache.dv
    D, DV = dim(d), dim(dv)
    ragged = not (isinstance(d, int) and d % LANES == 0)  # the last e0 step stops at D
    qr = kb.let("qr", query.q_start())
    m, l = kb.let("m", NEG_INF), kb.let("l", 0.0)
    acc, sc, part = (kb.array(name, F32, size) for name, size in (("acc", dv), ("sc", KEY_CHUNK), ("part", LANES)))
    with kb.loop("c", 0, DV) as c:
        acc[c] = 0.0
    with kb.loop("base", query.lo, query.hi, KEY_CHUNK) as base:
        count = kb.let("count", minimum(KEY_CHUNK, query.hi - base))
        mt = kb.let("mt", m)
        with kb.loop("jj", 0, count) as jj:
            key = query.cache.key(kb, kb.let("j", base + jj))
            with kb.loop("e", 0, LANES) as e:
                part[e] = 0.0
            with kb.loop("e0", 0, D, LANES) as e0:
                with kb.loop("e1", 0, LANES, cond=e0 + var("e1") < D if ragged else None) as e1:
                    e = kb.let("e", e0 + e1)
                    part[e1] += query.q[qr + e] * key(e)
            qk = kb.let("qk", 0.0)
            with kb.loop("e", 0, LANES) as e:
                kb.set(qk, qk + part[e])
            sc[jj] = qk * query.scale
            kb.set(mt, maximum(mt, sc[jj]))
        alpha = kb.let("alpha", call("exp", m - mt))
        kb.set(l, l * alpha)
        with kb.loop("c", 0, DV) as c:
            acc[c] *= alpha
        with kb.loop("jj", 0, count) as jj:
            r = kb.let("r", base + jj)
            pj = kb.let("pj", call("exp", sc[jj] - mt))
            kb.set(l, l + pj)
            with kb.loop("c", 0, DV) as c:
                acc[c] += pj * query.cache.value(r, c)
        kb.set(m, mt)
    orow = kb.let("orow", query.out_start())
    with kb.loop("c", 0, DV) as c:
        query.out[orow + c] = acc[c] / l


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
    capacity, row = dim(cache.type.shape[0]), prod(cache.type.shape[1:])
    ctx.check("kv_write", pos, size=capacity, rows=dim(new.type.shape[0]))
    if ctx.can_overwrite(cache):
        ctx.alias(out, cache)
    else:
        flat_launch(ctx, lambda kb, i, xs, out_buf: write(out, out_buf, i, read(cache, xs[0], i)), inputs=[cache],
                    op="copy")
    kb = ctx.kernel("kv_write", local=(FLAT,))
    new_rows, start, out_buf = kb.bind("new_rows", new), kb.bind("pos", pos), kb.bind("out", out, writes=True)
    total = prod(new.type.shape)
    i = flat_index(kb, total)
    at = kb.let("at", cast(I64, start[0]) * row + i)
    with kb.if_((start[0] >= 0) & (at < cast(I64, capacity) * row)):
        write(out, out_buf, at, read(new, new_rows, i))
    kb.launch([cdiv(total, FLAT)])


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

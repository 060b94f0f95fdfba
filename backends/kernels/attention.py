"""Attention over a fixed-capacity KV cache, the cache write, and the fused attention layer.

`attention` and `fused_attention` are one kernel each, made by one builder (`_Attention`)
in one of two schedules:

GPU: a work-group per (query row, q head) walks the visible keys in tiles of its thread
count with an online softmax (running max and sum, flash-attention style): each thread
scores one key of the tile, and owns a slice of the output dims it accumulates.

CPU: a work-item per (kv head, tile of query rows x the q heads sharing that kv head)
walks the keys the tile sees in chunks of KEY_CHUNK keys aligned to absolute positions, so
K and V are read once per tile instead of once per (row, head). Per chunk it scores every
(query, key) pair of the tile into a private block, Q_BLOCK queries x K_BLOCK keys at a
time (each a LANES-wide partial sum of FMAs, its lanes summed pairwise), then each row
takes its own visible keys of the chunk (the block's causal mask, the window) into its
heads' online softmax (the chunk's max and sum as vector trees over its slots, invisible
ones weighing exactly 0) and their output rows, one value load feeding the row's heads.
A query's arithmetic (the chunks, the dot-product lanes, the rescale, max, sum and
accumulation order) does not depend on which queries share its tile or where its keys are
read from, so a row's output is bit-identical alone (a decode) and in a verify block.
Without vectors (lavapipe) the same walk goes one scalar at a time over smaller tiles
(`_CpuTile`).

`fused_attention` is the same kernel with the layer around it: each query normalises
(q_norm) and ropes its own q row (the rope op's tables, from dflash_ir/ops/position.py);
keys and values of rows [pos, pos + T) are read from the k and v projections (k normalised
and roped on the fly by the code that writes it, so a key read there equals the key a
later call reads from the cache), every other row from the caches; with `persist` the new
K and V rows are written into the caches, by one writer per (row, kv head): the work-group
of the kv head's first q head (GPU), the tile holding the row (CPU). No work-item reads a
cache row this launch writes, so nothing waits for another launch; with the gate, the
output row is multiplied by sigmoid(gate). kv_len is read on the device, so one launch
serves every cache fill.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dflash_ir import activations
from dflash_ir.ir import Value
from dflash_ir.ops.attention import visible_range
from dflash_ir.ops.fused import attention_inputs
from dflash_ir.ops.position import RotaryPairs, frequency_components, inv_freq_f32, rotate
from dflash_ir.types import Dim

from ..kir import F32, I32, I64, K, call, cast, const, maximum, minimum, select, vsum
from ..kir.build import Array, Buffer
from ..lowering import KernelSpec, NodeCtx, dim, lowers
from .access import KERNEL, read, weight_at, write
from .linalg import Q8_VALUES, store_q8_blocks
from .shapes import FLAT, cdiv, flat_index, prod

THREADS = 64         # GPU: threads of a (row, head) work-group
KEY_CHUNK = 32       # CPU: keys scored between two rescales of a query's output row
LANES = 16           # CPU: widest partial sum of a dot product, widest vector of an output row
Q_BLOCK = 4          # CPU: queries scored together (one key load feeds Q_BLOCK dot products)
K_BLOCK = 2          # CPU: keys scored together (one q load feeds K_BLOCK dot products)
V_BLOCK = 8          # CPU: output vectors accumulated together (queries x vectors: independent FMA chains)
TILE_ROWS = 16       # CPU: most query rows per work-item (a verify block)
TILE_BYTES = 128 * 1024  # CPU: most bytes of q rows and output rows a work-item holds
NARROW_BYTES = 8 * 1024  # CPU without vectors (lavapipe): most bytes of a work-item's arrays
NEG_INF = float("-inf")


def _lanes(n: Dim, most: int = LANES) -> int:
    """The widest vector (a power of two up to `most`) that divides n; 1 for a symbol."""
    if not isinstance(n, int):
        return 1
    lanes = most
    while n % lanes:
        lanes //= 2
    return lanes


def _head_start(row: K, heads: int, head: K, width: Dim) -> K:
    """Offset of (row, head, 0) in a [rows, heads, width] tensor."""
    return (cast(I64, row) * heads + head) * dim(width)


def _segments(a: K, b: K, new: tuple[K, K] | None, body: Callable[[K, K, bool], None]) -> None:
    """body(j0, j1, fresh) over the runs of keys [a, b): cache rows below the new rows, the
    new rows [p0, p1) (fresh), cache rows past them. Each run is a loop of its own, so the
    inner loops never test where a key lives."""
    if new is None:
        body(a, b, False)
        return
    p0, p1 = new
    body(a, minimum(b, p0), False)
    body(maximum(a, p0), minimum(b, p1), True)
    body(maximum(a, p1), b, False)


class _Rope:
    """The rope op's rotation inside a kernel: its f32 inverse frequencies and the position
    component of each frequency, computed by the op's own helpers and baked in as tables."""

    def __init__(self, kb: KernelSpec, attr: dict, positions: Buffer, pos_value: Value):
        self.n_rot = attr["n_rot"]
        self.half = self.n_rot // 2
        self.pairs = RotaryPairs(self.n_rot, attr.get("pairs", "halves"))
        inv_freq = inv_freq_f32(self.n_rot, attr["theta"], attr.get("freq_factors", ()))
        comps = frequency_components(self.half, tuple(attr.get("sections", ())), attr.get("interleaved", False))
        self.positions = positions
        self.freq = kb.array("inv_freq", F32, self.half, init=[float(f) for f in inv_freq])
        ranked = pos_value.type.rank == 2
        self.comp = kb.array("comp", I32, self.half, init=[int(c) for c in comps]) if ranked else None
        self.width = pos_value.type.shape[1] if ranked else None

    def angle(self, row: K, i: K) -> K:
        """f32(position of `row` for frequency i) * inv_freq[i], the reference's f32 product."""
        position = self.positions[row * dim(self.width) + self.comp[i]] if self.comp is not None \
            else self.positions[row]
        return cast(F32, position) * self.freq[i]



class _Projection:
    """Rows [T, heads, width] of a q or k projection as the layer uses them: the first d of
    each head rmsnorm'd with `norm` (not without one: eps None) and roped at the row's
    position."""

    def __init__(self, buf: Buffer, heads: int, width: Dim, d: Dim, norm: Buffer | None, norm_value: Value | None,
                 eps: float | None, rope: _Rope):
        self.buf, self.heads, self.width, self.d = buf, heads, width, d
        self.norm, self.eps, self.rope = norm, eps, rope
        self.norm_dtype = None if norm_value is None else norm_value.type.dtype

    def start(self, row: K, head: K) -> K:
        return _head_start(row, self.heads, head, self.width)

    def inv_rms(self, kb: KernelSpec, start: K, name: str) -> K | None:
        """1 / sqrt(mean(x²) + eps) of the d values from `start`, as LANES-wide partial sums
        (None without a norm)."""
        if self.eps is None:
            return None
        d = self.d
        lanes = _lanes(d)
        ss = kb.let(f"{name}_ss", cast(F32.vec(lanes), 0.0))
        with kb.loop(f"{name}_e", 0, dim(d), lanes) as e:
            x = kb.let(f"{name}_x", self.buf.load(start + e, lanes=lanes))
            kb.set(ss, call("fma", x, x, ss))
        total = vsum(ss) if lanes > 1 else ss
        n = float(d) if isinstance(d, int) else cast(F32, dim(d))
        return kb.let(f"{name}_r", activations.inverse_rms(KERNEL, total, n, float(self.eps)))

    def normed(self, start: K, r: K | None, e: K) -> K:
        """Element e of the rmsnorm'd row: the rmsnorm op's (x * r) * w (x without a norm)."""
        if r is None:
            return self.buf[start + e]
        return (self.buf[start + e] * r) * weight_at(self.norm_dtype, self.norm, const(0), e, self.d)

    def row(self, kb: KernelSpec, row: K, start: K, r: K, store: Callable[[K, K], None]) -> None:
        """store(e, value) of every element of the normed, roped row (a cos and sin per
        frequency): the CPU schedule's form."""
        rope = self.rope
        with kb.loop("i", 0, rope.half) as i:
            angle = kb.let("angle", rope.angle(row, i))
            c, s = kb.let("cs", call("cos", angle)), kb.let("sn", call("sin", angle))
            first, second = rope.pairs.dims(i)
            lo, hi = kb.let("xlo", self.normed(start, r, first)), kb.let("xhi", self.normed(start, r, second))
            x, y = rotate(lo, hi, c, s)
            store(first, x)
            store(second, y)
        if not (isinstance(self.d, int) and rope.n_rot == self.d):
            with kb.loop("e", rope.n_rot, dim(self.d)) as e:
                store(e, self.normed(start, r, e))

    def element(self, kb: KernelSpec, row: K, start: K, r: K, e: K) -> K:
        """Element e of the normed, roped row on its own (its frequency's cos and sin computed
        for it): the GPU schedule's form, the same value as `row` gives."""
        rope = self.rope
        value = kb.declare("rv", F32)
        with kb.if_(e < rope.n_rot):
            frequency, is_first = rope.pairs.of(e, select)
            i = kb.let("ri", frequency)
            angle = kb.let("angle", rope.angle(row, i))
            c, s = kb.let("cs", call("cos", angle)), kb.let("sn", call("sin", angle))
            first, second = rope.pairs.dims(i)
            lo, hi = kb.let("xlo", self.normed(start, r, first)), kb.let("xhi", self.normed(start, r, second))
            kb.set(value, select(is_first, *rotate(lo, hi, c, s)))
        with kb.else_():
            kb.set(value, self.normed(start, r, e))
        return value


class _Attention:
    """One attention kernel: T query rows of H heads over the first kv_len rows of the
    caches. With `layer` (fused_attention), q comes normalised and roped from the q
    projection, rows [pos, pos + T) of K and V from the k and v projections (written into
    the caches with `persist`), and the output is gated when q holds a gate."""

    def __init__(self, kb: KernelSpec, *, q: Buffer, q_value: Value, k_cache: Buffer, v_cache: Buffer, cache: Value,
                 dv: Dim, kv_len: Buffer, out: Buffer, scale: float, causal: bool, window: int):
        self.kb = kb
        self.T, self.H, self.q_width = q_value.type.shape
        self.C, self.Hkv, self.D = cache.type.shape
        self.DV, self.G = dv, self.H // self.Hkv
        self.q, self.k_cache, self.v_cache, self.kv_len, self.out = q, k_cache, v_cache, kv_len, out
        self.scale, self.causal, self.window = scale, causal, window
        # fused_attention's layer (set by `layer`)
        self.q_proj: _Projection | None = None
        self.k_proj: _Projection | None = None
        self.v: Buffer | None = None
        self.p0: K | None = None
        self.persist = self.gated = self.q8_out = False
        self.fresh = False  # keys [pos, pos + T) made from the k projection (else read from the cache)

    def layer(self, k: Buffer, v: Buffer, q_norm: Buffer | None, k_norm: Buffer | None,
              norm_values: tuple[Value | None, Value | None], positions: Buffer, pos_value: Value, pos: Buffer,
              attr: dict, keys_from_cache: bool = False) -> None:
        """The fused layer around the attention (q and k normed unless eps is None);
        `keys_from_cache`: the new rows are already in the caches (a prefill's first launch
        wrote them), so they are read there, not made."""
        kb = self.kb
        rope = _Rope(kb, attr, positions, pos_value)
        eps = None if attr["eps"] is None else float(attr["eps"])
        self.q_proj = _Projection(self.q, self.H, self.q_width, self.D, q_norm, norm_values[0], eps, rope)
        self.k_proj = _Projection(k, self.Hkv, self.D, self.D, k_norm, norm_values[1], eps, rope)
        self.v = v
        self.p0 = kb.let("p0", pos[0])
        self.fresh = not keys_from_cache
        self.persist = bool(attr.get("persist", True)) and not keys_from_cache
        self.gated = bool(attr.get("gated", False))
        self.q8_out = bool(attr.get("q8_out", False))

    # -- shared pieces ----------------------------------------------------------------------
    @property
    def new_rows(self) -> tuple[K, K] | None:
        """Keys [p0, p0 + T), read from the projections, when the layer makes them."""
        return (self.p0, self.p0 + dim(self.T)) if self.fresh else None

    def write_new_rows(self, gpu: bool) -> None:
        """Rows [pos, pos + T) of K (normed, roped) and V into the caches: a work-group (GPU)
        or work-item (CPU) per (row, kv head)."""
        kb = self.kb
        row, kh = kb.let("row", kb.gid(0)), kb.let("kh", kb.gid(1))
        if gpu:
            self.write_rows(row, kh, kb.lid(0), THREADS)
        else:
            self.write_rows(row, kh)
        kb.launch([dim(self.T), self.Hkv])

    def visible(self, n: K, row: K) -> tuple[K, K]:
        """Keys [lo, hi) that query `row` sees (visible_range), the T queries being the last
        rows of the first n cache rows."""
        return visible_range(KERNEL, n, n - dim(self.T) + row, self.causal, self.window)

    def write_rows(self, row: K, kh: K, lid: K | None = None, threads: int = 1) -> None:
        """Row `row`'s K (normed, roped) and V into cache row pos + row of kv head kh (the
        rows past the capacity dropped; the host check reports the overflow first). With
        `lid`, the work-group's threads share the elements."""
        kb, k = self.kb, self.k_proj
        at = kb.let("wat", self.p0 + row)
        with kb.if_((self.p0 >= 0) & (at < dim(self.C))):
            src = kb.let("wsrc", k.start(row, kh))
            r = k.inv_rms(kb, src, "wk")
            dst = kb.let("wdst", _head_start(at, self.Hkv, kh, self.D))
            if lid is None:
                k.row(kb, row, src, r, lambda e, x: self.k_cache.store(dst + e, x))
            else:
                with kb.loop("e", lid, dim(self.D), threads) as e:
                    self.k_cache[dst + e] = k.element(kb, row, src, r, e)
            vsrc, vdst = _head_start(row, self.Hkv, kh, self.DV), _head_start(at, self.Hkv, kh, self.DV)
            with kb.loop("c", lid if lid is not None else 0, dim(self.DV), threads) as c:
                self.v_cache[vdst + c] = self.v[vsrc + c]

    def output(self, row: K, h: K, c: K, value: K) -> K:
        """Output element (row, h, c): the attention value, times sigmoid(gate) when gated."""
        if not self.gated:
            return value
        gate = self.q[_head_start(row, self.H, h, self.q_width) + dim(self.D) + c]
        return activations.sigmoid_gate(KERNEL, value, gate)

    def store_out(self, row: K, h: K, c: K, value: K) -> None:
        self.out[_head_start(row, self.H, h, self.DV) + c] = self.output(row, h, c, value)

    def store_q8_head(self, row: K, h: K, first: K, step: int, at: Callable[[K], K]) -> None:
        """Output row (row, h) as Q8_0 blocks (`q8_out`) from its values at(c), blocks first,
        first + step, ... of the head's (a work-item takes every step-th)."""
        per_head = self.DV // Q8_VALUES
        store_q8_blocks(self.kb, self.out, (cast(I64, row) * self.H + h) * per_head, per_head, at, first, step)

    # -- GPU: a work-group per (row, head) ---------------------------------------------------
    def gpu(self) -> None:
        kb, L = self.kb, THREADS
        d, dv = self.D, self.DV
        per = -(-dv // L)
        row, h, lid = kb.let("row", kb.gid(0)), kb.let("h", kb.gid(1)), kb.let("lid", kb.lid(0))
        kh = kb.let("kh", h / self.G)
        n = kb.let("n", minimum(self.kv_len[0], dim(self.C)))
        lo, hi = (kb.let(name, x) for name, x in zip(("lo", "hi"), self.visible(n, row)))
        qs = kb.array("qs", F32, d, "local")
        p = kb.array("p", F32, L, "local")
        red = kb.array("red", F32, L, "local")
        if self.q_proj is None:
            qstart = kb.let("qstart", _head_start(row, self.H, h, d))
            with kb.loop("e", lid, dim(d), L) as e:
                qs[e] = self.q[qstart + e]
        else:
            qstart = kb.let("qstart", self.q_proj.start(row, h))
            r = self.q_proj.inv_rms(kb, qstart, "q")
            with kb.loop("e", lid, dim(d), L) as e:
                qs[e] = self.q_proj.element(kb, row, qstart, r, e)
            if self.persist:
                # one work-item writes the row: with the work-group's lanes sharing it, PoCL 3.1's
                # optimiser ran the store loop in idle lanes too (heads narrower than the group),
                # writing into the next head's rows (test_fused_attention, D=32)
                with kb.if_(h.eq(kh * self.G) & lid.eq(0)):
                    self.write_rows(row, kh)
        m, l = kb.let("m", NEG_INF), kb.let("l", 0.0)
        acc = kb.array("acc", F32, per)
        with kb.loop("e", 0, per) as e:
            acc[e] = 0.0
        with kb.loop("base", lo, hi, L) as base:
            j = kb.let("j", base + lid)
            s = kb.let("s", NEG_INF)
            kb.barrier()
            with kb.if_(j < hi):
                self._gpu_score(j, kh, qs, s)
            red[lid] = s
            kb.wg_reduce(red, L, "max")
            mt = kb.let("mt", maximum(m, red[0]))
            pj = kb.let("pj", select(j < hi, call("exp", s - mt), 0.0))
            kb.barrier()
            p[lid] = pj
            red[lid] = pj
            kb.wg_reduce(red, L, "sum")
            alpha = kb.let("alpha", call("exp", m - mt))
            kb.set(l, l * alpha + red[0])
            kb.set(m, mt)
            count = kb.let("count", minimum(L, hi - base))
            with kb.loop("e", 0, per) as e:
                c = kb.let("c", lid + e * L)
                acc_e = kb.let("a", acc[e] * alpha)
                with kb.if_(c < dim(dv)):
                    def add(j0: K, j1: K, fresh: bool) -> None:
                        with kb.loop("r", j0, j1) as r:
                            src = self.v if fresh else self.v_cache
                            vrow = _head_start(r - self.p0 if fresh else r, self.Hkv, kh, dv)
                            kb.set(acc_e, acc_e + p[r - base] * src[vrow + c])
                    _segments(base, base + count, self.new_rows, add)
                acc[e] = acc_e
        if not self.q8_out:
            with kb.loop("e", 0, per) as e:
                c = kb.let("c", lid + e * L)
                with kb.if_(c < dim(dv)):
                    self.store_out(row, h, c, acc[e] / l)
            return
        ys = kb.array("ys", F32, dv, "local")  # the head's row, for the threads that quantise its blocks
        with kb.loop("e", 0, per) as e:
            c = kb.let("c", lid + e * L)
            with kb.if_(c < dim(dv)):
                ys[c] = self.output(row, h, c, acc[e] / l)
        kb.barrier()
        self.store_q8_head(row, h, lid, L, ys.__getitem__)

    def _gpu_score(self, j: K, kh: K, qs: Array, s: K) -> None:
        """s = q . key j * scale, the key from the cache or, for a new row, normed and roped here."""
        kb, d = self.kb, self.D

        def from_cache() -> None:
            kr = kb.let("kr", _head_start(j, self.Hkv, kh, d))
            qk = kb.let("qk", 0.0)
            with kb.loop("e", 0, dim(d)) as e:
                kb.set(qk, qk + qs[e] * self.k_cache[kr + e])
            kb.set(s, qk * self.scale)

        if self.new_rows is None:
            from_cache()
            return
        p0, p1 = self.new_rows
        with kb.if_((j >= p0) & (j < p1)):
            t = kb.let("t", j - p0)
            kr = kb.let("kr", self.k_proj.start(t, kh))
            r = self.k_proj.inv_rms(kb, kr, "k")
            qk = kb.let("qk", 0.0)
            with kb.loop("e", 0, dim(d)) as e:
                kb.set(qk, qk + qs[e] * self.k_proj.element(kb, t, kr, r, e))
            kb.set(s, qk * self.scale)
        with kb.else_():
            from_cache()

    # -- CPU: a work-item per (kv head, tile of rows) ---------------------------------------
    def cpu(self, tile: "_CpuTile") -> None:
        kb, KC, tile_rows, wide = self.kb, tile.chunk, tile.rows, tile.wide
        self.kc = KC
        d, dv, G = self.D, self.DV, self.G
        D, DV = dim(d), dim(dv)
        NQ = tile_rows * G
        QB = next(b for b in (Q_BLOCK, 4, 2, 1) if NQ % b == 0) if wide else 1
        self.lk, self.lv = (_lanes(d), _lanes(dv)) if wide else (1, 1)
        self.k_block, self.exp_lanes = (K_BLOCK, min(LANES, KC)) if wide else (1, 1)
        LK = self.lk
        PQ = next(b for b in (4, 2, 1) if G % b == 0) if wide else 1  # queries (heads of a row) adding values together
        r0, kh = kb.let("r0", kb.gid(0) * tile_rows), kb.let("kh", kb.gid(1))
        nrows = kb.let("nrows", minimum(tile_rows, dim(self.T) - r0))
        nq = kb.let("nq", nrows * G)
        n = kb.let("n", minimum(self.kv_len[0], dim(self.C)))
        qs, acc = kb.array("qs", F32, NQ * d), kb.array("acc", F32, NQ * dv)
        m, l, sc = kb.array("m", F32, NQ), kb.array("l", F32, NQ), kb.array("sc", F32, NQ * KC)
        alphas = kb.array("alphas", F32, G)
        self.lanes = kb.array("lanes", F32, LANES) if wide else None  # a vector's lanes, for its max
        keys = kb.array("keys", F32, KC * d) if self.new_rows else None  # the chunk's new rows, normed and roped
        self._cpu_prologue(r0, kh, nrows, qs)
        nq_pad = kb.let("nq_pad", (nq + (QB - 1)) / QB * QB)
        with kb.loop("e", nq * D, nq_pad * D) as e:  # queries padding the last block score zeros
            qs[e] = 0.0
        with kb.loop("qi", 0, NQ) as qi:
            m[qi], l[qi] = NEG_INF, 0.0
            with kb.loop("c", 0, DV) as c:
                acc[qi * DV + c] = 0.0
            with kb.loop("c", 0, KC) as c:
                sc[qi * KC + c] = 0.0
        lo_t = kb.let("lo_t", self.visible(n, r0)[0])
        hi_t = kb.let("hi_t", self.visible(n, r0 + nrows - 1)[1])
        with kb.loop("base", lo_t / KC * KC, hi_t, KC) as base:  # chunks at multiples of KC
            a, b = kb.let("a", maximum(base, lo_t)), kb.let("b", minimum(base + KC, hi_t))
            if self.new_rows:
                self._cpu_new_keys(kh, base, a, b, keys)
            # scores of every (query, key) pair of the tile and the chunk, QB x KB at a time
            with kb.loop("q0", 0, nq_pad, QB) as q0:
                _segments(a, b, self.new_rows,
                          lambda j0, j1, fresh: self._cpu_scores(kh, base, q0, QB, j0, j1, fresh, qs, sc, keys, LK))
            # each row's visible keys of the chunk into its G queries' softmax and output rows
            with kb.loop("rr", 0, nrows) as rr:
                qlo, qhi = self.visible(n, r0 + rr)
                qa, qb = kb.let("qa", maximum(a, qlo)), kb.let("qb", minimum(b, qhi))
                with kb.if_(qa < qb):
                    with kb.loop("g", 0, G) as g:
                        self._cpu_softmax(kb.let("qi", rr * G + g), qa - base, qb - base, m, l, sc, alphas, g)
                    with kb.loop("g0", 0, G, PQ) as g0:
                        self._cpu_values(kh, base, rr * G + g0, qa, qb, acc, sc, [alphas[g0 + i] for i in range(PQ)])
        with kb.loop("qi", 0, nq) as qi:
            row, h = kb.let("row", r0 + qi / G), kb.let("h", kh * G + qi % G)
            lq = kb.let("lq", l[qi])
            with kb.loop("c", 0, DV) as c:
                if self.q8_out:
                    acc[qi * DV + c] = self.output(row, h, c, acc[qi * DV + c] / lq)
                else:
                    self.store_out(row, h, c, acc[qi * DV + c] / lq)
            if self.q8_out:
                self.store_q8_head(row, h, const(0), 1, lambda c: acc[qi * DV + c])

    def _key(self, kh: K, base: K, j: K, fresh: bool, keys: Array | None, lanes: int, name: str) -> Callable[[K], K]:
        """Elements e .. e + lanes - 1 of key j: a new row (normed and roped into the chunk's
        `keys`) or a cache row."""
        kb = self.kb
        if not fresh:
            kr = kb.let(name, _head_start(j, self.Hkv, kh, self.D))
            return lambda e: self.k_cache.load(kr + e, lanes=lanes)
        kr = kb.let(name, (j - base) * dim(self.D))
        return lambda e: keys.vec(kr + e, lanes)

    def _value(self, kh: K, j: K, c0: K, fresh: bool, lanes: int) -> Callable[[int], K]:
        """Elements c0 + o .. of value row j: from the v projection (a new row) or the cache."""
        src, row = (self.v, j - self.p0) if fresh else (self.v_cache, j)
        vr = self.kb.let("vr", _head_start(row, self.Hkv, kh, self.DV) + c0)
        return lambda o: src.load(vr + o, lanes=lanes)

    def _cpu_scores(self, kh: K, base: K, q0: K, QB: int, j0: K, j1: K, fresh: bool, qs: Array, sc: Array,
                    keys: Array | None, LK: int) -> None:
        """Scores of queries q0 .. q0 + QB - 1 with keys [j0, j1), K_BLOCK keys at a time (the
        last block repeats key j1 - 1): each a LANES-wide partial sum over the head dim, its
        lanes summed pairwise, times the scale."""
        kb, KC, D = self.kb, self.kc, dim(self.D)
        KB = self.k_block
        with kb.loop("j", j0, j1, KB) as j:
            ks = [kb.let(f"key{u}", minimum(j + u, j1 - 1)) if u else j for u in range(KB)]
            key = [self._key(kh, base, ks[u], fresh, keys, LK, f"kr{u}") for u in range(KB)]
            parts = {(i, u): kb.let(f"part{i}_{u}", cast(F32.vec(LK), 0.0)) for i in range(QB) for u in range(KB)}
            with kb.loop("e0", 0, D, LK) as e0:
                kv = [kb.let(f"kv{u}", key[u](e0)) for u in range(KB)]
                for i in range(QB):
                    qv = kb.let(f"qv{i}", qs.vec((q0 + i) * D + e0, LK))
                    for u in range(KB):
                        kb.set(parts[i, u], call("fma", qv, kv[u], parts[i, u]))
            for (i, u), part in parts.items():
                sc[(q0 + i) * KC + ks[u] - base] = (vsum(part) if LK > 1 else part) * self.scale

    def _cpu_softmax(self, qi: K, sa: K, sb: K, m: Array, l: Array, sc: Array, alphas: Array, g: K) -> None:
        """Query qi's online softmax over chunk slots [sa, sb): its running max and sum
        rescaled, the slots' scores turned into weights; its output row's rescale in alphas[g].
        Wide: the slots outside [sa, sb) are set to -inf, so the chunk's max is a vector max
        and its sum a fixed tree over every slot (the others weigh exactly 0): the same for a
        query whatever other keys its tile has. Narrow: loops over [sa, sb)."""
        kb, KC, W = self.kb, self.kc, self.exp_lanes
        srow = kb.let("srow", qi * KC)
        mq = kb.let("mq", m[qi])
        if W == 1:
            mt = kb.let("mt", mq)
            with kb.loop("s", sa, sb) as s:
                kb.set(mt, maximum(mt, sc[srow + s]))
            with kb.loop("s", sa, sb) as s:
                sc[srow + s] = call("exp", sc[srow + s] - mt)
            alpha = kb.let("alpha", call("exp", mq - mt))
            lq = kb.let("lq", l[qi] * alpha)
            with kb.loop("s", sa, sb) as s:
                kb.set(lq, lq + sc[srow + s])
            l[qi], m[qi], alphas[g] = lq, mt, alpha
            return
        for lo, hi in ((0, sa), (sb, KC)):
            with kb.loop("s", lo, hi) as s:
                sc[srow + s] = NEG_INF
        lanes = self.lanes
        top = sc.vec(srow, W)
        for v0 in range(W, KC, W):
            top = maximum(top, sc.vec(srow + v0, W))
        kb.set(lanes.vec(0, W), top)
        width = W
        while width > 1:  # the max of the lanes, halves first
            width //= 2
            kb.set(lanes.vec(0, width), maximum(lanes.vec(0, width), lanes.vec(width, width)))
        mt = kb.let("mt", maximum(mq, lanes[0]))
        weights = [kb.let(f"w{v0}", call("exp", sc.vec(srow + v0, W) - mt)) for v0 in range(0, KC, W)]
        for v0, w in zip(range(0, KC, W), weights):
            kb.set(sc.vec(srow + v0, W), w)
        while len(weights) > 1:  # the sum of the slots: vectors pairwise, then their lanes
            half = len(weights) // 2
            weights = [weights[k] + weights[k + half] for k in range(half)]
        alpha = kb.let("alpha", call("exp", mq - mt))
        l[qi], m[qi], alphas[g] = l[qi] * alpha + vsum(weights[0]), mt, alpha

    def _cpu_values(self, kh: K, base: K, q0: K, qa: K, qb: K, acc: Array, sc: Array, alphas: list[K]) -> None:
        """Output rows of queries q0 .. q0 + len(alphas) - 1 (heads of one row: the same keys)
        rescaled, plus the weighted value rows of keys [qa, qb): PV vectors of each at a time,
        one load of a value vector feeding every query."""
        kb, KC, dv = self.kb, self.kc, self.DV
        LV, DV = self.lv, dim(dv)
        PQ = len(alphas)
        PV = next(b for b in range(V_BLOCK // PQ, 0, -1) if (dv // LV) % b == 0) if isinstance(dv, int) else 1
        with kb.loop("c0", 0, DV, LV * PV) as c0:
            rows = [kb.let(f"arow{i}", (q0 + i) * DV + c0) for i in range(PQ)]
            accs = {(i, u): kb.let(f"av{i}_{u}", acc.vec(rows[i] + u * LV, LV) * alphas[i])
                    for i in range(PQ) for u in range(PV)}

            def add(j0: K, j1: K, fresh: bool) -> None:
                with kb.loop("j", j0, j1) as j:
                    value = self._value(kh, j, c0, fresh, LV)
                    ps = [kb.let(f"p{i}", sc[(q0 + i) * KC + j - base]) for i in range(PQ)]
                    for u in range(PV):
                        vv = kb.let(f"vv{u}", value(u * LV))
                        for i in range(PQ):
                            kb.set(accs[i, u], call("fma", ps[i], vv, accs[i, u]))
            _segments(qa, qb, self.new_rows, add)
            for (i, u), av in accs.items():
                kb.set(acc.vec(rows[i] + u * LV, LV), av)

    def _cpu_new_keys(self, kh: K, base: K, a: K, b: K, keys: Array) -> None:
        """The new rows among keys [a, b), normed and roped from the k projection into slots
        j - base of `keys` (each chunk's own: the tile reads them once per query block)."""
        kb, p0, p1 = self.kb, *self.new_rows
        with kb.loop("j", maximum(a, p0), minimum(b, p1)) as j:
            t = kb.let("t", j - p0)
            kr = kb.let("kr", self.k_proj.start(t, kh))
            r = self.k_proj.inv_rms(kb, kr, "k")
            slot = kb.let("slot", (j - base) * dim(self.D))
            self.k_proj.row(kb, t, kr, r, lambda e, x: keys.__setitem__(slot + e, x))

    def _cpu_prologue(self, r0: K, kh: K, nrows: K, qs: Array) -> None:
        """The tile's q rows into qs (normed and roped when fused), and with `persist` the
        tile's own rows of K and V written into the caches."""
        kb, d, G = self.kb, self.D, self.G
        with kb.loop("rr", 0, nrows) as rr:
            row = kb.let("row", r0 + rr)
            with kb.loop("g", 0, G) as g:
                h, qrow = kb.let("h", kh * G + g), kb.let("qrow", (rr * G + g) * dim(d))
                if self.q_proj is None:
                    qstart = kb.let("qstart", _head_start(row, self.H, h, d))
                    with kb.loop("e", 0, dim(d)) as e:
                        qs[qrow + e] = self.q[qstart + e]
                else:
                    qstart = kb.let("qstart", self.q_proj.start(row, h))
                    r = self.q_proj.inv_rms(kb, qstart, "q")
                    self.q_proj.row(kb, row, qstart, r, lambda e, x: qs.__setitem__(qrow + e, x))
            if self.persist:
                self.write_rows(row, kh)


@dataclass(frozen=True)
class _CpuTile:
    """A CPU work-item's share: `rows` query rows (times the G heads of its kv head), keys
    taken `chunk` at a time. `wide`: register blocks of vectors (PoCL); else one scalar at a
    time and small arrays (lavapipe, whose shader compiler takes minutes on unrolled lanes
    and on large private arrays: it turns each dynamic index of one into a ladder of branches)."""

    rows: int
    chunk: int
    wide: bool


def _cpu_tile(kernel: _Attention, wide: bool) -> _CpuTile:
    """A verify block of rows where their q and output rows fit TILE_BYTES (wide), or the
    largest tile whose arrays fit NARROW_BYTES (narrow); never more rows than there are."""
    t, g = kernel.T, kernel.G
    d, dv = (x if isinstance(x, int) else 256 for x in (kernel.D, kernel.DV))
    fit = (lambda rows: min(rows, t)) if isinstance(t, int) else (lambda rows: rows)
    if wide:
        return _CpuTile(fit(max(1, min(TILE_ROWS, TILE_BYTES // (4 * g * (d + dv))))), KEY_CHUNK, True)
    def floats(rows: int, chunk: int) -> int:
        return rows * g * (d + dv + chunk + 2) + g + (chunk * d if kernel.new_rows else 0)
    # the chunk decides the arithmetic: the same for every row count (a decode and a verify)
    chunk = 16 if 4 * floats(1, 16) <= NARROW_BYTES else 8
    rows = next((r for r in (TILE_ROWS, 8, 4, 2) if 4 * floats(fit(r), chunk) <= NARROW_BYTES), 1)
    return _CpuTile(fit(rows), chunk, False)


def _launch(ctx: NodeCtx, kernel: _Attention) -> None:
    kb = kernel.kb
    if ctx.profile == "cpu":
        tile = _cpu_tile(kernel, wide=ctx.row_streams > 1)
        kernel.cpu(tile)
        kb.launch([cdiv(dim(kernel.T), tile.rows), kernel.Hkv])
    else:
        kernel.gpu()
        kb.launch([dim(kernel.T), kernel.H])


def _check_attention(ctx: NodeCtx, kv_len: Value, cap: Dim, rows: Dim, causal: bool, window: int) -> None:
    ctx.check("attention", kv_len, size=dim(cap), rows=dim(rows), flags=("ordered",) if causal or window else ())


def _kernel(ctx: NodeCtx, op: str) -> KernelSpec:
    cpu = ctx.profile == "cpu"
    return ctx.kernel(f"{op}_rows" if cpu else op, local=(1,) if cpu else (THREADS,))


@lowers("attention")
def attention(ctx: NodeCtx) -> None:
    q, k, v, kv_len = ctx.ins
    a = ctx.attr
    causal, window = a.get("causal", True), a.get("window", 0)
    _check_attention(ctx, kv_len, k.type.shape[0], q.type.shape[0], causal, window)
    kb = _kernel(ctx, "attention")
    bufs = [kb.bind(name, x) for name, x in zip(("q", "k", "v", "kv_len"), (q, k, v, kv_len))]
    out = kb.bind("out", ctx.outs[0], writes=True)
    _launch(ctx, _Attention(kb, q=bufs[0], q_value=q, k_cache=bufs[1], v_cache=bufs[2], cache=k,
                            dv=v.type.shape[2], kv_len=bufs[3], out=out, scale=a["scale"], causal=causal,
                            window=window))


def _copy(ctx: NodeCtx, src: Value, dst: Value) -> None:
    """dst = src, element by element (a cache that another node still reads in its old form)."""
    kb = ctx.kernel("copy", local=(FLAT,))
    x, out = kb.bind("x0", src), kb.bind("out", dst, writes=True)
    total = prod(src.type.shape)
    i = flat_index(kb, total)
    write(dst, out, i, read(src, x, i))
    kb.launch([cdiv(total, FLAT)])


def _writable(ctx: NodeCtx, cache: Value, out: Value) -> None:
    """`out` (the cache after this node's writes) in the cache's own buffer when nothing
    else reads the old cache (the usual case), else in a copy of it."""
    if ctx.can_overwrite(cache):
        ctx.alias(out, cache)
    else:
        _copy(ctx, cache, out)


@lowers("kv_write")
def kv_write(ctx: NodeCtx) -> None:
    """Rows [pos, pos + T) of the cache replaced by `new`, written in place when nothing else
    reads the old cache, else into a copy. Rows past the capacity are dropped on the device;
    the host check reports the overflow first."""
    cache, new, pos = ctx.ins
    out = ctx.outs[0]
    capacity, row = dim(cache.type.shape[0]), prod(cache.type.shape[1:])
    ctx.check("kv_write", pos, size=capacity, rows=dim(new.type.shape[0]))
    _writable(ctx, cache, out)
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
    """The layer as one kernel (see the module docstring); with `persist` the caches are
    written in place (after a copy when another node still reads the old cache). A prefill
    (`variant`) is two: its new K and V rows into the caches first, so that a query does not
    norm and rope every earlier new key again (O(T²) for T rows), then the attention over
    the caches alone."""
    a = ctx.attr
    x = attention_inputs(ctx.ins, a["eps"])
    q, v, positions, pos, kv_len, k_cache, v_cache = (x[n] for n in ("q", "v", "positions", "pos", "kv_len",
                                                                    "k_cache", "v_cache"))
    rows, cap = q.type.shape[0], k_cache.type.shape[0]
    causal, window = a.get("causal", True), a.get("window", 0)
    ctx.check("kv_write", pos, size=dim(cap), rows=dim(rows))
    _check_attention(ctx, kv_len, cap, rows, causal, window)
    persist = a.get("persist", True)
    split = persist and a["variant"] == "prefill"
    caches = (k_cache, v_cache)
    if persist:
        caches = tuple(ctx.outs[1:])
        for cache, out in zip((k_cache, v_cache), caches):
            _writable(ctx, cache, out)

    def layer_kernel(op: str, writes_rows: bool) -> _Attention:
        """The layer's kernel `op`: writing the new rows (the prefill's first launch), or the
        attention with its q side (and with the new rows, unless they are already written)."""
        kb = _kernel(ctx, op)
        used = ("k", "v", "k_norm", "positions", "pos") if writes_rows else x.keys() - {"k_cache", "v_cache"}
        b = {name: kb.bind(name, value) for name, value in x.items() if name in used}
        k_buf, v_buf = (kb.bind(name, c, writes=persist and (writes_rows or not split))
                        for name, c in zip(("k_cache", "v_cache"), caches))
        out = None if writes_rows else kb.bind("out", ctx.outs[0], writes=True)
        kernel = _Attention(kb, q=b.get("q"), q_value=q, k_cache=k_buf, v_cache=v_buf, cache=k_cache,
                            dv=v.type.shape[2], kv_len=b.get("kv_len"), out=out, scale=a["scale"], causal=causal,
                            window=window)
        kernel.layer(b["k"], b["v"], b.get("q_norm"), b.get("k_norm"), (x.get("q_norm"), x.get("k_norm")),
                     b["positions"], positions, b["pos"], a, keys_from_cache=split and not writes_rows)
        return kernel

    if split:
        layer_kernel("new_kv", writes_rows=True).write_new_rows(gpu=ctx.profile == "gpu")
    _launch(ctx, layer_kernel("fused_attention", writes_rows=False))

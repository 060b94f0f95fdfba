"""Weight-consuming ops: dequantize, embedding, matmul (GEMV and tiled GEMM), expert_matmul.

Weights are read in their storage type (f32, f16, bf16 or Q8_0 blocks of fp16 d + 32 int8,
34 bytes, so only 2-byte aligned: scales and pairs of quants are read as u16). The GEMV and
the CPU rowwise schedule take a Q8_0 block's scale out of its dot product (d * sum(q * x):
a third fewer multiplies where the weight read should be the only cost); elsewhere values
are the reference's d * q exactly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from dflash_ir.dtypes import DType
from dflash_ir.ir import Value
from dflash_ir.types import Dim

from ..kir import F32, I32, I64, K, call, cast, const, dot4_i8, maximum, minimum, select, vsum
from ..kir.build import Buffer
from ..lowering import KernelSpec, NodeCtx, dim, lowers
from .access import Q8_BLOCK, q8_0_split_at, q8_row_bytes, weight_at
from .shapes import cdiv, flat_launch, prod

GEMV_ROWS = 16    # rows a GEMV work-group serves (as passes/specialise_q8_0); more take the tiled GEMM
GEMV_THREADS = 256
TILE = 32         # GEMM output tile (TILE x TILE) and K step
THREADS = 16      # GEMM work-group is THREADS x THREADS, each thread 2x2 outputs
ROWWISE_COLS = 128  # CPU schedule: output columns per work-group ...
ROWWISE_ROWS = 8  # ... and rows per work-item
SCALE_RUN = 16  # split Q8_0: scales converted per run of this many blocks (one 16-wide load)

# store(row, n, value): the statement writing output column n of row `row`
Store = Callable[[K, K, K], None]


def sext8(x: K) -> K:
    """The low byte of int x, sign-extended."""
    return (x << 24) >> 24


@lowers("dequantize")
def dequantize(ctx: NodeCtx) -> None:
    w = ctx.ins[0]
    k = w.type.shape[-1]

    def compute(kb, i, xs, out):
        out[i] = weight_at(w.type.dtype, xs[0], i / dim(k), i % dim(k), k)
    flat_launch(ctx, compute)


@lowers("embedding")
def embedding(ctx: NodeCtx) -> None:
    """On the CPU profile a Q8_0 table is read in the split layout, the one the (tied)
    output head's matmul reads it in, so the table is on the device once."""
    table, ids = ctx.ins
    k = table.type.shape[1]
    ctx.check("index", ids, size=dim(table.type.shape[0]))
    split = ctx.profile == "cpu" and table.type.dtype is DType.Q8_0
    packed, blocks = _split_q8_0(ctx, [table]) if split else (table, 0)

    def compute(kb, i, xs, out):
        row, col = xs[1][i / dim(k)], i % dim(k)
        out[i] = (q8_0_split_at(xs[0], row, col, k, blocks) if split
                  else weight_at(table.type.dtype, xs[0], row, col, k))
    flat_launch(ctx, compute, inputs=[packed, ids])


def _split_q8_0(ctx: NodeCtx, weights: list) -> tuple:
    """(the Q8_0 weights' rows packed in the split layout, how many blocks the pack holds)."""
    packed = ctx.packed(weights, "q8_0_split")
    return packed, math.prod(packed.type.shape) // 32


@dataclass(frozen=True)
class Gemv:
    """GEMV geometry: `lanes` threads share one output column's K chunks (a Q8_0 block, else
    one element, which keeps reads coalesced); a work-group holds `cols` columns side by
    side, so a 250k-row vocabulary matrix is not 250k tiny work-groups."""

    dtype: DType
    k: Dim

    @property
    def chunk(self) -> int:
        return 32 if self.dtype is DType.Q8_0 else 1

    @property
    def lanes(self) -> int:
        """Up to a warp per column, but at least ~8 chunks per lane: with a short K the tree
        reduction would cost more than the dot product."""
        if not isinstance(self.k, int):
            return 32
        return 1 << max(0, min(5, (self.k // self.chunk // 8).bit_length() - 1))

    @property
    def cols(self) -> int:
        return GEMV_THREADS // self.lanes


def _quantise_x_block(kb: KernelSpec, x: Buffer, xr: K) -> tuple[K, list[K]]:
    """quantize_row_q8_0 of the 32 x values at xr: (the f16-rounded scale, 8 words of 4 int8)."""
    amax = kb.let("amax", 0.0)
    with kb.loop("e", 0, 32) as e:
        kb.set(amax, maximum(amax, call("fabs", x[xr + e])))
    dx = kb.let("dx", amax / 127.0)
    inv = kb.let("inv", select(dx.ne(0.0), 1.0 / dx, 0.0))
    words = kb.array("xq", I32, 8)
    with kb.loop("e", 0, 8) as e:
        word = kb.let("word", 0)
        with kb.loop("b", 0, 4) as b:
            kb.set(word, word | ((cast(I32, call("round", x[xr + 4 * e + b] * inv)) & 0xff) << (8 * b)))
        words[e] = word
    return call("round_f16", dx), words


def _gemv(kb: KernelSpec, g: Gemv, rows: int, count: K, n_total: K, n: K, r0: K, w: Buffer, wrow: K,
          x: Buffer, xrow: Callable[[K], K], store: Store, act_quant: bool = False) -> None:
    """Column n, rows r0 .. r0+rows-1 (< count): each lane accumulates its chunks for every
    row, then a tree reduction over the column's lanes. `wrow` is the weight row of column
    n, `xrow(row)` the offset of x's row in x. With act_quant each x block is quantised to
    int8 as quantize_row_q8_0 does and the block dot is an exact integer sum of dot4s."""
    L = g.lanes
    lane, col = kb.lid(0), kb.lid(1)
    red = kb.array("red", F32, rows * GEMV_THREADS, "local")
    acc = kb.array("acc", F32, rows)
    with kb.loop("r", 0, rows) as r:
        acc[r] = 0.0
    q8 = g.dtype is DType.Q8_0
    chunks = dim(g.k) / 32 if q8 else dim(g.k)
    with kb.loop("c", lane, chunks, L, cond=n < n_total) as c:
        if q8:
            blk = kb.let("blk", cast(I64, wrow) * q8_row_bytes(g.k) + c * Q8_BLOCK)
            d = kb.let("d", w.load(blk / 2, "f16"))
            if act_quant:
                wq = kb.array("wq", I32, 8)
                with kb.loop("e", 0, 8) as e:
                    wq[e] = w.load(blk / 2 + 1 + 2 * e, "u16") | (w.load(blk / 2 + 2 + 2 * e, "u16") << 16)
            else:
                wv = kb.array("wv", F32, 32)
                with kb.loop("e", 0, 16) as e:
                    two = kb.let("two", w.load(blk / 2 + 1 + e, "u16"))
                    wv[2 * e] = cast(F32, sext8(two))
                    wv[2 * e + 1] = cast(F32, sext8(two >> 8))
        else:
            wv = kb.array("wv", F32, 1)
            wv[0] = weight_at(g.dtype, w, wrow, c, g.k)
        with kb.loop("r", 0, rows, cond=lambda r: r0 + r < count) as r:
            row = kb.let("row", r0 + r)
            xr = kb.let("xr", xrow(row) + c * g.chunk)
            if act_quant:
                dx, xq = _quantise_x_block(kb, x, xr)
                isum = kb.let("isum", 0)
                with kb.loop("e", 0, 8) as e:
                    kb.set(isum, dot4_i8(xq[e], wq[e], isum))
                acc[r] = acc[r] + cast(F32, isum) * dx * d
            else:
                s = kb.let("s", 0.0)
                with kb.loop("e", 0, g.chunk) as e:
                    kb.set(s, s + wv[e] * x[xr + e])
                acc[r] = acc[r] + (d * s if q8 else s)

    def slot(r):
        return (r * g.cols + col) * L + lane
    with kb.loop("r", 0, rows) as r:
        red[slot(r)] = acc[r]
    kb.barrier()
    with kb.loop("s", L // 2, cond=lambda s: s > 0, next=lambda s: s >> 1) as s:
        with kb.if_(lane < s):
            with kb.loop("r", 0, rows) as r:
                red[slot(r)] = red[slot(r)] + red[slot(r) + s]
        kb.barrier()
    with kb.loop("r", lane, rows, L) as r:
        row = kb.let("row", r0 + r)
        with kb.if_((row < count) & (n < n_total)):
            store(row, n, red[(r * g.cols + col) * L])




def _store(outs: list[Buffer], widths: list[int], res: Buffer | None) -> Store:
    """Output column n (of all outputs side by side) of row `row`: one output (plus the
    residual), or the output whose columns n falls in."""
    def store(row: K, n: K, value: K) -> None:
        if len(outs) == 1:
            at = cast(I64, row) * dim(widths[0]) + n
            outs[0][at] = value + res[at] if res is not None else value
            return
        _store_chain(outs, widths, row, n, value, 0)
    return store


def _store_chain(outs, widths, row, n, value, start: int) -> None:
    out, width = outs[0], widths[0]
    target = cast(I64, row) * width + n - start
    if len(outs) == 1:
        out[target] = value
        return
    kb = out.kb
    with kb.if_(n < start + width):
        out[target] = value
    with kb.else_():
        _store_chain(outs[1:], widths[1:], row, n, value, start + width)


def matmul_launch(ctx: NodeCtx, *, act_quant: bool = False) -> None:
    """x @ wᵀ [+ residual] for node inputs (x, w[, residual])."""
    x, w, *res = ctx.ins
    _matmul(ctx, x, [w], [ctx.outs[0]], res, act_quant)


def _matmul(ctx: NodeCtx, x_value: Value, weights: list, outs: list, res: list, act_quant: bool) -> None:
    """x @ wᵀ over the rows of `weights` side by side (one weight, or a matmul_group's),
    output i getting weight i's columns. GPU profile: a GEMV for up to GEMV_ROWS rows, else
    a tiled GEMM; with a symbolic row count both are planned and the launch picks one per
    call (a prefill's single logits row is a GEMV, its 512 hidden rows a GEMM). CPU profile:
    the rowwise schedule for every row count, Q8_0 weights packed in the split layout."""
    dtype, k = weights[0].type.dtype, weights[0].type.shape[1]
    widths = [o.type.shape[-1] for o in outs]
    n = sum(widths)
    M, N = prod(x_value.type.shape[:-1]), const(n)
    rowwise = ctx.profile == "cpu" and not act_quant
    blocks = 0
    if rowwise and dtype is DType.Q8_0:
        w_value, blocks = _split_q8_0(ctx, weights)
    else:
        w_value = weights[0] if len(weights) == 1 else ctx.packed(weights, "as_stored")
    fixed = M.arg if M.op == "const" else None

    def kernel(op: str, local) -> tuple[KernelSpec, Buffer, Buffer, Store]:
        kb = ctx.kernel(op, local=local)
        x, w = kb.bind("x", x_value), kb.bind("w", w_value)
        r = kb.bind("residual", res[0]) if res else None
        names = ["out"] if len(outs) == 1 else [f"out{i}" for i in range(len(outs))]
        bufs = [kb.bind(name, o, writes=True) for name, o in zip(names, outs)]
        return kb, x, w, _store(bufs, widths, r)

    if rowwise:
        for rows, when in ((1, M.eq(1)), (ROWWISE_ROWS, M > 1)):  # one row keeps its sums in registers
            if fixed is None or (fixed == 1) == (rows == 1):
                streams = rowwise_streams(ctx, dtype, rows, n)
                kb, x, w, store = kernel("matmul_rows", (ROWWISE_COLS,))
                _rowwise(kb, dtype, M, n, k, rows, store, w, x, blocks=blocks, streams=streams)
                kb.launch(rowwise_groups(M, n, rows, streams), when=None if fixed else when)
        return
    if fixed is None or fixed <= GEMV_ROWS:
        g = Gemv(dtype, k)
        rows = min(fixed, GEMV_ROWS) if fixed else GEMV_ROWS
        kb, x, w, store = kernel("matmul_gemv", (g.lanes, g.cols))
        n_col = kb.let("n", kb.gid(0) * g.cols + kb.lid(1))
        r0 = kb.let("r0", kb.gid(1) * rows)
        _gemv(kb, g, rows, M, N, n_col, r0, w, n_col, x, lambda row: cast(I64, row) * dim(k), store, act_quant)
        kb.launch([cdiv(N, g.cols), cdiv(M, rows)], when=None if fixed else M <= GEMV_ROWS)
    if fixed is None or fixed > GEMV_ROWS:
        kb, x, w, store = kernel("matmul_gemm", (THREADS, THREADS))
        _gemm(kb, dtype, M, n, k, store, x, w, act_quant)
        kb.launch([cdiv(N, TILE), cdiv(M, TILE)], when=None if fixed else M > GEMV_ROWS)


@lowers("matmul_group")
def matmul_group(ctx: NodeCtx) -> None:
    x, *weights = ctx.ins
    _matmul(ctx, x, weights, ctx.outs, [], ctx.attr.get("act_quant", False))


def rowwise_streams(ctx: NodeCtx, dtype: DType, rows: int, n: Dim) -> int:
    """Weight rows one work-item of the CPU schedule streams at once (up to ctx.row_streams):
    a single-row Q8_0 product is bound by memory latency, and four rows far apart keep four
    prefetch streams in flight per core (a 12288x4096 GEMV from DRAM on 2 cores, PoCL:
    14.1 GB/s with one stream, 25.8 with four)."""
    wide = dtype is DType.Q8_0 and rows == 1 and isinstance(n, int) and n >= ctx.row_streams
    return ctx.row_streams if wide else 1


def rowwise_groups(M: K, n: Dim, rows: int, streams: int) -> list[K]:
    """The work-group grid of _rowwise for M rows of output width n."""
    width = dim(n) if streams == 1 else const(-(-n // streams))
    return [cdiv(M, rows), cdiv(width, ROWWISE_COLS)]


def _rowwise(kb: KernelSpec, dtype: DType, M: K, n: Dim, k: Dim, R: int, store: Store, w: Buffer, x: Buffer,
             wrow: Callable[[K, K], K] = lambda n, r0: n, xrow: Callable[[K], K] | None = None, blocks: int = 0,
             streams: int = 1) -> None:
    """CPU schedule of x @ wᵀ, any row count: a work-item owns output column n for a block of
    R rows, converts each 32-element chunk of w's row n once and applies it to every row
    of the block, accumulating into independent sums per row, which a CPU compiler turns
    into vector FMAs (one running sum would be a serial dependency chain).
    Work-groups are numbered row-block fastest, so consecutive ones read the same
    ROWWISE_COLS weight rows, from cache after the first. Without a ragged K tail the
    chunk loops have constant trip counts, which is what lets them vectorise. `wrow(n)` is
    the weight row of column n (given r0 for R = 1), `xrow(row)` the offset of x's row,
    `store` writes a row's column n.

    A Q8_0 weight is read in the split layout (`blocks` blocks in all: quants, then
    scales; plan.LAYOUTS): aligned 16-wide quant loads, and the scales of SCALE_RUN blocks
    converted by one 16-wide f16 load, where one f16 conversion per block cost more than
    the block's arithmetic. Each block's partial sums are scaled by its d into sixteen
    sums per row; a single row keeps two sets (two blocks per step) for each of its
    `streams` columns."""
    xrow = xrow or (lambda row: cast(I64, row) * dim(k))
    if dtype is DType.Q8_0:
        _rowwise_q8_0(kb, n, k, R, store, w, x, wrow, xrow, blocks, M, streams)
        return
    K_ = dim(k)
    whole = isinstance(k, int) and k % 32 == 0
    r0 = kb.let("r0", kb.gid(0) * R)
    n_col = kb.let("n", kb.gid(1) * ROWWISE_COLS + kb.lid(0))
    kb.return_if(n_col >= dim(n))
    acc = kb.array("acc", F32, R * 32)
    with kb.loop("r", 0, R) as r:
        with kb.loop("e", 0, 32) as e:
            acc[r * 32 + e] = 0.0
    with kb.loop("c", 0, K_, 32) as c:
        wv = kb.array("wv", F32, 32)
        with kb.loop("e", 0, 32) as e:
            value = weight_at(dtype, w, wrow(n_col, r0), c + e, k)
            wv[e] = value if whole else select(c + e < K_, value, 0.0)
        with kb.loop("r", 0, R, cond=lambda r: r0 + r < M) as r:
            row = kb.let("row", r0 + r)
            xc = kb.let("xc", xrow(row) + c)
            with kb.loop("e", 0, 32, cond=None if whole else lambda e: c + e < K_) as e:
                acc[r * 32 + e] = acc[r * 32 + e] + wv[e] * x[xc + e]
    with kb.loop("r", 0, R, cond=lambda r: r0 + r < M) as r:
        row = kb.let("row", r0 + r)
        s = kb.let("s", 0.0)
        with kb.loop("e", 0, 32) as e:
            kb.set(s, s + acc[r * 32 + e])
        store(row, n_col, s)



def _rowwise_q8_0(kb: KernelSpec, n: Dim, k: int, R: int, store: Store, w: Buffer, x: Buffer, wrow, xrow,
                  blocks: int, M: K, S: int) -> None:
    """The Q8_0 loops of _rowwise: runs of SCALE_RUN blocks, then the tail block by block,
    for S columns n0 + i·Q (i < S) per work-item, Q = ceil(N / S); a column past N reads
    row N-1 again and stores nothing."""
    N = dim(n)
    Q = const(-(-n // S)) if S > 1 else N
    nb, run = k // 32, SCALE_RUN * 32
    full = nb // SCALE_RUN * run
    U = 2 if R == 1 else 1  # one row (decode): two blocks per step into two sums, two loads in flight
    V16 = F32.vec(16)
    r0 = kb.let("r0", kb.gid(0) * R)
    n0 = kb.let("n0", kb.gid(1) * ROWWISE_COLS + kb.lid(0))
    kb.return_if(n0 >= Q)
    acc = kb.array("acc", V16, R * S * U)
    with kb.loop("q", 0, R * S * U) as q:
        acc[q] = cast(V16, 0.0)
    qrow, srow = [], []
    for i in range(S):
        column = n0 if S == 1 else minimum(n0 + i * Q.arg, N - 1)
        qrow.append(kb.let(f"qrow{i}", cast(I64, wrow(column, r0)) * k))
        srow.append(kb.let(f"srow{i}", blocks * 16 + cast(I64, wrow(column, r0)) * nb))

    def slot(r: K, i: int, u: int) -> K:
        return (r * S + i) * U + u

    def step(c: K, scale: Callable[[int, int], K], units: int) -> None:
        quants = {(i, u): [kb.let(f"wv{i}_{u}_{h}", cast(V16, w.load(qrow[i] + c + 32 * u + 16 * h, "i8", 16)))
                           for h in range(2)] for i in range(S) for u in range(units)}
        with kb.loop("r", 0, R, cond=lambda r: r0 + r < M) as r:
            xr = kb.let("xr", xrow(r0 + r))
            for i in range(S):
                for u in range(units):
                    lo, hi = quants[i, u]
                    at = xr + c + 32 * u
                    a = acc[slot(r, i, u)]
                    acc[slot(r, i, u)] = call("fma", scale(i, u), lo * x.load(at, lanes=16) + hi * x.load(at + 16, lanes=16), a)

    if full:
        with kb.loop("c0", 0, full, run) as c0:
            scales = [kb.array(f"ds{i}", F32, SCALE_RUN) for i in range(S)]
            for i in range(S):
                kb.set(scales[i].vec(0, 16), w.load(srow[i] + c0 / 32, "f16", 16))
            with kb.loop("j", 0, SCALE_RUN, U) as j:
                step(c0 + 32 * j, lambda i, u: scales[i][j + u], U)
    if full < k:
        with kb.loop("c", full, k, 32) as c:
            ds = [kb.let(f"d{i}", w.load(srow[i] + c / 32, "f16")) for i in range(S)]
            step(c, lambda i, u: ds[i], 1)
    with kb.loop("r", 0, R, cond=lambda r: r0 + r < M) as r:
        row = kb.let("row", r0 + r)
        for i in range(S):
            col = kb.let(f"col{i}", n0 + i * (Q.arg if S > 1 else 0))
            with kb.if_(col < N):
                total = vsum(acc[slot(r, i, 0)])
                for u in range(1, U):
                    total = total + vsum(acc[slot(r, i, u)])
                store(row, col, total)


@lowers("matmul")
def matmul(ctx: NodeCtx) -> None:
    matmul_launch(ctx)


@lowers("matmul_q8_0", "matmul_f16")
def matmul_specialised(ctx: NodeCtx) -> None:
    """The `form` attr is only a hint here: the row count is known at launch."""
    matmul_launch(ctx, act_quant=ctx.attr.get("act_quant", False))


def _gemm(kb: KernelSpec, dtype: DType, M: K, n: Dim, k: Dim, store: Store, x: Buffer, w: Buffer,
          act_quant: bool) -> None:
    """Tiled x @ wᵀ: each work-group stages a TILE x TILE block of x rows and of (dequantised)
    w rows per K step in local memory; each thread accumulates a 2x2 patch of outputs.
    With act_quant (TILE = one Q8_0 block) the staged values are the int8 quants of x and w
    and each K step adds an exact integer dot (in f32: |sum| < 2^24) times both scales."""
    N, K_, P = dim(n), dim(k), TILE + 1  # padded rows avoid local-memory bank conflicts
    per = TILE // THREADS
    tx, ty = kb.let("tx", kb.lid(0)), kb.let("ty", kb.lid(1))
    tid = kb.let("tid", ty * THREADS + tx)
    n0, m0 = kb.let("n0", kb.gid(0) * TILE), kb.let("m0", kb.gid(1) * TILE)
    xs, ws = kb.array("xs", F32, TILE * P, "local"), kb.array("ws", F32, TILE * P, "local")
    if act_quant:
        xd, wd = kb.array("xd", F32, TILE, "local"), kb.array("wd", F32, TILE, "local")
    acc = kb.array("acc", F32, per * per)
    with kb.loop("a", 0, per * per) as a:
        acc[a] = 0.0
    with kb.loop("k0", 0, K_, TILE) as k0:
        with kb.loop("e", tid, TILE * TILE, THREADS * THREADS) as e:
            rr, kk = kb.let("rr", e / TILE), kb.let("kk", e % TILE)
            kc, m, nn = kb.let("k", k0 + kk), kb.let("m", m0 + rr), kb.let("nr", n0 + rr)
            xs[rr * P + kk] = select((m < M) & (kc < K_), x[cast(I64, m) * K_ + kc], 0.0)
            if act_quant:
                value = cast(F32, w.load(cast(I64, nn) * q8_row_bytes(k) + (kc / 32) * Q8_BLOCK + 2 + kk, "i8"))
            else:
                value = weight_at(dtype, w, nn, kc, k)
            ws[rr * P + kk] = select((nn < N) & (kc < K_), value, 0.0)
        kb.barrier()
        if act_quant:
            with kb.if_(tid < TILE):
                amax = kb.let("amax", 0.0)
                with kb.loop("e", 0, TILE) as e:
                    kb.set(amax, maximum(amax, call("fabs", xs[tid * P + e])))
                dx = kb.let("dx", amax / 127.0)
                inv = kb.let("inv", select(dx.ne(0.0), 1.0 / dx, 0.0))
                with kb.loop("e", 0, TILE) as e:
                    xs[tid * P + e] = call("round", xs[tid * P + e] * inv)
                xd[tid] = call("round_f16", dx)
                nw = kb.let("nw", n0 + tid)
                wd[tid] = select(nw < N, w.load((cast(I64, nw) * q8_row_bytes(k) + (k0 / 32) * Q8_BLOCK) / 2, "f16"),
                                 0.0)
            kb.barrier()
        for a in range(per):
            for b in range(per):
                xa, wb = (ty + a * THREADS) * P, (tx + b * THREADS) * P
                if act_quant:
                    s = kb.let(f"s{a}{b}", 0.0)
                    with kb.loop("kk", 0, TILE) as kk:
                        kb.set(s, s + xs[xa + kk] * ws[wb + kk])
                    acc[a * per + b] = acc[a * per + b] + s * xd[ty + a * THREADS] * wd[tx + b * THREADS]
        if not act_quant:
            with kb.loop("kk", 0, TILE) as kk:
                for a in range(per):
                    for b in range(per):
                        xa, wb = (ty + a * THREADS) * P, (tx + b * THREADS) * P
                        acc[a * per + b] = acc[a * per + b] + xs[xa + kk] * ws[wb + kk]
        kb.barrier()
    for a in range(per):
        for b in range(per):
            row, col = kb.let(f"row{a}{b}", m0 + ty + a * THREADS), kb.let(f"col{a}{b}", n0 + tx + b * THREADS)
            with kb.if_((row < M) & (col < N)):
                store(row, col, acc[a * per + b])


@lowers("expert_matmul")
def expert_matmul(ctx: NodeCtx) -> None:
    """Each (row, slot) pair reads only its selected expert's rows: GPU profile, a work-group
    per (output column block, pair); CPU profile, the rowwise schedule with one pair per item."""
    x_value, w_value, ids_value = ctx.ins
    out_value = ctx.outs[0]
    _, n, k = w_value.type.shape
    pairs = prod(ids_value.type.shape)
    slots = dim(ids_value.type.shape[1])
    per_slot = x_value.type.rank != 2
    cpu = ctx.profile == "cpu"
    blocks = 0
    if cpu and w_value.type.dtype is DType.Q8_0:
        w_value, blocks = _split_q8_0(ctx, [w_value])
    streams = rowwise_streams(ctx, w_value.type.dtype, 1, n) if cpu else 1
    g = Gemv(w_value.type.dtype, k)
    kb = ctx.kernel("expert_matmul_rows" if cpu else "expert_matmul", (ROWWISE_COLS,) if cpu else (g.lanes, g.cols))
    x, w, ids = kb.bind("x", x_value), kb.bind("w", w_value), kb.bind("ids", ids_value)
    out = kb.bind("out", out_value, writes=True)

    def xrow(pair: K) -> K:
        return cast(I64, pair if per_slot else pair / slots) * dim(k)

    def store(row: K, col: K, value: K) -> None:
        out[cast(I64, row) * dim(n) + col] = value
    if cpu:
        _rowwise(kb, w_value.type.dtype, pairs, n, k, 1, store, w, x,
                 wrow=lambda col, r0: cast(I64, ids[r0]) * dim(n) + col, xrow=xrow, blocks=blocks, streams=streams)
        kb.launch(rowwise_groups(pairs, n, 1, streams))
        return
    n_col = kb.let("n", kb.gid(0) * g.cols + kb.lid(1))
    p = kb.let("p", kb.gid(1))
    _gemv(kb, g, 1, const(1), dim(n), n_col, const(0), w, cast(I64, ids[p]) * dim(n) + n_col, x,
          lambda row: xrow(p), lambda row, col, value: store(p, col, value))
    kb.launch([cdiv(dim(n), g.cols), pairs])




"""Weight-consuming ops: dequantize, embedding, matmul (GEMV, tiled GEMM, CPU register tiles);
expert_matmul and the fused MoE layer are in kernels/moe.py, on the same tiles.

Weights are read in their storage type (f32, f16, bf16 or Q8_0 blocks of fp16 d + 32 int8,
34 bytes, so only 2-byte aligned: scales and pairs of quants are read as u16), or on the CPU
profile packed for the tiles, 16 outputs side by side (quant.pack_q8_0_cols16 for Q8_0,
quant.pack_blocks_cols16 for the other block types, decoded lane-wise). The GEMV takes a Q8_0 block's
scale out of its dot product (d * sum(q * x): a third fewer multiplies where the weight read
should be the only cost); elsewhere values are the reference's d * q exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dflash_ir import activations
from dflash_ir.blocks import DECODERS
from dflash_ir.dtypes import DType
from dflash_ir.ir import Value
from dflash_ir.ops.specialised import OPS
from dflash_ir.passes.specialise_matmul import GEMV_KINDS
from dflash_ir.types import Dim, TensorType

from ..kir import F32, I32, I64, K, call, cast, const, dot4_i8, dpbusd_at, maximum, minimum, select
from ..kir.build import Array, Buffer, KernelBuilder
from ..lowering import KernelSpec, NodeCtx, dim, lowers
from .access import KERNEL, Q8_BLOCK, Cols16Loads, Dp4Loads, q8_row_bytes, weight_at, weight_chunk
from dflash_ir.quant import COLS_BLOCK_BYTES, DP4_TYPES, TILED_BLOCK_TYPES, cols16_layout
from .fused import fused_matmul_parts
from .reduce import LANES, inverse_rms, inverse_rms_lanes, row_per_item, row_threads
from .shapes import FLAT, cdiv, flat_launch, prod

GEMV_ROWS = 16    # rows a GEMV work-group sums at once, looping over groups of them (passes/specialise_matmul)
GEMV_THREADS = 256
TILE = 32         # GEMM output tile (TILE x TILE) and K step
THREADS = 16      # GEMM work-group is THREADS x THREADS, each thread 2x2 outputs
ROWWISE_COLS = 128  # CPU schedule: output columns per work-group ...
ROWWISE_ROWS = 8  # ... and rows per work-item
Q8_VALUES = DType.Q8_0.block_size  # values of a Q8_0 block (Q8_BLOCK: its bytes)

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
    """On the CPU profile a Q8_0 table is read in the 16-row interleaved layout, the one the
    (tied) output head's matmul reads it in, so the table is on the device once."""
    table, ids = ctx.ins
    k = table.type.shape[1]
    ctx.check("index", ids, size=dim(table.type.shape[0]))
    tiled = ctx.profile == "cpu" and table.type.dtype is DType.Q8_0
    # the layout the tied output head's tiles read: theirs take Q8_0 x where the graph quantises
    layout = tile_layout(ctx, any(n.op == "quantize_q8_0" for n in ctx.graph.nodes))
    packed = ctx.packed([table], layout) if tiled else table

    def compute(kb, i, xs, out):
        row, col = xs[1][i / dim(k)], i % dim(k)
        out[i] = _cols16_at(xs[0], row, col, k, layout) if tiled else weight_at(table.type.dtype, xs[0], row, col, k)
    flat_launch(ctx, compute, inputs=[packed, ids])


def dp4_tiles(ctx: NodeCtx, x_q8: bool) -> bool:
    """Whether the CPU tiles sum Q8_0 x with VPDPBUSD (on their dp4 packs)."""
    return x_q8 and "avx512_vnni" in ctx.isa


def tile_layout(ctx: NodeCtx, x_q8: bool, dtype: DType = DType.Q8_0) -> str:
    """The pack the CPU tiles read: Q8_0's, or another block type's words side by side; the
    dp4 one of either where they sum Q8_0 x with VPDPBUSD."""
    return cols16_layout(dtype, dp4_tiles(ctx, x_q8))


def tiled(w: Value) -> bool:
    """Whether the CPU tiles take products over weight w (f32 x, or Q8_0 x: quant.Q8_X_TYPES
    are these types)."""
    return w.type.dtype is DType.Q8_0 or w.type.dtype in TILED_BLOCK_TYPES


def group_bytes(dtype: DType, k: int) -> int:
    """Bytes of one group of 16 rows with rows of k in the tiles' pack of `dtype` (either pack
    holds each row's bytes once)."""
    return k // dtype.block_size * dtype.block_bytes * COLS


def _cols16_at(buf: Buffer, row: K, col: K, k: int, layout: str) -> K:
    """f32 value of element (row, col) of a Q8_0 weight in a quant.pack_q8_0_cols16 layout."""
    block = (cast(I64, row / COLS) * (k // 32) + col / 32) * COLS_BLOCK_BYTES
    lane, kk = row % COLS, col % 32
    if layout == "q8_0_cols16_dp4":  # the quant stored as the unsigned byte q + 128
        quant = buf.load(block + 2 * COLS + (kk / 4) * 4 * COLS + lane * 4 + kk % 4, "u8") - 128
    else:
        quant = buf.load(block + 2 * COLS + kk * COLS + lane, "i8")
    return cast(F32, quant) * buf.load(block / 2 + lane, "f16")


@dataclass(frozen=True)
class Gemv:
    """GEMV geometry: `lanes` threads share one output column's K chunks; a work-group holds
    `cols` columns side by side, so a 250k-row vocabulary matrix is not 250k tiny work-groups.
    A Q8_0 chunk is a word of 4 quants, so 8 lanes read a block's 32 side by side and a
    warp's loads of weights and x are contiguous; another block type's chunk is a whole
    block (decoded once), a float type's one element."""

    dtype: DType
    k: Dim

    @property
    def chunk(self) -> int:
        return 4 if self.dtype is DType.Q8_0 else 32 if self.dtype in DECODERS else 1

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


@lowers("quantize_q8_0")
def quantize_q8_0(ctx: NodeCtx) -> None:
    """A thread per 32-block; with the norm prologue a work-group per row, which first sums
    the row's squares as the rmsnorm kernel does (the same bits as rmsnorm then quantize).
    On a CPU that keeps vectors a work-item per row or run of blocks (_quantize_rows), whose
    norm sums as that profile's rmsnorm does."""
    x_value = ctx.ins[0]
    if row_per_item(ctx, x_value.type.shape[-1]) and (len(ctx.ins) == 1 or ctx.ins[1].type.dtype is DType.F32):
        _quantize_rows(ctx, x_value.type.shape[-1])
        return
    if ctx.attr.get("norm_eps") is None:
        total = prod(x_value.type.shape) / 32
        kb = ctx.kernel("quantize_q8_0", local=(FLAT,))
        x, out = kb.bind("x", x_value), kb.bind("out", ctx.outs[0], writes=True)
        i = kb.let("i", kb.gid(0) * FLAT + kb.lid(0))
        kb.return_if(i >= total)
        xr = kb.let("xr", cast(I64, i) * 32)
        store_q8_block(kb, out, i, lambda e: x[xr + e])
        kb.launch([cdiv(total, FLAT)])
        return
    w_value = ctx.ins[1]
    n = x_value.type.shape[-1]
    L, N = row_threads(n), dim(n)
    kb = ctx.kernel("quantize_q8_0_norm", local=(L,))
    x, w, out = kb.bind("x", x_value), kb.bind("w", w_value), kb.bind("out", ctx.outs[0], writes=True)
    row = kb.let("row", kb.gid(0))
    xr = kb.let("xr", cast(I64, row) * N)
    r = inverse_rms(kb, x, xr, N, L, ctx.attr["norm_eps"])
    with kb.loop("b", kb.lid(0), N / 32, L) as b:
        def normed(e: K) -> K:
            return x[xr + b * 32 + e] * r * weight_at(w_value.type.dtype, w, const(0), b * 32 + e, n)
        store_q8_block(kb, out, kb.let("blk", row * (n // 32) + b), normed)
    kb.launch([prod(x_value.type.shape[:-1])])


QUANTIZE_RUN = 32  # CPU: Q8_0 blocks of a row one work-item quantises without a norm


def _quantize_rows(ctx: NodeCtx, n: int) -> None:
    """quantize_q8_0 with a work-item per row (reduce.row_per_item; without the norm, per run of
    QUANTIZE_RUN blocks of a row), a block's 32 values as two vectors: the row's RMS (with the
    norm) summed as the CPU's norms sum it, then each block as store_q8_block makes it, from
    the same values x * r * w."""
    x_value, eps = ctx.ins[0], ctx.attr.get("norm_eps")
    nb = n // 32
    run = nb if eps is not None else min(nb, QUANTIZE_RUN)
    runs = -(-nb // run)
    kb = ctx.kernel("quantize_q8_0" if eps is None else "quantize_q8_0_norm", local=(1,))
    x, out = kb.bind("x", x_value), kb.bind("out", ctx.outs[0], writes=True)
    w = None if eps is None else kb.bind("w", ctx.ins[1])
    row, first = kb.let("row", kb.gid(0) / runs), kb.let("first", kb.gid(0) % runs * run)
    xr = kb.let("xr", cast(I64, row) * n)
    r = None if eps is None else inverse_rms_lanes(kb, x, xr, n, eps)
    with kb.loop("b", first, minimum(first + run, nb)) as b:
        halves = []
        for h in range(0, 32, LANES):
            value = x.load(xr + b * 32 + h, lanes=LANES)
            halves.append(kb.let(f"v{h}", value if r is None else value * r * w.load(b * 32 + h, lanes=LANES)))
        store_q8_vectors(kb, out, kb.let("blk", cast(I64, row) * nb + b), halves)
    kb.launch([prod(x_value.type.shape[:-1]) * runs])


def store_q8_vectors(kb: KernelSpec, out: Buffer, block: K, halves: list[K]) -> None:
    """Q8_0 block `block` of out from its 32 values as two 16-lane vectors, as store_q8_block
    makes it from scalars."""
    lanes = kb.array("q8_lanes", F32, LANES)
    kb.set(lanes.vec(0, LANES), maximum(call("fabs", halves[0]), call("fabs", halves[1])))
    amax = kb.let("amax", 0.0)
    with kb.loop("e", 0, LANES) as e:
        kb.set(amax, maximum(amax, lanes[e]))
    d = kb.let("d", amax / 127.0)
    inv = kb.let("inv", select(d.ne(0.0), 1.0 / d, 0.0))
    out.store(block * (Q8_BLOCK // 2), d, "f16")
    for h, value in zip(range(0, 32, LANES), halves):
        out.store(block * Q8_BLOCK + 2 + h, cast(I32.vec(LANES), call("round", value * inv)), "u8")


def store_q8_block(kb: KernelSpec, out: Buffer, block: K, value: Callable[[K], K]) -> None:
    """Q8_0 block `block` of out from the 32 values value(e), as quantize_row_q8_0: scale
    amax / 127 (stored as f16), quants round(value / scale) with the unrounded scale's inverse."""
    amax = kb.let("amax", 0.0)
    with kb.loop("e", 0, 32) as e:
        kb.set(amax, maximum(amax, call("fabs", value(e))))
    d = kb.let("d", amax / 127.0)
    inv = kb.let("inv", select(d.ne(0.0), 1.0 / d, 0.0))
    out.store(cast(I64, block) * (Q8_BLOCK // 2), d, "f16")
    with kb.loop("e", 0, 32) as e:
        out.store(cast(I64, block) * Q8_BLOCK + 2 + e, cast(I32, call("round", value(e) * inv)), "u8")


def store_q8_blocks(kb: KernelSpec, out: Buffer, first: K, count: int, values: Callable[[K], K],
                    start: K | int = 0, step: int = 1) -> None:
    """A row of `count` Q8_0 blocks of out from block `first` on, block b from values(32 b + e),
    its blocks start, start + step, ... (a work-item taking every step-th)."""
    with kb.loop("qb", start, count, step) as b:
        store_q8_block(kb, out, first + b, lambda e: values(b * Q8_VALUES + e))


def _q8_words(buf: Buffer, block: K, word: K) -> K:
    """Word `word` (0..7) of the Q8_0 block at byte `block`: its quants 4w .. 4w+3 as the
    bytes of an int (read as two u16: blocks are only 2-byte aligned)."""
    half = block / 2 + 1 + 2 * word
    return buf.load(half, "u16") | (buf.load(half + 1, "u16") << 16)


def _gemv(kb: KernelSpec, g: Gemv, rows: int, count: K, n_total: K, n: K, w: Buffer, wrows: tuple[K, ...],
          x: Buffer, xrow: Callable[[K], K], store: Store, x_q8: bool = False,
          norm: tuple[Buffer, float] | None = None) -> None:
    """Column n of all `count` rows, `rows` at a time: the work-group walks the groups of
    rows itself, so a pass of several sequences reads each weight column from memory once
    (the later groups find it in cache) and a row's sums do not depend on its group."""
    red = kb.array("red", F32, rows * GEMV_THREADS, "local")
    inv = kb.array("inv", F32, rows, "local") if norm else None
    with kb.loop("r0", 0, count, rows) as r0:
        _gemv_rows(kb, g, rows, count, n_total, n, r0, w, wrows, x, xrow, store, x_q8, norm, red, inv)
        kb.barrier()  # the stores read `red` and `inv`, which the next group's rows overwrite


def _gemv_rows(kb: KernelSpec, g: Gemv, rows: int, count: K, n_total: K, n: K, r0: K, w: Buffer,
               wrows: tuple[K, ...], x: Buffer, xrow: Callable[[K], K], store: Store, x_q8: bool,
               norm: tuple[Buffer, float] | None, red: Buffer, inv: Buffer | None) -> None:
    """Column n, rows r0 .. r0+rows-1 (< count): each lane accumulates its chunks for every
    row, then a tree reduction over the column's lanes. `wrows` are the weight rows of column
    n: one, or a gate row and an up row whose products are stored as silu(gate) * up.
    `xrow(row)` is the element offset of x's row. With `norm` (weight, eps) x is RMS-
    normalised first: the weight scales x's elements, 1/RMS (computed once per group of
    rows) the sums. With x_q8 (x in Q8_0 blocks) a Q8_0 word's dot is an exact integer dot4,
    scaled by both blocks' scales; another block type's takes x's values d_x * q."""
    L, S = g.lanes, len(wrows)
    lane, col = kb.lid(0), kb.lid(1)
    if norm:
        _gemv_inverse_rms(kb, g, rows, count, r0, x, xrow, red, norm, inv)
    acc = kb.array("acc", F32, rows * S)
    with kb.loop("r", 0, rows * S) as r:
        acc[r] = 0.0
    q8 = g.dtype is DType.Q8_0
    chunks = dim(g.k) / g.chunk
    with kb.loop("c", lane, chunks, L, cond=n < n_total) as c:
        scales, values = [], []
        for j, wrow in enumerate(wrows):
            if q8:  # word c % 8 of block c / 8
                blk = kb.let(f"blk{j}", cast(I64, wrow) * q8_row_bytes(g.k) + c / 8 * Q8_BLOCK)
                scales.append(kb.let(f"d{j}", w.load(blk / 2, "f16")))
                word = kb.let(f"wq{j}", _q8_words(w, blk, c % 8))
                if x_q8:
                    values.append(word)
                else:
                    wv = kb.array(f"wv{j}", F32, 4)
                    for e in range(4):
                        wv[e] = cast(F32, sext8(word >> 8 * e))
                    values.append(wv)
            else:
                wv = kb.array(f"wv{j}", F32, g.chunk)
                if g.chunk > 1:  # a block type's 32 elements, sub-block scales decoded once
                    weight_chunk(kb, g.dtype, w, wrow, c * 32, g.k, wv, f"w{j}")
                else:
                    wv[0] = weight_at(g.dtype, w, wrow, c, g.k)
                values.append(wv)
        with kb.loop("r", 0, rows, cond=lambda r: r0 + r < count) as r:
            row = kb.let("row", r0 + r)
            if x_q8:
                xb = kb.let("xb", (xrow(row) + c * g.chunk) / 32 * Q8_BLOCK)
                dx = kb.let("dx", x.load(xb / 2, "f16"))
            if x_q8 and q8:
                xq = kb.let("xq", _q8_words(x, xb, c % 8))
                for j, wq in enumerate(values):
                    acc[r * S + j] = acc[r * S + j] + cast(F32, dot4_i8(xq, wq, 0)) * dx * scales[j]
            else:
                xr = kb.let("xr", xrow(row) + c * g.chunk)
                xv = kb.array("xv", F32, g.chunk)
                with kb.loop("e", 0, g.chunk) as e:
                    if x_q8:  # another block type's weight: x's values, d_x * q
                        xv[e] = dx * cast(F32, x.load(xb + 2 + e, "i8"))
                    else:
                        xv[e] = x[xr + e] * norm[0][c * g.chunk + e] if norm else x[xr + e]
                for j, wv in enumerate(values):
                    s = kb.let(f"s{j}", 0.0)
                    with kb.loop("e", 0, g.chunk) as e:
                        kb.set(s, s + wv[e] * xv[e])
                    acc[r * S + j] = acc[r * S + j] + (scales[j] * s if q8 else s)

    def slot(r):
        return (r * g.cols + col) * L + lane
    sums = kb.array("sums", F32, rows * S)  # the reduced sums of the rows this lane stores
    for j in range(S):
        with kb.loop("r", 0, rows) as r:
            red[slot(r)] = acc[r * S + j]
        kb.barrier()
        with kb.loop("s", L // 2, cond=lambda s: s > 0, next=lambda s: s >> 1) as s:
            with kb.if_(lane < s):
                with kb.loop("r", 0, rows) as r:
                    red[slot(r)] = red[slot(r)] + red[slot(r) + s]
            kb.barrier()
        with kb.loop("r", lane, rows, L) as r:
            sums[r * S + j] = red[(r * g.cols + col) * L]
        if j + 1 < S:
            kb.barrier()
    with kb.loop("r", lane, rows, L) as r:
        row = kb.let("row", r0 + r)
        with kb.if_((row < count) & (n < n_total)):
            dots = [sums[r * S + j] * inv[r] if inv is not None else sums[r * S + j] for j in range(S)]
            if S == 1:
                store(row, n, dots[0])
            else:
                gate = kb.let("gate", dots[0])
                store(row, n, activations.swiglu(KERNEL, gate, dots[1]))


def _gemv_inverse_rms(kb: KernelSpec, g: Gemv, rows: int, count: K, r0: K, x: Buffer, xrow: Callable[[K], K],
                      red: Buffer, norm: tuple[Buffer, float], inv: Buffer) -> None:
    """1/RMS of each of the work-group's x rows r0 .. r0+rows-1 into `inv` (local), all its
    threads summing squares in `red` (free until the products are reduced)."""
    k = dim(g.k)
    t = kb.let("t", kb.lid(1) * g.lanes + kb.lid(0))
    with kb.loop("r", 0, rows) as r:
        xr = kb.let("xr", xrow(minimum(r0 + r, count - 1)))
        ss = kb.let("ss", 0.0)
        with kb.loop("e", t, k, GEMV_THREADS) as e:
            kb.set(ss, call("fma", x[xr + e], x[xr + e], ss))
        red[r * GEMV_THREADS + t] = ss
    kb.barrier()
    with kb.loop("s", GEMV_THREADS // 2, cond=lambda s: s > 0, next=lambda s: s >> 1) as s:
        with kb.if_(t < s):
            with kb.loop("r", 0, rows) as r:
                red[r * GEMV_THREADS + t] = red[r * GEMV_THREADS + t] + red[r * GEMV_THREADS + t + s]
        kb.barrier()
    with kb.if_(t < rows):
        inv[t] = activations.inverse_rms(KERNEL, red[t * GEMV_THREADS], cast(F32, k), float(norm[1]))
    kb.barrier()


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


def matmul_launch(ctx: NodeCtx) -> None:
    """x @ wᵀ [+ residual] for node inputs (x, w[, residual]); x f32, or Q8_0 blocks."""
    x, w, *res = ctx.ins
    _matmul(ctx, x, [w], [ctx.outs[0]], res)


def _matmul(ctx: NodeCtx, x_value: Value, weights: list, outs: list, res: list,
            norm: tuple[Value, float] | None = None, swiglu: bool = False, q8_out: bool = False) -> None:
    """x @ wᵀ over the rows of `weights` side by side (one weight, or a matmul_group's),
    output i getting weight i's columns; with `norm` x RMS-normalised first, with `swiglu`
    silu(x @ w0ᵀ) * (x @ w1ᵀ) into the one output (both only where the caller checked that
    this profile's kernel takes them). GPU profile: the node's `form` chooses a GEMV (a few
    rows: a decode, verify or draft block) or a tiled GEMM; a node without one (a plain f32
    matmul) gets both and the launch picks one per call by its row count. CPU profile: block
    types in register tiles (_tiled_product, `tiled`; `q8_out`: the SwiGLU quantised), other
    weights in the rowwise schedule."""
    dtype, k = weights[0].type.dtype, weights[0].type.shape[1]
    if ctx.profile == "cpu" and tiled(weights[0]):
        _tiled_product(ctx, x_value, weights, outs, res[0] if res else None, norm=norm, swiglu=swiglu, q8_out=q8_out)
        return
    widths = [o.type.shape[-1] for o in outs]
    n = widths[0] if swiglu else sum(widths)
    M, N = prod(x_value.type.shape[:-1]), const(n)
    x_q8 = x_value.type.dtype is DType.Q8_0
    rowwise = ctx.profile == "cpu"
    w_value = weights[0] if len(weights) == 1 else ctx.packed(weights, "as_stored")
    fixed = M.arg if M.op == "const" else None
    # a plain (f32) product of a verify, draft block or decode graph takes the GEMV as the
    # specialised ones do (passes/specialise_matmul.form): a batched verify's rows sum alike
    form = ctx.attr.get("form") or ("gemv" if fixed is not None and ctx.kind in GEMV_KINDS else None)
    gemv = form == "gemv" if form else fixed is None or fixed <= GEMV_ROWS
    gemm = form == "gemm" if form else fixed is None or fixed > GEMV_ROWS

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
                kb, x, w, store = kernel("matmul_rows", (ROWWISE_COLS,))
                _rowwise(kb, dtype, M, n, k, rows, store, w, x)
                kb.launch(rowwise_groups(M, n, rows), when=None if fixed else when)
        return
    if gemv:
        g = Gemv(dtype, k)
        rows = min(fixed, GEMV_ROWS) if fixed else GEMV_ROWS
        kb, x, w, store = kernel("matmul_gemv", (g.lanes, g.cols))
        n_col = kb.let("n", kb.gid(0) * g.cols + kb.lid(1))
        wrows = (n_col, n_col + n) if swiglu else (n_col,)
        normed = (kb.bind("norm", norm[0]), norm[1]) if norm else None
        _gemv(kb, g, rows, M, N, n_col, w, wrows, x, lambda row: cast(I64, row) * dim(k), store, x_q8, normed)
        kb.launch([cdiv(N, g.cols)], when=None if fixed or form else M <= GEMV_ROWS)
    if gemm:
        assert not (norm or swiglu), "the GEMM takes no prologue or epilogue: fused_matmul lowers as its parts"
        kb, x, w, store = kernel("matmul_gemm", (THREADS, THREADS))
        _gemm(kb, dtype, M, n, k, store, x, w, x_q8)
        kb.launch([cdiv(N, TILE), cdiv(M, TILE)], when=None if fixed or form else M > GEMV_ROWS)


COLS = 16         # outputs per vector in the CPU tiles (quant.pack_q8_0_cols16's groups)
TILE_ITEMS = 16   # work-items per work-group of the CPU tiles (fewer for small products) ...
TILE_GROUPS = 8   # ... so that a product has at least this many work-groups for the cores to share
UNROLL = 4        # the CPU tiles' inner loop unrolled this many times by the device compiler
WALK_ROWS = 16    # rows a CPU tile's work-item walks at least (a verify block), in tiles of fewer
# CPU register tiles: (rows, column groups, fewest rows, most rows) per x type (f32, Q8_0):
# rows x groups vectors of sums (x groups more per block for Q8_0 x) stay in registers;
# the longest tile serves every count past 16 rows (a prefill) in steps of its rows. Q8_0 x's
# 8-row tile takes two groups, though its 16 block sums and 16 sums fill the 32 registers and
# LLVM spills (each row's x scale, sub-block sums and offsets then serve both, and 16 sums
# are in flight rather than 8): a 16-row product of 32768 x 4096 from
# memory took 9.4-11.5 ms against 12.7-13.7 (Q8_0), 10.0-10.7 against 11.1-12.2 (Q4_K) and
# 13.2 against 14.2-15.8 (Q6_K) with one group (two alternations; 2-core Zen 4)
TILES = {False: ((1, 4, 1, 1), (2, 4, 2, 2), (4, 4, 3, 4), (8, 2, 5, 8), (16, 1, 9, 1 << 30)),
         True: ((1, 4, 1, 1), (2, 4, 2, 2), (4, 2, 3, 4), (8, 2, 5, 1 << 30))}
# ... except that a one-row tile over another block type's pack (a decode's K-quant product)
# takes one group: each group's scales, offsets and words of a sub-block are live at once, and
# four groups' spilled. One-row q8 products from memory, 24576 x 4096, four groups against
# one, medians of alternations in one process (2-core Zen 4): Q2_K 18.8 -> 30.2 GB/s and
# Q3_K 27.2 -> 32.7 (runs unrolled in both), Q5_K 23.8 -> 26.5 (looped in both), Q4_K 22.6
# -> 27.2 (memory-bound phase) and 32.9 -> 41.5 (faster phase) and Q6_K 32.2 -> 35.5 (from
# the four-group loop to one group unrolled), Q5_0 32.1 -> 34.0, Q4_0 level; Q8_0 ran
# slower with one (24-26 against 30)
BLOCK_ROW_GROUPS = 1
# the block types whose one-row decode tiles unroll their runs of 32 (_q8_x_tile_blocks), so
# that each run's scale and offset bytes sit at constant positions; one group, loop against
# unrolled, same runs: Q3_K 25.4 -> 31.9 GB/s, Q4_K 34.6 -> 36.1, Q6_K 25.1 -> 31.3. Q5_K
# ran slower unrolled (26.6 -> 19.2) and Q2_K no faster (26.2 -> 24.1): they keep the loop
RUNS_UNROLLED = frozenset({DType.Q3_K, DType.Q4_K, DType.Q6_K})


@dataclass(frozen=True)
class Tiled:
    """What a CPU tile computes, as types (the key its memoised kernel body is built from): the
    products of x with `weights` (of one block type, packed one after another by
    quant.pack_q8_0_cols16 or pack_blocks_cols16, each padded to whole groups of 16 rows),
    optionally RMS-normalising x first (`norm`: the norm weight's dtype and eps) and adding a
    residual, and writing each product to its output, or silu(product 0) * product 1 with
    `swiglu` (its Q8_0 blocks with `q8_out`)."""

    x: TensorType
    weights: tuple[TensorType, ...]
    n_outs: int
    residual: bool = False
    norm: tuple[DType, float] | None = None
    swiglu: bool = False
    q8_out: bool = False

    @property
    def k(self) -> int:
        return self.weights[0].shape[1]

    @property
    def widths(self) -> list[int]:
        return [w.shape[0] for w in self.weights]

    @property
    def starts(self) -> list[int]:
        """Each weight's first group in the pack."""
        groups = [-(-n // COLS) for n in self.widths]
        return [sum(groups[:i]) for i in range(len(groups))]

    @property
    def units(self) -> int:
        """Independent pieces of work: groups of 16 outputs (pairs of gate and up groups with swiglu)."""
        return -(-self.widths[0] // COLS) if self.swiglu else sum(-(-n // COLS) for n in self.widths)


def _tiled_product(ctx: NodeCtx, x: Value, weights: list, outs: list, residual: Value | None = None,
                   norm: tuple[Value, float] | None = None, swiglu: bool = False, q8_out: bool = False) -> None:
    """Launch the CPU tiles of a product, one kernel per row-count bucket (TILES)."""
    t = Tiled(x.type, tuple(w.type for w in weights), len(outs), residual is not None,
              None if norm is None else (norm[0].type.dtype, norm[1]), swiglu, q8_out)
    x_q8 = x.type.dtype is DType.Q8_0
    layout = tile_layout(ctx, x_q8, weights[0].type.dtype)
    packed = ctx.packed(weights, layout)
    M = prod(x.type.shape[:-1])
    fixed = M.arg if M.op == "const" else None
    for rows, groups, lo, hi in TILES[x_q8]:
        if fixed is not None and not lo <= fixed <= hi:
            continue
        if rows == 1 and weights[0].type.dtype is not DType.Q8_0:
            groups = BLOCK_ROW_GROUPS
        per = max(1, groups // 2) if swiglu else groups  # units per work-item
        items = tile_items(-(-t.units // per))
        if q8_out and items * per % 2:  # a work-group's units make whole Q8_0 blocks of 32 columns
            items *= 2
        kb = ctx.kernel("matmul_tiles", (items,))
        kb.bind("x", x)
        kb.bind("w", packed)
        if norm:
            kb.bind("norm", norm[0])
        if residual is not None:
            kb.bind("residual", residual)
        for i, o in enumerate(outs):
            kb.bind(tile_out(t, i), o, writes=True)
        # a call of a known row count (a batched verify's 64 rows) walks them all in each
        # work-item, and any other at least a verify block's rows, so a weight group is read
        # from memory once per block; a prefill's blocks spread over the grid
        span = M if fixed is not None else const(max(rows, WALK_ROWS))
        # a decode's product (not a prefill's one-row bucket) unrolls its block types' elements
        block_span = ctx.block_span if fixed == 1 else 0
        kb.emit_memoised(_tiles, t, M, rows, per, items, span, dp4_tiles(ctx, x_q8), block_span)
        kb.launch([cdiv(const(t.units), per * items), cdiv(M, span)],
                  when=None if fixed is not None else (M >= lo) & (M <= hi))


def tile_items(work_items: int) -> int:
    """Work-items per work-group: up to TILE_ITEMS, but a small product (a 1024-wide decode
    projection is 16 work-items) still spreads over TILE_GROUPS work-groups, not one core's."""
    items = TILE_ITEMS
    while items > 1 and -(-work_items // items) < TILE_GROUPS:
        items //= 2
    return items


def tile_out(t: Tiled, i: int) -> str:
    """The kernel parameter of output i."""
    return "out" if t.n_outs == 1 else f"out{i}"


def _tiles(kb: KernelBuilder, bufs: dict, t: Tiled, M: K, R: int, P: int, items: int, span: K, dp4: bool,
           block_span: int) -> None:
    """CPU schedule of a product over Q8_0 weights packed 16 rows at a time: a work-item owns
    P units (groups of 16 outputs, or gate/up pairs of groups) and `span` rows of x, which it
    takes R at a time, keeping the sums as 16-wide vectors in named registers (the tile is
    unrolled here: arrays indexed in loops stay in memory on PoCL, at a third of the speed).
    Per input index it converts each group's 16 quants once, scaled by their blocks' scales
    (and the norm weight), and adds them times x, broadcast, to every row's sums: R FMAs per
    group load. Rows past M repeat row M-1 and are not stored. With a norm, a row's 1/RMS
    multiplies its sums at the end. `block_span`: see tile_sums.

    Every output's sum is the same sequence of FMAs whatever R and P are, so a row's result
    does not depend on how many rows share the call (batch invariance). With x in Q8_0 the
    products of a block are summed exactly (integer-valued floats below 2^24, or VPDPBUSD's
    integers with `dp4`), then scaled by both blocks' scales. The dp4 sums start from, or
    take, the sums of x's quants per weight sub-block (_dp4_tile_sums, _dp4_block_tile_sums),
    which the work-group takes once per R rows into local memory, between barriers, instead
    of every work-item by VPDPBUSD per row and word. With `q8_out` the work-group's SwiGLU rows
    go through work-group memory, whose Q8_0 blocks its work-items then write in turn
    (_GroupActs)."""
    u0 = kb.let("u0", (kb.gid(0) * items + kb.lid(0)) * P)
    dtype = t.weights[0].dtype
    sub = DType.Q8_0.block_size if dtype is DType.Q8_0 else DECODERS[dtype].sub
    n_sub = t.k // sub
    sums = kb.array("x_sums", I32, R * n_sub, scope="local") if dp4 else None
    acts = _GroupActs(kb.array("acts", F32, R * items * P * COLS, scope="local"), items, P) if t.q8_out else None
    if sums is None and acts is None:
        kb.return_if(u0 >= t.units)
    first = kb.let("first", kb.gid(1) * span)
    with kb.loop("r0", first, minimum(first + span, M), R) as r0:
        if sums is None and acts is None:
            _tile_rows(kb, t, M, R, P, bufs, r0, u0, dp4, block_span)
        else:
            if sums is not None:
                _x_block_sums(kb, bufs["x"], sums, r0, M, R, n_sub, sub, -128 if dtype is DType.Q8_0 else 1, items)
                kb.barrier()
            with kb.if_(u0 < t.units):
                _tile_rows(kb, t, M, R, P, bufs, r0, u0, dp4, block_span, sums, acts)
            kb.barrier()  # before the next rows' sums overwrite these, or after the rows' SwiGLU
            if acts is not None:
                acts.store_q8(kb, t.widths[0], M, R, r0, bufs[tile_out(t, 0)])
                kb.barrier()


def _x_block_sums(kb: KernelBuilder, x: Buffer, sums: Array, r0: K, M: K, R: int, n_sub: int, sub: int,
                  factor: int, items: int) -> None:
    """`factor` times the sum of the quants of each `sub` elements (a Q8_0 block, or half of
    one) of x's rows r0 .. r0+R-1 (rows past M read as row M-1, as the tile reads them) into
    sums[r * n_sub + i], the work-group's items taking every items-th."""
    per_block = DType.Q8_0.block_size // sub
    with kb.loop("i", kb.lid(0), R * n_sub, items) as i:
        part = i % n_sub
        row = cast(I64, minimum(r0 + i / n_sub, M - 1))
        at = kb.let("x_at", (row * (n_sub // per_block) + part / per_block) * Q8_BLOCK + 2 + part % per_block * sub)
        total = kb.let("x_total", const(0))
        with kb.loop("e", 0, sub) as e:
            kb.set(total, total + x.load(at + e, "i8"))
        sums[i] = total * factor


def clamp_to_last(i: K, count: K | int, step: int) -> K:
    """Index i of a run of `step` from a multiple of `step`, or the last index (count - 1)
    where such a run can pass it: none can where `count` is a constant that `step` divides.
    Unclamped, a tile's groups and rows sit at constant strides from its first, which LLVM
    folds into each load's displacement; clamped, PoCL computed a decode tile's four group
    addresses in a vector register and extracted them per load (a one-row Q4_K product from
    cache 12% slower); a verify tile's rows are the same case (8 row offsets)."""
    size = count if isinstance(count, int) else count.arg if count.op == "const" else None
    return i if size is not None and size % step == 0 else minimum(i, count - 1)


def _tile_rows(kb: KernelBuilder, t: Tiled, M: K, R: int, P: int, bufs: dict, r0: K, u0: K, dp4: bool,
               block_span: int, x_sums: Array | None = None, acts: "_GroupActs | None" = None) -> None:
    """Rows r0 .. r0+R-1 of the work-item's units (_tiles); `x_sums` those rows' sub-block
    sums (_x_block_sums) for the dp4 sums; `acts` where the SwiGLU goes with q8_out."""
    x, w = bufs["x"], bufs["w"]
    dtype = t.weights[0].dtype
    k, nb = t.k, t.k // dtype.block_size
    x_q8 = t.x.dtype is DType.Q8_0
    V = F32.vec(COLS)
    rows = [kb.let(f"xr{r}", cast(I64, clamp_to_last(r0 + r, M, R))) for r in range(R)]
    # the work-item's groups: unit u is group u, or gate group u and up group u + starts[1]
    slots = [(p, m) for p in range(P) for m in ((0, 1) if t.swiglu else (0,))]
    group = [clamp_to_last(u0 + p, t.units, P) + (t.starts[1] if m else 0) for p, m in slots]
    base = [kb.let(f"wg{j}", cast(I64, g) * group_bytes(dtype, k)) for j, g in enumerate(group)]
    G = len(slots)
    inv = [inverse_rms_lanes(kb, x, rows[r] * k, k, t.norm[1], name=f"ss{r}") for r in range(R)] if t.norm else []
    acc = {(r, j): kb.let(f"acc{r}_{j}", cast(V, 0.0)) for r in range(R) for j in range(G)}
    norm_at = None
    if t.norm:
        def norm_at(i: K) -> K:
            return weight_at(t.norm[0], bufs["norm"], const(0), i, k)
    q8_x = (x, [row * (k // 32) for row in rows]) if x_q8 else None
    tile_sums(kb, [(w, b) for b in base], nb, acc, R, lambda r, i: x[rows[r] * k + i], norm_at, q8_x, dp4, dtype,
              block_span, x_sums, unroll_runs=block_span > 0 and dtype in RUNS_UNROLLED)
    _store_tiles(kb, t, M, R, r0, u0, slots, acc, inv, bufs, acts)


@dataclass(frozen=True)
class _GroupActs:
    """With q8_out, the SwiGLU of R rows of a work-group's `items` x P units, row by row in
    work-group memory: each work-item writes its units' columns, then the work-items write
    the rows' Q8_0 blocks in turn (a unit's 16 columns are half a block)."""

    values: Array
    items: int
    P: int

    @property
    def width(self) -> int:
        return self.items * self.P * COLS

    def at(self, kb: KernelBuilder, r: int, p: int) -> K:
        """Where row r of the work-item's unit p starts."""
        return r * self.width + (kb.lid(0) * self.P + p) * COLS

    def store_q8(self, kb: KernelBuilder, n: int, M: K, R: int, r0: K, out: Buffer) -> None:
        """Rows r0 .. r0+R-1 (those below M) as Q8_0 blocks of out, n columns wide."""
        per_row = self.width // Q8_VALUES
        first = kb.let("qfirst", kb.gid(0) * per_row)
        with kb.loop("qi", kb.lid(0), R * per_row, self.items) as i:
            r, b = i / per_row, i % per_row
            with kb.if_((r0 + r < M) & ((first + b) * Q8_VALUES < n)):
                store_q8_block(kb, out, cast(I64, r0 + r) * (n // Q8_VALUES) + first + b,
                               lambda e: self.values[r * self.width + b * Q8_VALUES + e])


def tile_sums(kb: KernelBuilder, groups: list[tuple[Buffer, K]], nb: K | int, acc: dict, R: int,
              x_at: Callable[[int, K], K], norm_at: Callable[[K], K] | None = None,
              q8_x: tuple[Buffer, list[K]] | None = None, dp4: bool = False, dtype: DType = DType.Q8_0,
              block_span: int = 0, x_sums: Array | None = None, unroll_runs: bool = False) -> None:
    """The inner loops of a CPU tile (dense products and the expert products of kernels/moe.py):
    for blocks 0 .. nb-1 of each group j (its buffer, and the byte of its first block in
    quant.pack_q8_0_cols16's layout), add the products of its 16 rows with x row r (`x_at(r,
    i)`: element i, f32) into the 16-wide sums acc[r, j], one FMA per input index in order (a
    row's sums are the same sequence of FMAs whatever R is). `norm_at(i)`: a norm weight folded
    into the weights. `q8_x` (x's buffer in Q8_0 blocks, each row's first block): exact
    integer block sums, scaled by both scales; with `dp4` (the weights in the dp4 layout) the
    integer sums are VPDPBUSD's (_dp4_tile_sums), the same integers. Another block `dtype`
    (quant.pack_blocks_cols16's layout) is decoded by _block_tile_sums, `block_span` elements
    at a time unrolled (the lowering's, for a decode's product; 0: a loop); with `q8_x` by
    _q8_x_block_tile_sums, or _dp4_block_tile_sums on its dp4 pack, with its runs of 32
    unrolled where `unroll_runs` (a dense decode's, of RUNS_UNROLLED). Either dp4 form reads
    x's sub-block sums from `x_sums` (_x_block_sums) where given."""
    V = F32.vec(COLS)
    G = len(groups)
    if dtype is not DType.Q8_0 and q8_x:
        if dp4:
            _dp4_block_tile_sums(kb, dtype, groups, nb, acc, R, q8_x, x_sums, unroll_runs)
        else:
            _q8_x_block_tile_sums(kb, dtype, groups, nb, acc, R, q8_x, unroll_runs)
        return
    if dtype is not DType.Q8_0:
        _block_tile_sums(kb, dtype, groups, nb, acc, R, x_at, norm_at, block_span)
        return
    if dp4:
        _dp4_tile_sums(kb, groups, nb, acc, R, q8_x, x_sums)
        return
    with kb.loop("b", 0, nb) as b:
        at, scale = _group_block(kb, groups, b)
        if q8_x:
            x, firsts = q8_x
            dot = {key: kb.let(f"dot{key[0]}_{key[1]}", cast(V, 0.0)) for key in acc}
            xb = [kb.let(f"xb{r}", (firsts[r] + b) * Q8_BLOCK) for r in range(R)]
        with kb.loop("kk", 0, 32, unroll=UNROLL) as kk:  # not unrolled, PoCL ran this loop 4x slower
            quant = [cast(V, w.load(at[j] + 2 * COLS + kk * COLS, "i8", COLS)) for j, (w, _) in enumerate(groups)]
            if norm_at:
                nw = kb.let("nw", norm_at(b * 32 + kk))
            wv = [kb.let(f"w{j}", quant[j] if q8_x else quant[j] * scale[j] * nw if norm_at else quant[j] * scale[j])
                  for j in range(G)]
            for r in range(R):
                xv = kb.let(f"x{r}", cast(F32, x.load(xb[r] + 2 + kk, "i8")) if q8_x else x_at(r, b * 32 + kk))
                for j in range(G):
                    target = dot[r, j] if q8_x else acc[r, j]
                    kb.set(target, call("fma", wv[j], xv, target))
        if q8_x:
            for r in range(R):
                dx = kb.let(f"dx{r}", x.load(xb[r] / 2, "f16"))
                for j in range(G):
                    kb.set(acc[r, j], call("fma", dot[r, j], scale[j] * dx, acc[r, j]))


def _block_tile_sums(kb: KernelBuilder, dtype: DType, groups: list[tuple[Buffer, K]], nb: K | int, acc: dict,
                     R: int, x_at: Callable[[int, K], K], norm_at: Callable[[K], K] | None, block_span: int) -> None:
    """tile_sums over a block type's pack: per block and sub-block, each group's 16 scales and
    offsets decoded once as vectors (the block decoder run lane-wise, access.Cols16Loads), then
    per input index its 16 codes, value = scale * code + offset in ggml's order, and one FMA
    per row and group, as for Q8_0. A product of one row (a decode, where the decoding is the
    cost) unrolls `block_span` elements (the lowering's) here with constant positions, so their
    byte offsets and shifts fold to constants (kir/simplify.py's bit rules) and elements
    sharing a byte share its load; more rows amortise the decoding over the rows, and keep a
    loop, as does a prefill's one-row tile (an unrolled kernel costs seconds of compile time).
    Either way the same FMAs in the same order."""
    fmt = DECODERS[dtype]
    size, words = dtype.block_size, dtype.block_bytes // 2
    unrolled = block_span > 0
    span = min(size, max(block_span, fmt.sub)) if unrolled else fmt.sub
    G = len(groups)

    def element(blocks: list[Cols16Loads], scale: list[K], offset: list[K] | None, i: K, pos: K, e: K | int,
                name: str) -> None:
        """Input index pos + e (element i of the block) of every row and group."""
        if norm_at:
            nw = kb.let(f"nw{name}", norm_at(pos + e))
        wv = []
        for j, blk in enumerate(blocks):
            value = scale[j] * fmt.code(blk, i)
            value = value + offset[j] if offset else value
            wv.append(kb.let(f"w{j}{name}", value * nw if norm_at else value))
        for r in range(R):
            xv = kb.let(f"x{r}{name}", x_at(r, pos + e))
            for j in range(G):
                kb.set(acc[r, j], call("fma", wv[j], xv, acc[r, j]))

    with kb.loop("b", 0, nb) as b:
        blocks = [Cols16Loads(w, kb.let(f"at{j}", base / 2 + b * (words * COLS))) for j, (w, base) in enumerate(groups)]
        with kb.loop("c", 0, size // span) as c:
            pos = kb.let("pos", b * size + (c << (span.bit_length() - 1)))
            for p in range(span // fmt.sub):
                sub = (c << ((span // fmt.sub).bit_length() - 1)) | p
                scale = [kb.let(f"sc{j}_{p}", fmt.scale(blk, sub)) for j, blk in enumerate(blocks)]
                offset = [kb.let(f"of{j}_{p}", fmt.offset(blk, sub)) for j, blk in enumerate(blocks)] if fmt.offset else None
                if unrolled:  # i as bits, for the simplifier to split into c's part and e
                    for e in range(p * fmt.sub, (p + 1) * fmt.sub):
                        element(blocks, scale, offset, (c << (span.bit_length() - 1)) | e, pos, e, f"_{e}")
                else:
                    with kb.loop("e", 0, fmt.sub, unroll=UNROLL) as e:
                        element(blocks, scale, offset, kb.let("i", c * span + e), pos, e, "")


def _sub_parts(kb: KernelSpec, dtype: DType, blocks: list, s: K, h: int) -> tuple[list[K], list[K] | None]:
    """Sub-block s's 16 scales and 16 offsets (None without a min) of each group's block (h:
    which half of x's block it is, for the names)."""
    fmt = DECODERS[dtype]
    scale = [kb.let(f"sc{j}_{h}", fmt.scale(blk, s)) for j, blk in enumerate(blocks)]
    offset = [kb.let(f"of{j}_{h}", fmt.offset(blk, s)) for j, blk in enumerate(blocks)] if fmt.offset else None
    return scale, offset


def _q8_x_block_sums(kb: KernelSpec, acc: dict, R: int, G: int, x: Buffer, xb: list[K], dot: dict, xsum: list,
                     scale: list[K], offset: list | None, h: int) -> None:
    """A sub-block's integer sums (f32 or i32, xsum[r] scalar or as 16 equal lanes) into the f32
    sums: dot * (d_w * d_x) [+ m_w * (d_x * Σ q_x)]."""
    V = F32.vec(COLS)
    for r in range(R):
        dx = kb.let(f"dx{r}_{h}", x.load(xb[r] / 2, "f16"))
        xs = kb.let(f"xs{r}_{h}", dx * cast(F32.vec(xsum[r].dtype.lanes), xsum[r])) if offset else None
        for j in range(G):
            kb.set(acc[r, j], call("fma", cast(V, dot[r, j]), scale[j] * dx, acc[r, j]))
            if offset:
                kb.set(acc[r, j], call("fma", offset[j], cast(V, xs), acc[r, j]))


def _q8_x_tile_blocks(kb: KernelSpec, dtype: DType, groups: list[tuple[Buffer, K]], nb: K | int, R: int,
                      firsts: list[K], reader, body: Callable, unroll_runs: bool) -> None:
    """The loops of a Q8_X_TYPES tile over Q8_0 x: weight blocks b, each group's block read
    through `reader(buffer, u16 index of the block)`, and its runs s of 32 elements, each with
    the Q8_0 block of x it meets: body(blocks, s, xb, run), xb[r] row r's x block (a byte),
    `run` that block's index from the row's first. `unroll_runs` unrolls the runs (a dense
    decode's product over RUNS_UNROLLED). The expert tiles keep the loop: a 35B-shaped MoE
    decode (Q4_K / Q6_K experts) took 0.84 ms with it, 0.99 unrolled (medians, alternated);
    and so does a prefill's one-row tile (an unrolled kernel costs compile time)."""
    runs = dtype.block_size // 32
    with kb.loop("b", 0, nb) as b:
        blocks = [reader(w, kb.let(f"at{j}", base / 2 + b * (dtype.block_bytes // 2 * COLS)))
                  for j, (w, base) in enumerate(groups)]
        with kb.loop("s", 0, runs, unroll=runs if unroll_runs else 0) as s:
            run = kb.let("run", b * runs + s)
            xb = [kb.let(f"xb{r}", (firsts[r] + run) * Q8_BLOCK) for r in range(R)]
            body(blocks, s, xb, run)


def _q8_x_block_tile_sums(kb: KernelSpec, dtype: DType, groups: list[tuple[Buffer, K]], nb: K | int, acc: dict,
                          R: int, q8_x: tuple[Buffer, list[K]], unroll_runs: bool) -> None:
    """tile_sums of a Q8_X_TYPES block type's pack (quant.pack_blocks_cols16) over Q8_0 x: per
    sub-block (32 elements, or each 16-element half of x's block), each code times x's quant
    summed exactly (integer-valued f32, below 2^24), and x's quants summed where the type has
    a min; then _q8_x_block_sums. The same integers as _dp4_block_tile_sums', so the same
    outputs bit for bit."""
    fmt, V, G = DECODERS[dtype], F32.vec(COLS), len(groups)
    x, firsts = q8_x
    halves = 32 // fmt.sub

    def body(blocks, s, xb, _run):
        for h in range(halves):
            scale, offset = _sub_parts(kb, dtype, blocks, s * halves + h, h)
            dot = {key: kb.let(f"dot{key[0]}_{key[1]}_{h}", cast(V, 0.0)) for key in acc}
            xsum = [kb.let(f"xsum{r}_{h}", 0.0) for r in range(R)] if offset else []
            with kb.loop("e", h * fmt.sub, (h + 1) * fmt.sub, unroll=UNROLL) as e:
                code = [kb.let(f"w{j}", fmt.code(blk, s * 32 + e)) for j, blk in enumerate(blocks)]
                for r in range(R):
                    xv = kb.let(f"x{r}", cast(F32, x.load(xb[r] + 2 + e, "i8")))
                    if offset:
                        kb.set(xsum[r], xsum[r] + xv)
                    for j in range(G):
                        kb.set(dot[r, j], call("fma", code[j], xv, dot[r, j]))
            _q8_x_block_sums(kb, acc, R, G, x, xb, dot, xsum, scale, offset, h)

    _q8_x_tile_blocks(kb, dtype, groups, nb, R, firsts, Cols16Loads, body, unroll_runs)


ONES = 0x01010101  # VPDPBUSD against bytes of 1: the sum of four signed bytes


def _dp4_block_tile_sums(kb: KernelSpec, dtype: DType, groups: list[tuple[Buffer, K]], nb: K | int, acc: dict,
                         R: int, q8_x: tuple[Buffer, list[K]], x_sums: Array | None, unroll_runs: bool) -> None:
    """_q8_x_block_tile_sums with VPDPBUSD on a 4-to-6-bit type's dp4 pack
    (quant.pack_blocks_cols16_dp4, read as quant.DP4_TYPES says): per four codes, a 32-bit
    word per lane of their unsigned bytes (masks and shifts of the pack's words, each loaded
    once per run of 32), multiplied with x's signed quants; a code bias (-8, -16, -32) comes
    off as bias * Σ q_x, that sum (also the min's) from `x_sums` (x's sums per sub-block,
    _x_block_sums) where given, else taken by the same instruction on bytes of 1."""
    I, G = I32.vec(COLS), len(groups)
    words, fmt = DP4_TYPES[dtype], DECODERS[dtype]
    x, firsts = q8_x
    quads = fmt.sub // 4  # quads of codes per sub-block
    halves = 8 // quads  # sub-blocks per run of 32
    n_sub = nb * (dtype.block_size // fmt.sub)  # a row's sub-blocks, x_sums' stride

    def body(blocks, s, xb, run):
        loaded = [{} for _ in blocks]  # each group's words of this run, loaded once

        def word(j):
            def load(i):
                if i not in loaded[j]:
                    loaded[j][i] = kb.let(f"wd{j}_{len(loaded[j])}", blocks[j].word(i))
                return loaded[j][i]
            return load
        for h in range(halves):
            scale, offset = _sub_parts(kb, dtype, blocks, s * halves + h, h)
            dot = {key: kb.let(f"dot{key[0]}_{key[1]}_{h}", cast(I, 0)) for key in acc}
            if x_sums:
                xsum = [kb.let(f"xsum{r}_{h}", x_sums[r * n_sub + run * halves + h]) for r in range(R)]
            else:
                xsum = [kb.let(f"xsum{r}_{h}", cast(I, 0)) for r in range(R)]
            for q in range(h * quads, (h + 1) * quads):
                codes = [kb.let(f"c{j}_{q}", words.codes(word(j), s, q)) for j in range(G)]
                for r in range(R):  # x's word q, broadcast by the instruction (dpbusd_at)
                    if not x_sums:
                        kb.set(xsum[r], dpbusd_at(xsum[r], cast(I, ONES), x, xb[r] + 2 + 4 * q))
                    for j in range(G):
                        kb.set(dot[r, j], dpbusd_at(dot[r, j], codes[j], x, xb[r] + 2 + 4 * q))
            if words.bias:
                for key in acc:
                    kb.set(dot[key], dot[key] - xsum[key[0]] * words.bias)
            _q8_x_block_sums(kb, acc, R, G, x, xb, dot, xsum, scale, offset, h)

    _q8_x_tile_blocks(kb, dtype, groups, nb, R, firsts, lambda w, at: Dp4Loads(w, at, words, dtype.block_bytes), body,
                      unroll_runs)


def _group_block(kb: KernelSpec, groups: list[tuple[Buffer, K]], b: K) -> tuple[list[K], list[K]]:
    """Each group's block b in a quant.pack_q8_0_cols16 layout: its first byte and its 16
    scales."""
    at = [kb.let(f"at{j}", base + b * COLS_BLOCK_BYTES) for j, (_, base) in enumerate(groups)]
    return at, [kb.let(f"d{j}", w.load(at[j] / 2, "f16", COLS)) for j, (w, _) in enumerate(groups)]


def _dp4_tile_sums(kb: KernelSpec, groups: list[tuple[Buffer, K]], nb: K | int, acc: dict, R: int,
                   q8_x: tuple[Buffer, list[K]], x_sums: Array | None) -> None:
    """tile_sums over Q8_0 x with VPDPBUSD (unsigned x signed bytes, four per 32-bit lane): the
    dp4 pack holds the weights' quants w as the unsigned bytes w + 128, and x's quants q are
    the signed operand as they are, each word broadcast from memory by the instruction
    (dpbusd_at), so a row's word costs one instruction and no register broadcast. A block's
    sum starts from -128 sum(q) (x_sums, taken once per work-group) and so ends at the exact
    integer sum(w q): the block sums, and everything after them, equal tile_sums' f32 ones
    bit for bit. Without x_sums (the expert tiles, whose rows are picked per expert) each
    row's sum(q) comes from the same instruction on bytes of 1, taken off at the end: the
    same integers."""
    V, I = F32.vec(COLS), I32.vec(COLS)
    x, firsts = q8_x
    with kb.loop("b", 0, nb) as b:
        at, scale = _group_block(kb, groups, b)
        xb = [kb.let(f"xb{r}", (firsts[r] + b) * Q8_BLOCK) for r in range(R)]
        dot = {key: kb.let(f"dot{key[0]}_{key[1]}", cast(I, x_sums[key[0] * nb + b] if x_sums else 0))
               for key in acc}
        xsum = None if x_sums else [kb.let(f"xsum{r}", cast(I, 0)) for r in range(R)]
        with kb.loop("k4", 0, 8, unroll=UNROLL) as k4:
            wv = [kb.let(f"w{j}", w.load((at[j] + 2 * COLS) / 4 + k4 * COLS, "i32", COLS))
                  for j, (w, _) in enumerate(groups)]
            for r in range(R):
                if xsum:
                    kb.set(xsum[r], dpbusd_at(xsum[r], cast(I, ONES), x, xb[r] + 2 + 4 * k4))
                for j in range(len(groups)):
                    kb.set(dot[r, j], dpbusd_at(dot[r, j], wv[j], x, xb[r] + 2 + 4 * k4))
        for r in range(R):
            dx = kb.let(f"dx{r}", x.load(xb[r] / 2, "f16"))
            for j in range(len(groups)):
                total = dot[r, j] - xsum[r] * 128 if xsum else dot[r, j]
                kb.set(acc[r, j], call("fma", cast(V, total), scale[j] * dx, acc[r, j]))


def _store_tiles(kb: KernelBuilder, t: Tiled, M: K, R: int, r0: K, u0: K, slots, acc, inv, bufs,
                 acts: _GroupActs | None = None) -> None:
    """Each valid row's sums, lane by lane, into the output their group belongs to (with
    `acts`, the SwiGLU into the work-group's rows there)."""
    lanes = kb.array("lanes", F32, COLS)
    up_lanes = kb.array("up_lanes", F32, COLS) if t.swiglu else None
    outs, residual = [bufs[tile_out(t, i)] for i in range(t.n_outs)], bufs.get("residual")
    for r in range(R):
        scale = inv[r] if inv else None
        for j, (p, m) in enumerate(slots):
            if m:  # the up half of a pair: stored with its gate half
                continue
            with kb.if_((r0 + r < M) & (u0 + p < t.units)):
                kb.set(lanes.vec(0, COLS), acc[r, j] * scale if scale is not None else acc[r, j])
                if t.swiglu:
                    kb.set(up_lanes.vec(0, COLS), acc[r, j + 1] * scale if scale is not None else acc[r, j + 1])
                if acts is not None:
                    at = kb.let("at", acts.at(kb, r, p))
                    with kb.loop("e", 0, COLS) as e:
                        acts.values[at + e] = activations.swiglu(KERNEL, lanes[e], up_lanes[e])
                    continue
                for i, out in enumerate(outs):
                    _store_member(kb, t, i, out, r0 + r, u0 + p, lanes, up_lanes, residual)


def _store_member(kb: KernelBuilder, t: Tiled, i: int, out: Buffer, row: K, unit: K, lanes, up_lanes,
                  residual) -> None:
    """The lanes of unit `unit` that fall in output i (weight i's groups), masked to its width."""
    first, width = t.starts[i], t.widths[i]

    def lanes_out() -> None:
        with kb.loop("e", 0, COLS, cond=lambda e: (unit - first) * COLS + e < width) as e:
            at = cast(I64, row) * width + (unit - first) * COLS + e
            value = lanes[e]
            if t.swiglu:
                value = activations.swiglu(KERNEL, value, up_lanes[e])
            out[at] = value + residual[at] if residual is not None else value

    if t.n_outs == 1:
        lanes_out()
        return
    with kb.if_((unit >= first) & (unit < first + -(-width // COLS))):
        lanes_out()


@lowers("fused_matmul")
def fused_matmul(ctx: NodeCtx) -> None:
    """One kernel with the norm and the SwiGLU inside: the CPU tiles (block-type weights; with
    `swiglu_q8` the SwiGLU quantised too) and the GPU GEMV (a few rows; x in f32, or in Q8_0
    blocks without the norm: the q8 numerics' SwiGLU, quantised by a launch of its own, as the
    GEMV's work-groups hold fewer than a block's 32 columns). Elsewhere (a prefill's GEMM) the
    parts' kernels (kernels/fused.py)."""
    a = ctx.attr
    x, *operands = ctx.ins
    norm = (operands[0], a["norm_eps"]) if a["norm_eps"] is not None else None
    weights = operands[1:] if norm else operands
    q8_out = a["epilogue"] == "swiglu_q8"
    cpu_tiles = ctx.profile == "cpu" and tiled(weights[0])
    gpu_gemv = ctx.profile == "gpu" and a["form"] == "gemv" and (x.type.dtype is DType.F32 or norm is None)
    if not (cpu_tiles or gpu_gemv):
        fused_matmul_parts(ctx)
        return
    if gpu_gemv and q8_out:
        act = ctx.temp(TensorType(DType.F32, ctx.outs[0].type.shape))
        _matmul(ctx, x, weights, [act], [], norm=norm, swiglu=True)
        ctx.sub("quantize_q8_0", act, outputs=ctx.outs)
        return
    _matmul(ctx, x, weights, ctx.outs, [], norm=norm, swiglu=a["epilogue"] != "none", q8_out=q8_out)


@lowers("matmul_group")
def matmul_group(ctx: NodeCtx) -> None:
    x, *weights = ctx.ins
    _matmul(ctx, x, weights, ctx.outs, [])


def rowwise_groups(M: K, n: Dim, rows: int) -> list[K]:
    """The work-group grid of _rowwise for M rows of output width n."""
    return [cdiv(M, rows), cdiv(dim(n), ROWWISE_COLS)]


def _rowwise(kb: KernelSpec, dtype: DType, M: K, n: Dim, k: Dim, R: int, store: Store, w: Buffer, x: Buffer,
             wrow: Callable[[K, K], K] = lambda n, r0: n, xrow: Callable[[K], K] | None = None) -> None:
    """CPU schedule of x @ wᵀ, any row count: a work-item owns output column n for a block of
    R rows, converts each 32-element chunk of w's row n once and applies it to every row
    of the block, accumulating into independent sums per row, which a CPU compiler turns
    into vector FMAs (one running sum would be a serial dependency chain).
    Work-groups are numbered row-block fastest, so consecutive ones read the same
    ROWWISE_COLS weight rows, from cache after the first. Without a ragged K tail the
    chunk loops have constant trip counts, which is what lets them vectorise. `wrow(n)` is
    the weight row of column n (given r0 for R = 1), `xrow(row)` the offset of x's row,
    `store` writes a row's column n.

    Weights in f32, f16 or bf16 (Q8_0 products are the register tiles). Every row is
    computed the same way whatever R is (the same sums in the same order), so a row's
    result does not depend on how many rows share the call: a verify row equals the decode
    of the same token, bit for bit."""
    xrow = xrow or (lambda row: cast(I64, row) * dim(k))
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
        if dtype in DECODERS:  # whole blocks: sub-block scales decoded once per 16 or 32 elements
            weight_chunk(kb, dtype, w, wrow(n_col, r0), c, k, wv, "w")
        else:
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


@lowers("matmul")
def matmul(ctx: NodeCtx) -> None:
    matmul_launch(ctx)


@lowers(*OPS.values())
def matmul_specialised(ctx: NodeCtx) -> None:
    """`form` chooses the GPU kernel (_matmul)."""
    matmul_launch(ctx)


def _gemm(kb: KernelSpec, dtype: DType, M: K, n: Dim, k: Dim, store: Store, x: Buffer, w: Buffer,
          x_q8: bool) -> None:
    """Tiled x @ wᵀ: each work-group stages a TILE x TILE block of x rows and of (dequantised)
    w rows per K step in local memory; each thread accumulates a 2x2 patch of outputs.
    With x_q8 (TILE = one Q8_0 block) and Q8_0 weights the staged values are the int8 quants
    of x and w and each K step adds an exact integer dot (in f32: |sum| < 2^24) times both
    scales; other weights take x's values d_x * q."""
    N, K_, P = dim(n), dim(k), TILE + 1  # padded rows avoid local-memory bank conflicts
    per = TILE // THREADS
    tx, ty = kb.let("tx", kb.lid(0)), kb.let("ty", kb.lid(1))
    tid = kb.let("tid", ty * THREADS + tx)
    n0, m0 = kb.let("n0", kb.gid(0) * TILE), kb.let("m0", kb.gid(1) * TILE)
    xs, ws = kb.array("xs", F32, TILE * P, "local"), kb.array("ws", F32, TILE * P, "local")
    x_values = x_q8 and dtype is not DType.Q8_0
    x_q8 = x_q8 and not x_values  # from here: the integer path of two Q8_0 operands
    if x_q8:
        xd, wd = kb.array("xd", F32, TILE, "local"), kb.array("wd", F32, TILE, "local")
    acc = kb.array("acc", F32, per * per)
    with kb.loop("a", 0, per * per) as a:
        acc[a] = 0.0

    def block_byte(row: K, k0: K) -> K:
        return cast(I64, row) * q8_row_bytes(k) + (k0 / 32) * Q8_BLOCK

    with kb.loop("k0", 0, K_, TILE) as k0:
        with kb.loop("e", tid, TILE * TILE, THREADS * THREADS) as e:
            rr, kk = kb.let("rr", e / TILE), kb.let("kk", e % TILE)
            kc, m, nn = kb.let("k", k0 + kk), kb.let("m", m0 + rr), kb.let("nr", n0 + rr)
            if x_q8:
                x_value = cast(F32, x.load(block_byte(m, kc) + 2 + kk, "i8"))
                w_value = cast(F32, w.load(block_byte(nn, kc) + 2 + kk, "i8"))
            else:
                x_value = weight_at(DType.Q8_0, x, m, kc, k) if x_values else x[cast(I64, m) * K_ + kc]
                w_value = weight_at(dtype, w, nn, kc, k)
            xs[rr * P + kk] = select((m < M) & (kc < K_), x_value, 0.0)
            ws[rr * P + kk] = select((nn < N) & (kc < K_), w_value, 0.0)
        if x_q8:
            with kb.if_(tid < TILE):
                m, nn = kb.let("ms", m0 + tid), kb.let("ns", n0 + tid)
                xd[tid] = select(m < M, x.load(block_byte(m, k0) / 2, "f16"), 0.0)
                wd[tid] = select(nn < N, w.load(block_byte(nn, k0) / 2, "f16"), 0.0)
        kb.barrier()
        if x_q8:
            for a in range(per):
                for b in range(per):
                    xa, wb = (ty + a * THREADS) * P, (tx + b * THREADS) * P
                    s = kb.let(f"s{a}{b}", 0.0)
                    with kb.loop("kk", 0, TILE) as kk:
                        kb.set(s, s + xs[xa + kk] * ws[wb + kk])
                    acc[a * per + b] = acc[a * per + b] + s * xd[ty + a * THREADS] * wd[tx + b * THREADS]
        else:
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

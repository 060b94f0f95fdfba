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

from dflash_ir.dtypes import DType
from dflash_ir.types import Dim

from ..lowering import NodeCtx, lowers
from .common import cdiv, dim, flat_launch, prod, q8_0_split_at, q8_row_bytes, weight_at

GEMV_ROWS = 16    # rows a GEMV work-group serves (as passes/specialise_q8_0); more take the tiled GEMM
GEMV_THREADS = 256
TILE = 32         # GEMM output tile (TILE x TILE) and K step
THREADS = 16      # GEMM work-group is THREADS x THREADS, each thread 2x2 outputs
ROWWISE_COLS = 128  # CPU schedule: output columns per work-group ...
ROWWISE_ROWS = 8  # ... and rows per work-item


@lowers("dequantize")
def dequantize(ctx: NodeCtx) -> None:
    w = ctx.ins[0]
    k = w.type.shape[-1]
    flat_launch(ctx, f"  out[i] = {weight_at(w.type.dtype, 'x0', f'i / {dim(k)}', f'i % {dim(k)}', k)};\n")


@lowers("embedding")
def embedding(ctx: NodeCtx) -> None:
    """On the CPU profile a Q8_0 table is read in the split layout, the one the (tied)
    output head's matmul reads it in, so the table is on the device once."""
    table, ids = ctx.ins
    k = table.type.shape[1]
    ctx.check("index", ids, size=dim(table.type.shape[0]))
    row, col = f"x1[i / {dim(k)}]", f"i % {dim(k)}"
    if ctx.profile == "cpu" and table.type.dtype is DType.Q8_0:
        packed, blocks = _split_q8_0(ctx, [table])
        flat_launch(ctx, f"  out[i] = {q8_0_split_at('x0', row, col, k, blocks)};\n", inputs=[packed, ids])
        return
    flat_launch(ctx, f"  out[i] = {weight_at(table.type.dtype, 'x0', row, col, k)};\n")


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


def _gemv_body(g: Gemv, rows: int, count: str, n_total: str, prologue: str, wrow: str, xrow: str, out: str,
               act_quant: bool = False) -> str:
    """Column n, rows r0 .. r0+rows-1 (< count): each lane accumulates its chunks for every
    row, then a tree reduction over the column's lanes. `wrow` is the weight row of column n,
    `xrow` the offset of x's row `row` in x, `out` a store statement of `row` and a value.
    With act_quant each x block is quantised to int8 as quantize_row_q8_0 does and the
    block dot is an exact integer sum of DOT4_I8s."""
    K, L = dim(g.k), g.lanes
    chunks = f"({K} / 32)" if g.dtype is DType.Q8_0 else K
    if g.dtype is DType.Q8_0:
        block = (f"    i64 blk = I64({wrow}) * {q8_row_bytes(g.k)} + c * 34;\n"
                 f"    float d = HALF_AT_BYTE(w, blk);\n")
        if act_quant:
            load = block + ("    int wq[8];\n    for (int e = 0; e < 8; ++e)\n"
                            "      wq[e] = LD_U16_BYTE(w, blk + 2 + 4 * e) | (LD_U16_BYTE(w, blk + 4 + 4 * e) << 16);\n")
        else:
            load = block + ("    float wv[32];\n    for (int e = 0; e < 16; ++e) {\n"
                            "      int two = LD_U16_BYTE(w, blk + 2 + 2 * e);\n"
                            "      wv[2 * e] = F32(I8(two));\n      wv[2 * e + 1] = F32(I8(two >> 8));\n    }\n")
    else:
        load = f"    float wv[1];\n    wv[0] = {weight_at(g.dtype, 'w', wrow, 'c', g.k)};\n"
    if act_quant:
        dot = ("      float amax = 0.0f;\n      for (int e = 0; e < 32; ++e) amax = fmaxf(amax, fabsf(x[xr + e]));\n"
               "      float dx = amax / 127.0f, inv = dx != 0.0f ? 1.0f / dx : 0.0f;\n      int isum = 0;\n"
               "      for (int e = 0; e < 8; ++e) {\n        int word = 0;\n"
               "        for (int b = 0; b < 4; ++b) word |= (I32(roundf(x[xr + 4 * e + b] * inv)) & 0xff) << (8 * b);\n"
               "        isum = DOT4_I8(word, wq[e], isum);\n      }\n"
               "      acc[r] += F32(isum) * ROUND_HALF(dx) * d;\n")
    else:
        dot = (f"      float s = 0.0f;\n      for (int e = 0; e < {g.chunk}; ++e) s += wv[e] * x[xr + e];\n"
               f"      acc[r] += {'d * s' if g.dtype is DType.Q8_0 else 's'};\n")
    slot = f"(r * {g.cols} + col) * {L} + lane"
    return (f"  int lane = LID(0), col = LID(1);\n{prologue}"
            f"  LOCAL float red[{rows * GEMV_THREADS}];\n  float acc[{rows}];\n"
            f"  for (int r = 0; r < {rows}; ++r) acc[r] = 0.0f;\n"
            f"  for (int c = lane; n < {n_total} && c < {chunks}; c += {L}) {{\n{load}"
            f"    for (int r = 0; r < {rows}; ++r) {{\n      int row = r0 + r;\n      if (row >= {count}) break;\n"
            f"      i64 xr = {xrow} + c * {g.chunk};\n{dot}    }}\n  }}\n"
            f"  for (int r = 0; r < {rows}; ++r) red[{slot}] = acc[r];\n  BARRIER();\n"
            f"  for (int s = {L // 2}; s > 0; s >>= 1) {{\n"
            f"    if (lane < s) for (int r = 0; r < {rows}; ++r) red[{slot}] += red[{slot} + s];\n"
            f"    BARRIER();\n  }}\n"
            f"  for (int r = lane; r < {rows}; r += {L}) {{\n    int row = r0 + r;\n"
            f"    if (row < {count} && n < {n_total}) {out.format(f'red[(r * {g.cols} + col) * {L}]')};\n  }}\n")


def matmul_launch(ctx: NodeCtx, *, act_quant: bool = False) -> None:
    """x @ wᵀ [+ residual] for node inputs (x, w[, residual])."""
    x, w, *res = ctx.ins
    _matmul(ctx, x, [w], [ctx.outs[0]], res, act_quant)


def _matmul(ctx: NodeCtx, x, weights: list, outs: list, res: list, act_quant: bool) -> None:
    """x @ wᵀ over the rows of `weights` side by side (one weight, or a matmul_group's),
    output i getting weight i's columns. GPU profile: a GEMV for up to GEMV_ROWS rows, else
    a tiled GEMM; with a symbolic row count both are planned and the launch picks one per
    call (a prefill's single logits row is a GEMV, its 512 hidden rows a GEMM). CPU profile:
    the rowwise schedule for every row count, Q8_0 weights packed in the split layout."""
    dtype, k = weights[0].type.dtype, weights[0].type.shape[1]
    widths = [o.type.shape[-1] for o in outs]
    n = sum(widths)
    M, N, K = prod(x.type.shape[:-1]), dim(n), dim(k)
    rowwise = ctx.profile == "cpu" and not act_quant
    blocks = 0
    if rowwise and dtype is DType.Q8_0:
        w, blocks = _split_q8_0(ctx, weights)
    else:
        w = weights[0] if len(weights) == 1 else ctx.packed(weights, "as_stored")
    names = ["out"] if len(outs) == 1 else [f"out{i}" for i in range(len(outs))]
    buffers = ([("x", x, False), ("w", w, False)] + [("residual", r, False) for r in res]
               + [(name, o, True) for name, o in zip(names, outs)])
    store = _store(names, widths, res)
    fixed = int(M) if M.isdigit() else None
    if rowwise:
        for rows, when in ((1, f"{M} == 1"), (ROWWISE_ROWS, f"{M} > 1")):  # one row keeps its sums in registers
            if fixed is None or (fixed == 1) == (rows == 1):
                streams = rowwise_streams(ctx, dtype, rows, n)
                body = _rowwise_body(dtype, M, n, k, rows, store.format("s"), blocks=blocks, streams=streams)
                ctx.launch("matmul_rows", body, buffers=buffers, groups=rowwise_groups(M, n, rows, streams),
                           local=(ROWWISE_COLS,), when=None if fixed else when)
        return
    if fixed is None or fixed <= GEMV_ROWS:
        g = Gemv(dtype, k)
        rows = min(fixed, GEMV_ROWS) if fixed else GEMV_ROWS
        body = _gemv_body(g, rows, M, N, f"  int n = GID(0) * {g.cols} + col, r0 = GID(1) * {rows};\n", "n",
                          f"I64(row) * {K}", store, act_quant)
        ctx.launch("matmul_gemv", body, buffers=buffers, groups=[cdiv(N, g.cols), cdiv(M, rows)],
                   local=(g.lanes, g.cols), when=None if fixed else f"{M} <= {GEMV_ROWS}")
    if fixed is None or fixed > GEMV_ROWS:
        ctx.launch("matmul_gemm", _gemm_body(dtype, M, n, k, store.format("acc[a][b]"), act_quant), buffers=buffers,
                   groups=[cdiv(N, TILE), cdiv(M, TILE)], local=(THREADS, THREADS),
                   when=None if fixed else f"{M} > {GEMV_ROWS}")


def _store(names: list[str], widths: list[int], res: list) -> str:
    """The statement storing value {} of output column n (of all outputs side by side) and
    row `row`: one output, or a chain choosing output i for its columns."""
    if len(names) == 1:
        N = dim(widths[0])
        return f"out[I64(row) * {N} + n] = {{}}" + (f" + residual[I64(row) * {N} + n]" if res else "")
    chain, start = [], 0
    for i, (name, width) in enumerate(zip(names, widths)):
        target = f"{name}[I64(row) * {width} + n - {start}] = {{0}}"
        chain.append(target if i == len(names) - 1 else f"if (n < {start + width}) {target}; else ")
        start += width
    return "".join(chain)


@lowers("matmul_group")
def matmul_group(ctx: NodeCtx) -> None:
    x, *weights = ctx.ins
    _matmul(ctx, x, weights, ctx.outs, [], ctx.attr.get("act_quant", False))


SCALE_RUN = 16  # split Q8_0: scales converted per run of this many blocks (one 16-wide load)


def rowwise_streams(ctx: NodeCtx, dtype: DType, rows: int, n: Dim) -> int:
    """Weight rows one work-item of the CPU schedule streams at once (up to ctx.row_streams):
    a single-row Q8_0 product is bound by memory latency, and four rows far apart keep four
    prefetch streams in flight per core (a 12288x4096 GEMV from DRAM on 2 cores, PoCL:
    14.1 GB/s with one stream, 25.8 with four)."""
    wide = dtype is DType.Q8_0 and rows == 1 and isinstance(n, int) and n >= ctx.row_streams
    return ctx.row_streams if wide else 1


def rowwise_groups(M: str, n: Dim, rows: int, streams: int) -> list[str]:
    """The work-group grid of _rowwise_body for M rows of output width n."""
    width = dim(n) if streams == 1 else str(-(-n // streams))
    return [cdiv(M, rows), cdiv(width, ROWWISE_COLS)]


def _rowwise_body(dtype: DType, M: str, n: Dim, k: Dim, R: int, store: str, wrow: str = "n",
                  xrow: str = "I64(row) * {K}", blocks: int = 0, streams: int = 1) -> str:
    """CPU schedule of x @ wᵀ, any row count: a work-item owns output column n for a block of
    R rows, converts each 32-element chunk of w's row n once and applies it to every row
    of the block, accumulating into independent sums per row, which a CPU compiler turns
    into vector FMAs (one running sum would be a serial dependency chain).
    Work-groups are numbered row-block fastest, so consecutive ones read the same
    ROWWISE_COLS weight rows, from cache after the first. Without a ragged K tail the
    chunk loops have constant trip counts, which is what lets them vectorise. `wrow` is the
    weight row of column n (of `r0` too for R = 1), `xrow` the offset of x's row `row`,
    `store` a statement of `row`, column `n` and the sum `s`.

    A Q8_0 weight is read in the split layout (`blocks` blocks in all: quants, then
    scales; plan.LAYOUTS): aligned quant loads through Q8S_LOAD32, and the scales of
    SCALE_RUN blocks converted by one HALF16_AT_BYTE, where one f16 conversion per block
    cost more than the block's arithmetic. Each block's partial sums are scaled by its d
    (DOT32_ACC16) into sixteen sums per row; a single row keeps two sets (two blocks per
    step) for each of its `rowwise_streams` columns."""
    K, N = dim(k), dim(n)
    xrow = xrow.format(K=K)
    rows = f"for (int r = 0; r < {R} && r0 + r < {M}; ++r) {{\n"
    if dtype is DType.Q8_0:
        return _rowwise_q8_0(n, k, R, store, wrow, xrow, blocks, rows, streams)
    whole = isinstance(k, int) and k % 32 == 0
    value = weight_at(dtype, "w", wrow, "c + e", k)
    return (f"  int r0 = GID(0) * {R}, n = GID(1) * {ROWWISE_COLS} + LID(0);\n  if (n >= {N}) return;\n"
            f"  float acc[{R}][32];\n  for (int r = 0; r < {R}; ++r) for (int e = 0; e < 32; ++e) acc[r][e] = 0.0f;\n"
            f"  for (int c = 0; c < {K}; c += 32) {{\n"
            f"    float wv[32];\n    for (int e = 0; e < 32; ++e) wv[e] = {value if whole else f'c + e < {K} ? {value} : 0.0f'};\n"
            f"    {rows}      int row = r0 + r;\n      i64 xc = {xrow} + c;\n"
            f"      for (int e = 0; e < 32{'' if whole else f' && c + e < {K}'}; ++e) acc[r][e] += wv[e] * x[xc + e];\n"
            f"    }}\n  }}\n"
            f"  {rows}    int row = r0 + r;\n    float s = 0.0f;\n    for (int e = 0; e < 32; ++e) s += acc[r][e];\n"
            f"    {store};\n  }}\n")


def _rowwise_q8_0(n: Dim, k: int, R: int, store: str, wrow: str, xrow: str, blocks: int, rows: str, S: int) -> str:
    """The Q8_0 loops of _rowwise_body: runs of SCALE_RUN blocks, then the tail block by block,
    for S columns n0 + i·Q (i < S) per work-item, Q = ceil(N / S); a column past N reads
    row N-1 again and stores nothing."""
    N = dim(n)
    Q = -(-n // S) if S > 1 else N
    nb, run = k // 32, SCALE_RUN * 32
    full = nb // SCALE_RUN * run
    U = 2 if R == 1 else 1  # one row (decode): two blocks per step into two sums, two loads in flight

    def acc(i: int, u: int) -> str:
        return f"acc[(r * {S} + {i}) * {U} + {u}]"

    def step(c: str, scale, u_count: int) -> str:
        loads = "".join(f"      Q8S_LOAD32(wv{i}_{u}, w, qrow{i} + {c} + {32 * u});\n"
                        for i in range(S) for u in range(u_count))
        dots = "".join(f"        DOT32_ACC16({acc(i, u)}, wv{i}_{u}, {scale(i, u)}, x, xr + {c} + {32 * u});\n"
                       for i in range(S) for u in range(u_count))
        return f"{loads}      {rows}        int row = r0 + r;\n        i64 xr = {xrow};\n{dots}      }}\n"

    column = "n0" if S == 1 else f"min(n0 + {{i}} * {Q}, {N} - 1)"
    body = (f"  int r0 = GID(0) * {R}, n0 = GID(1) * {ROWWISE_COLS} + LID(0);\n  if (n0 >= {Q}) return;\n"
            f"  ACC16_ZERO(acc, {R * S * U});\n"
            + "".join(f"  i64 qrow{i}, srow{i};\n  {{\n    int n = {column.format(i=i)};\n"
                      f"    qrow{i} = I64({wrow}) * {k};\n    srow{i} = {blocks * 32} + I64({wrow}) * {nb * 2};\n  }}\n"
                      for i in range(S)))
    if full:
        body += (f"  for (int c0 = 0; c0 < {full}; c0 += {run}) {{\n"
                 + "".join(f"    HALF16_AT_BYTE(ds{i}, w, srow{i} + c0 / 16);\n" for i in range(S))
                 + f"    for (int j = 0; j < {SCALE_RUN}; j += {U}) {{\n"
                 + step("c0 + 32 * j", lambda i, u: f"ds{i}[j + {u}]", U) + "    }\n  }\n")
    if full < k:
        body += (f"  for (int c = {full}; c < {k}; c += 32) {{\n"
                 + "".join(f"    float d{i} = HALF_AT_BYTE(w, srow{i} + c / 16);\n" for i in range(S))
                 + step("c", lambda i, u: f"d{i}", 1) + "  }\n")
    stores = "".join(f"    {{\n      int n = n0 + {i * (Q if S > 1 else 0)};\n      if (n < {N}) {{\n"
                     f"        float s = {' + '.join(f'ACC16_SUM({acc(i, u)})' for u in range(U))};\n"
                     f"        {store};\n      }}\n    }}\n" for i in range(S))
    return body + f"  {rows}    int row = r0 + r;\n{stores}  }}\n"


@lowers("matmul")
def matmul(ctx: NodeCtx) -> None:
    matmul_launch(ctx)


@lowers("matmul_q8_0", "matmul_f16")
def matmul_specialised(ctx: NodeCtx) -> None:
    """The `form` attr is only a hint here: the row count is known at launch."""
    matmul_launch(ctx, act_quant=ctx.attr.get("act_quant", False))


def _gemm_body(dtype: DType, M: str, n: Dim, k: Dim, store: str, act_quant: bool) -> str:
    """Tiled x @ wᵀ: each work-group stages a TILE x TILE block of x rows and of (dequantised)
    w rows per K step in local memory; each thread accumulates a 2x2 patch of outputs.
    With act_quant (TILE = one Q8_0 block) the staged values are the int8 quants of x and w
    and each K step adds an exact integer dot (in f32: |sum| < 2^24) times both scales."""
    N, K, P = dim(n), dim(k), TILE + 1  # padded rows avoid local-memory bank conflicts
    per = TILE // THREADS
    if act_quant:
        w_value = f"F32(LD_I8(w, I64(n) * {q8_row_bytes(k)} + (k / 32) * 34 + 2 + kk))"
        quantise = (f"    if (tid < {TILE}) {{\n      float amax = 0.0f;\n"
                    f"      for (int e = 0; e < {TILE}; ++e) amax = fmaxf(amax, fabsf(xs[tid * {P} + e]));\n"
                    f"      float dx = amax / 127.0f, inv = dx != 0.0f ? 1.0f / dx : 0.0f;\n"
                    f"      for (int e = 0; e < {TILE}; ++e) xs[tid * {P} + e] = roundf(xs[tid * {P} + e] * inv);\n"
                    f"      xd[tid] = ROUND_HALF(dx);\n"
                    f"      int n = n0 + tid;\n"
                    f"      wd[tid] = n < {N} ? HALF_AT_BYTE(w, I64(n) * {q8_row_bytes(k)} + (k0 / 32) * 34) : 0.0f;\n"
                    f"    }}\n    BARRIER();\n")
        scales = f"  LOCAL float xd[{TILE}];\n  LOCAL float wd[{TILE}];\n"
        step = ("        {{ float s = 0.0f; for (int kk = 0; kk < {T}; ++kk) s += xs[(ty + a * {H}) * {P} + kk] * "
                "ws[(tx + b * {H}) * {P} + kk];\n          acc[a][b] += s * xd[ty + a * {H}] * wd[tx + b * {H}]; }}\n"
                ).format(T=TILE, H=THREADS, P=P)
        compute = f"    for (int a = 0; a < {per}; ++a) for (int b = 0; b < {per}; ++b)\n{step}"
    else:
        w_value, quantise, scales = weight_at(dtype, "w", "n", "k", k), "", ""
        compute = (f"    for (int kk = 0; kk < {TILE}; ++kk)\n"
                   f"      for (int a = 0; a < {per}; ++a) for (int b = 0; b < {per}; ++b)\n"
                   f"        acc[a][b] += xs[(ty + a * {THREADS}) * {P} + kk] * ws[(tx + b * {THREADS}) * {P} + kk];\n")
    return (f"  int tx = LID(0), ty = LID(1), tid = ty * {THREADS} + tx, n0 = GID(0) * {TILE}, m0 = GID(1) * {TILE};\n"
            f"  LOCAL float xs[{TILE * P}];\n  LOCAL float ws[{TILE * P}];\n{scales}"
            f"  float acc[{per}][{per}];\n"
            f"  for (int a = 0; a < {per}; ++a) for (int b = 0; b < {per}; ++b) acc[a][b] = 0.0f;\n"
            f"  for (int k0 = 0; k0 < {K}; k0 += {TILE}) {{\n"
            f"    for (int e = tid; e < {TILE * TILE}; e += {THREADS * THREADS}) {{\n"
            f"      int rr = e / {TILE}, kk = e % {TILE}, k = k0 + kk, m = m0 + rr, n = n0 + rr;\n"
            f"      xs[rr * {P} + kk] = (m < {M} && k < {K}) ? x[I64(m) * {K} + k] : 0.0f;\n"
            f"      ws[rr * {P} + kk] = (n < {N} && k < {K}) ? {w_value} : 0.0f;\n    }}\n"
            f"    BARRIER();\n{quantise}{compute}"
            f"    BARRIER();\n  }}\n"
            f"  for (int a = 0; a < {per}; ++a) for (int b = 0; b < {per}; ++b) {{\n"
            f"    int row = m0 + ty + a * {THREADS}, n = n0 + tx + b * {THREADS};\n"
            f"    if (row < {M} && n < {N}) {store};\n  }}\n")


@lowers("expert_matmul")
def expert_matmul(ctx: NodeCtx) -> None:
    """Each (row, slot) pair reads only its selected expert's rows: GPU profile, a work-group
    per (output column block, pair); CPU profile, the rowwise schedule with one pair per item."""
    x, w, ids = ctx.ins
    out = ctx.outs[0]
    _, n, k = w.type.shape
    pairs = prod(ids.type.shape)
    slots = dim(ids.type.shape[1])
    buffers = [("x", x, False), ("w", w, False), ("ids", ids, False), ("out", out, True)]
    if ctx.profile == "cpu":
        xrow = f"I64(row / {slots}) * {{K}}" if x.type.rank == 2 else "I64(row) * {K}"
        blocks = 0
        if w.type.dtype is DType.Q8_0:
            packed, blocks = _split_q8_0(ctx, [w])
            buffers[1] = ("w", packed, False)
        streams = rowwise_streams(ctx, w.type.dtype, 1, n)
        body = _rowwise_body(w.type.dtype, pairs, n, k, 1, f"out[I64(row) * {dim(n)} + n] = s",
                             f"I64(ids[r0]) * {dim(n)} + n", xrow, blocks, streams)
        ctx.launch("expert_matmul_rows", body, buffers=buffers, groups=rowwise_groups(pairs, n, 1, streams),
                   local=(ROWWISE_COLS,))
        return
    xrow = f"I64(p / {slots}) * {dim(k)}" if x.type.rank == 2 else f"I64(p) * {dim(k)}"
    g = Gemv(w.type.dtype, k)
    body = _gemv_body(g, 1, "1", dim(n), f"  int n = GID(0) * {g.cols} + col, p = GID(1), r0 = 0;\n",
                      f"I64(ids[p]) * {dim(n)} + n", xrow, f"out[I64(p) * {dim(n)} + n] = {{}}")
    ctx.launch("expert_matmul", body, buffers=buffers, groups=[cdiv(dim(n), g.cols), pairs], local=(g.lanes, g.cols))

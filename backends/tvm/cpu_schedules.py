"""Hand-scheduled TensorIR for CPUs: the products of every block type and of f32, f16 and
bf16 weights, dense and a MoE's experts, those of a Q8_0 x over the quant.Q8_X_TYPES weights
(integer sub-block sums, q8_product_nest), attention and the gated delta rule as explicit
loop nests (dlight's CPU rules ran them 16-110x, 29-52x, 14-84x and 12-29x behind the native
OpenCL kernels here), for the llvm target and for OpenCL C on a CPU device: what differs
between the two (the task loop, f16, prefetches, ...) is a primitive of nest_targets.py.

The Q8_0 product:

dlight's CPU GEMV rule sees one reduction over K whose every element decodes its block's
f16 scale again, and vectorises nothing; this nest is what the product needs on a CPU with
wide vectors (AVX-512 here: 16 f32 lanes, one 32-quant block is two vectors):

- parallel over groups of output columns (N is >= 256 in every model layer, so the
  threads have work without splitting K: split-K would only add a reduction pass);
- per column and 32-block: the f16 scale converted once (F16C), the block's quants
  widened to f32 and scaled: the block scale is applied per block, to the weights;
- those dequantised vectors then serve every row of a pass (up to 16 rows: a DFlash
  verify block) each keeping LANES partial sums per column in registers, so a weight is
  read and decoded once per pass, not once per row; fewer rows take more columns per
  task (PASSES), one row (decode) eight, to keep several weight streams in flight;
- in a pass of one or two rows (memory-bound) each block read prefetches the same block of
  the next column group: the columns of a pass are read interleaved, a pattern the
  hardware prefetchers do not follow.

The partial sums are reduced across lanes at the end of each column (a halving fold). The
interpreter and the native kernels sum in other orders: results agree to rounding
(tests/kernel_cases.py).
"""
from __future__ import annotations

from typing import Callable

from dflash_ir.blocks import DECODERS
from dflash_ir.dtypes import DType
from dflash_ir.ops.attention import visible_range
from dflash_ir.ops.recurrent import delta_error, delta_update
from dflash_ir.quant import DP4_TYPES, Dp4Words
from dflash_ir.types import Dim

from .tir import TIR, _BlockText, _IndexText, _Text, f32, sub_block, u16_at, weight_at

LANES = 16  # f32 lanes of one AVX-512 vector
# (rows per pass, columns per task): a pass keeps rows x columns vectors of partial sums in
# registers (16 of AVX-512's 32); a product takes the most rows per pass that its rows fill.
# One row takes 8 columns: a decode GEMV from memory ran at 16-19 GB/s with 4, 20-23 with 8
# (8192 x 2048 and 12288 x 4096, alternated in one process; 16 no better)
PASSES = ((8, 2), (4, 4), (2, 4), (1, 8))
# passes of at most this many rows prefetch (a decode's, an expert's pairs): in the compute-
# bound passes of more rows the prefetches cost OpenCL C on PoCL ~40% (16 x 8192 x 4096
# product 7.5 -> 10.4 ms, 64 x 12288 x 4096 42 -> 63 ms) and gained llvm ~8% on the 16-row
# product, nothing on the 64-row one (alternated kernels-suite runs, 2-core Zen 4)
PREFETCH_ROWS = 2


def _pass(rows: int, cols: int, n: int, k: int, row, x_row, w_first: str, dtype: DType) -> list[str]:
    """Lines of one pass over `cols` weight columns (from row w_first + cg * cols of w) serving
    `rows` rows: output row `row(r)` reads x's row `x_row(row(r))`. Up to PREFETCH_ROWS rows
    it prefetches the same blocks `cols` rows on, the next column group's (the hardware
    prefetchers found no stream in a pass's interleaved columns: a one-row Q8_0 product
    ran at 27, 22 and 12 GB/s at K 8192, 2048 and 512, opencl at 35-37, 34-35 and 27-29;
    with the prefetches 33-34, 29-33 and 20-26). Each row's partial sums are a small buffer of its own
    (SCRATCH, nest_targets.py), rows unrolled here. w holds Q8_0 blocks (each f16 scale
    decoded once for its 16-lane halves, the quants of a half read as one 16-byte vector),
    f32, f16 or bf16 rows (a router's, a gate's), or another block type's, each weight
    decoded by its block decoder (dflash_ir/blocks.py)."""
    blocks = k // 32
    column = f"{w_first}cg * {cols} + c"
    # a block of more than 32 elements (the K-quants, IQ4_XS) is walked as its runs of 32
    # unrolled, so each run's sub-block scale, offset and field positions fold to constants
    # (one-row 4096 x 4096 Q4_K 0.92 -> 0.81 ms on tvm-llvm, 1.00 -> 0.70 on tvm-opencl)
    runs = dtype.block_size // 32 if dtype.is_block else 1
    b = "b" if runs == 1 else f"(sb * {runs} + run)"  # the run of 32 elements a step takes
    share, per_block, weight = [], [], None
    if dtype is DType.Q8_0:  # the whole half at once: one scale times 16 quants
        at = f"({column}) * {blocks * 34} + {b} * 34"
        scale = f"f16({u16_at('w', at)})"
        quants = f'T.Cast("float32x{LANES}", T.reinterpret("int8x{LANES}", w[T.Ramp({at} + 2 + h * {LANES}, 1, {LANES})]))'
        decode = [f"wq[T.Ramp(0, 1, {LANES})] = T.Broadcast({scale}, {LANES}) * {quants}"]
    elif dtype is DType.F16:
        weight = f"f16(w[({column}) * {k} + {b} * 32 + h * {LANES} + l])"
    elif not dtype.is_block:  # f32, bf16
        weight = weight_at(dtype, "w", column, f"{b} * 32 + h * {LANES} + l", k)
    else:  # a block type: the 16 lanes' sub-block scale and offset decoded once (sub-blocks of
        # 32: once for both halves: tvm-llvm's one-row 4096 x 4096 Q4_K product 1.46 -> 0.98 ms)
        def f16(bits: str) -> str:
            return f"f16({bits})"
        whole = DECODERS[dtype].sub >= 32
        _, _, code = sub_block(dtype, "w", column, f"{b} * 32 + h * {LANES}", k, f16)
        scale, offset, _ = sub_block(dtype, "w", column, f"{b} * 32" if whole else f"{b} * 32 + h * {LANES}", k, f16)
        parts = [f"part[0] = {scale}"] + ([f"part[1] = {offset}"] if offset is not None else [])
        per_block, share = (parts, []) if whole else ([], parts)
        weight = f"part[0] * {code('l')}" + (" + part[1]" if offset is not None else "")
    if weight is not None:
        decode = [f"for l in vectorized({LANES}):", f"    wq[l] = {weight}"]

    def acc(r: int) -> str:
        return f"acc{r}[c * {LANES} + l]"

    lines = [f'wq = T.alloc_buffer(({LANES},), "float32", scope=SCRATCH)',
             f'lanes = T.alloc_buffer(({LANES},), "float32", scope=SCRATCH)']
    lines += ['part = T.alloc_buffer((2,), "float32", scope=SCRATCH)'] if share or per_block else []
    lines += [f'acc{r} = T.alloc_buffer(({cols * LANES},), "float32", scope=SCRATCH)' for r in range(rows)]
    lines += [f"for c in T.unroll({cols}):", f"    for l in vectorized({LANES}):"]
    lines += [f"        {acc(r)} = T.float32(0)" for r in range(rows)]
    walk = [f"for b in range({blocks}):"] if runs == 1 else [f"for sb in range({blocks // runs}):",
                                                             f"    for run in T.unroll({runs}):"]
    lines += walk + _indent([
        f"for c in T.unroll({cols}):",
        *_indent(_prefetch(dtype, f"{column} + {cols}", k, b) if rows <= PREFETCH_ROWS else [], 1),
        *_indent(per_block, 1),
        "    for h in T.unroll(2):",
        *_indent(share, 2),
        *_indent(decode, 2),
        f"        for l in vectorized({LANES}):",
        *[f"            {acc(r)} = {acc(r)} + x[({x_row(row(r))}) * {k} + {b} * 32 + h * {LANES} + l] * wq[l]"
          for r in range(rows)]], len(walk))
    lines += [f"for c in T.unroll({cols}):"]
    for r in range(rows):  # lanes summed through a buffer of their own: acc's stay whole vectors
        lines += [f"    for l in vectorized({LANES}):", f"        lanes[l] = {acc(r)}",
                  *_indent(_vector_fold("lanes", LANES, "+"), 1),
                  f"    out[({row(r)}) * {n} + cg * {cols} + c] = lanes[0]"]
    return lines


def _prefetch(dtype: DType, column: str, k: int, b: str) -> list[str]:
    """Prefetches of the lines of w's row `column` where a pass reads its run b of 32
    elements (past the end of w for the last column group: prefetches never fault)."""
    if dtype.is_block:  # 32 weights span at most a line (their bytes rounded down: a hint)
        row, at, lines = k // dtype.block_size * dtype.block_bytes, f"{b} * {32 * dtype.block_bytes // dtype.block_size}", (0,)
    else:  # 32 f32 weights span two lines, of f16 or bf16 one
        row, at, lines = k, f"{b} * 32", (0, 16) if dtype is DType.F32 else (0,)
    return [f"T.evaluate(prefetch(T.address_of(w[({column}) * {row} + {at} + {line}])))" for line in lines]


def _nest(rows: int, cols: int, m: str, n: int, k: int, dtype: DType) -> list[str]:
    """Loop nest lines for passes of `rows` rows (m >= rows) over `cols` columns per task.
    The last pass starts at m - rows, recomputing some rows of the one before (the same
    values): every row of a pass is real, so its x rows sit at constant offsets from one
    pointer."""
    first = f"T.min(r0 * {rows}, {m} - {rows})"
    return [f"for cg in tasks({n // cols}):", f"    for r0 in range(({m} + {rows - 1}) // {rows}):",
            *_indent(_pass(rows, cols, n, k, lambda r: f"{first} + {r}", lambda row: row, "", dtype), 2)]


def product_nest(m: str, n: Dim, k: Dim, dtype: DType) -> str | None:
    """PrimFunc body computing out[m, n] = x[m, k] @ w[n, k]ᵀ with w in blocks of any type or
    f32, f16 or bf16 rows, or None when the nest does not cover it (symbolic N or K, K not a
    multiple of 32)."""
    if not isinstance(n, int) or not isinstance(k, int) or k % 32:
        return None
    return _by_rows(m, [(rows, _nest(rows, _widest(cols, n), m, n, k, dtype)) for rows, cols in PASSES])


# (rows, groups of 16 columns) of the passes of Q8_0 x: rows x groups int32 block sums and f32
# partial sums in registers, as the native VNNI tiles (1x4 .. 8x2); a task takes Q8_TASK_GROUPS
# groups (x's block sums, taken once per task and pass, serve them all)
Q8_PASSES = ((8, 2), (4, 2), (2, 4), (1, 4))
Q8_TASK_GROUPS = 8
# Q8_0's dp4 pack (quant.pack_q8_0_cols16 with dp4) is the block types' (pack_blocks_cols16_dp4)
# for a block of one f16 scale (the head) and 32 quants: each code word(q) as it is, the
# unsigned byte q + 128
_Q8_0_WORDS = Dp4Words(2, lambda word, s, q: word(q), 128)


def _q8_format(dtype: DType) -> tuple[Dp4Words, Callable, Callable | None, int]:
    """(how its dp4 pack holds the codes, scale(r, j), offset(r, j) or None, elements a
    sub-block) of a weight type a Q8_0 x multiplies as integers (quant.Q8_X_TYPES)."""
    if dtype is DType.Q8_0:
        return _Q8_0_WORDS, lambda r, j: r.f16(0), None, 32
    fmt = DECODERS[dtype]
    return DP4_TYPES[dtype], fmt.scale, fmt.offset, fmt.sub


class _Dp4Text(_BlockText):
    """The block decoders' reader over 16 columns at once: the block at byte `block` of w, a
    dp4 pack, read as backends/kernels/access.Dp4Loads reads it: each read one 16-lane vector
    (lane c column c), every byte index the same for all columns, so a decoder's arithmetic
    runs lane-wise as it is written."""

    f32_type = f"float32x{LANES}"

    def __init__(self, block: str, words: Dp4Words, nbytes: int):
        self.block, self.words, self.nbytes = block, words, nbytes

    def word(self, i) -> _Text:
        """The block's 32-bit word i, 16 columns'."""
        return _Text(f'load_as("int32x{LANES}", w, {self.block} + {self.words.fields_first * LANES} + ({i}) * {4 * LANES})')

    def _field(self, byte) -> str:
        """The 16 columns' u16 field words holding byte `byte` of the pack's block."""
        return f'load_as("uint16x{LANES}", w, {self.block} + ({byte} >> 1) * {2 * LANES})'

    def f16(self, byte: int) -> _Text:
        return _Text(f"f16x16({self._field(self.words.field_byte(byte, self.nbytes))})")

    def u8(self, byte) -> _Text:
        if self.words.order:  # the fields are the tail's
            at = self.words.field_byte(byte, self.nbytes)
            return (_Text(f'T.Cast("int32x{LANES}", {self._field(at)})') >> ((at & 1) * 8)) & 255
        return self.words.word_byte(self.word, byte)


def q8_product_nest(m: str, n: Dim, k: Dim, vnni: bool, dtype: DType = DType.Q8_0) -> str | None:
    """PrimFunc body computing out[m, n] = x[m, k] @ w[n, k]ᵀ for Q8_0 x (quantize_q8_0's
    blocks) and w of a Q8_X_TYPES type in its dp4 pack (quant.pack_q8_0_cols16 with dp4,
    pack_blocks_cols16_dp4: 16 columns side by side, four codes per 32-bit lane, unsigned
    bytes), or None for symbolic N or K. Each sub-block's sum is an exact integer, Σ code q
    started from -bias Σq (Q8_0's codes are w + 128): four products a lane and instruction
    with VNNI (`dpbusd`, x's word broadcast from memory), else the same integers in 32-bit
    lanes; then f32(sum) times both scales, and the weights' min times d_x Σq, is added to
    the column's partial sum, as the native tiles do (backends/kernels/linalg.py)."""
    if not isinstance(n, int) or not isinstance(k, int) or k % dtype.block_size:
        return None
    groups = -(-n // LANES)
    task = _widest(Q8_TASK_GROUPS, groups)
    variants = []
    for rows, most in Q8_PASSES:
        cols = min(most, task)
        first = f"T.min(r0 * {rows}, {m} - {rows})"
        variants.append((rows, [f"for t in tasks({groups // task}):", *_indent(_q8_scratch(rows, cols, k, dtype), 1),
                                f"    for r0 in range(({m} + {rows - 1}) // {rows}):",
                                *_indent(_q8_pass(rows, cols, task // cols, n, k, lambda r: f"{first} + {r}",
                                                  lambda row: row, f"t * {task} + cc * {cols} + j", "", vnni, dtype),
                                         2)]))
    return _by_rows(m, variants)


def _q8_scratch(rows: int, cols: int, k: int, dtype: DType) -> list[str]:
    """The task's arrays for _q8_pass of up to `rows` rows over `cols` groups."""
    _, _, offset, sub = _q8_format(dtype)
    return [f'xs = T.alloc_buffer(({rows * (k // sub)},), "int32", scope=SCRATCH)',
            f'xsum = T.alloc_buffer(({LANES},), "int32", scope=SCRATCH)',
            f'words = T.alloc_buffer(({cols * LANES},), "int32", scope=SCRATCH)',
            f'scale = T.alloc_buffer(({cols * LANES},), "float32", scope=SCRATCH)',
            *([f'offset = T.alloc_buffer(({cols * LANES},), "float32", scope=SCRATCH)',
               f'dxs = T.alloc_buffer(({rows},), "float32", scope=SCRATCH)'] if offset else []),
            f'dx = T.alloc_buffer(({rows},), "float32", scope=SCRATCH)',
            *[f'dot{r} = T.alloc_buffer(({cols * LANES},), "int32", scope=SCRATCH)' for r in range(rows)],
            *[f'acc{r} = T.alloc_buffer(({cols * LANES},), "float32", scope=SCRATCH)' for r in range(rows)]]


def _q8_pass(rows: int, cols: int, runs: int, n: int, k: int, row, x_row, group: str, w_first: str,
             vnni: bool, dtype: DType) -> list[str]:
    """Lines of `runs` runs (cc) of `cols` groups of 16 columns serving `rows` rows: output row
    row(r) reads x's row x_row(row(r)); `group` is the output group of a run's j-th (an
    expression of cc and j), w_first + group its place in the pack. x's sub-block sums are
    taken once for all the runs. A weight block of more than 32 elements (the K-quants) is
    walked as its runs s of 32 unrolled, each meeting one block of x."""
    words, scale_of, offset_of, sub = _q8_format(dtype)
    blocks, per_block, halves, quads = k // 32, dtype.block_size // 32, 32 // sub, sub // 4
    reader = _Dp4Text(f"(({w_first}{group}) * {k // dtype.block_size} + b) * {dtype.block_bytes * LANES}", words,
                      dtype.block_bytes)
    # the run of 32 a step takes in its weight block, and a quad of codes, as index arithmetic
    # TVM folds once the loops are unrolled (shifts and masks of a loop variable it left
    # unfolded, and OpenCL's host code then computed them as kernel arguments)
    s = _IndexText("s") if per_block > 1 else 0
    run = f"b * {per_block} + s" if per_block > 1 else "b"  # its block of x

    def xb(r: int, at: str = run) -> str:  # x's block `at` of pass row r
        return f"(({x_row(row(r))}) * {blocks} + {at}) * 34"

    def xs(r: int, h: int, at: str = run) -> str:  # Σq of x's sub-block h of block `at`, pass row r
        return f"xs[{r * blocks * halves} + ({at}) * {halves} + {h}]"

    def vec(buf: str, j) -> str:  # vector j of buf
        return f"{buf}[T.Ramp({j} * {LANES}, 1, {LANES})]"

    def dot(r: int, q) -> list[str]:
        at = f"{xb(r)} + 2 + ({q}) * 4"
        if vnni:
            return [f"{vec(f'dot{r}', 'j')} = dpbusd({vec(f'dot{r}', 'j')}, {vec('words', 'j')}, x, {at})"]
        terms = " + ".join(f"T.bitwise_and(T.shift_right(words[j * {LANES} + l], {8 * i}), 255) * "
                           f'T.Cast("int32", T.reinterpret("int8", x[{at} + {i}]))' for i in range(4))
        return [f"for l in vectorized({LANES}):", f"    dot{r}[j * {LANES} + l] = dot{r}[j * {LANES} + l] + {terms}"]

    def quants(at: str) -> str:
        return f'T.Cast("int32x{LANES}", T.reinterpret("int8x{LANES}", x[T.Ramp({at}, 1, {LANES})]))'

    def store(r: int) -> list[str]:
        at = f"({row(r)}) * {n} + ({group}) * {LANES} + l"
        if n % LANES:  # the last group's padding columns are not stored
            return [f"for l in range({LANES}):", f"    if ({group}) * {LANES} + l < {n}:",
                    f"        out[{at}] = acc{r}[j * {LANES} + l]"]
        return [f"for l in vectorized({LANES}):", f"    out[{at}] = acc{r}[j * {LANES} + l]"]

    lines = [f"for b in range({blocks}):"]
    for r in range(rows):  # Σq of each sub-block of x: the bias's and the min's
        first, second = quants(xb(r, "b") + " + 2"), quants(xb(r, "b") + " + 18")
        for h, sums in enumerate([f"{first} + {second}"] if halves == 1 else [first, second]):
            lines += [f"    {vec('xsum', 0)} = {sums}", *_indent(_vector_fold("xsum", LANES, "+"), 1),
                      f"    {xs(r, h, 'b')} = xsum[0]"]
    step = []
    for h in range(halves):
        parts = [f"{vec('scale', 'j')} = {scale_of(reader, s * halves + h)}"]
        parts += [f"{vec('offset', 'j')} = {offset_of(reader, s * halves + h)}"] if offset_of else []
        step += [f"for j in T.unroll({cols}):", *_indent(parts, 1)]
        for r in range(rows):
            start = f"{xs(r, h)} * -{words.bias}" if words.bias else "0"
            step += [f"for l in vectorized({cols * LANES}):", f"    dot{r}[l] = {start}"]
            step += [f"dxs[{r}] = dx[{r}] * T.Cast(\"float32\", {xs(r, h)})"] if offset_of else []
        q = f"{h * quads} + q4" if h else "q4"
        step += [f"for q4 in T.unroll({quads}):", f"    for j in T.unroll({cols}):",
                 f"        {vec('words', 'j')} = {words.codes(reader.word, s, _IndexText(f'({q})'))}"]
        for r in range(rows):
            step += [f"    for j in T.unroll({cols}):", *_indent(dot(r, q), 2)]
        for r in range(rows):
            minimum = f" + offset[l] * dxs[{r}]" if offset_of else ""
            step += [f"for l in vectorized({cols * LANES}):",
                     f'    acc{r}[l] = acc{r}[l] + T.Cast("float32", dot{r}[l]) * (scale[l] * dx[{r}]){minimum}']
    walk = [f"for b in range({k // dtype.block_size}):"] + ([f"    for s in T.unroll({per_block}):"] if per_block > 1 else [])
    lines += [f"for cc in range({runs}):",
              *[line for r in range(rows) for line in (f"    for l in vectorized({cols * LANES}):",
                                                       f"        acc{r}[l] = T.float32(0)")],
              *_indent(walk, 1),
              *_indent([f"dx[{r}] = f16({u16_at('x', xb(r))})" for r in range(rows)] + step, len(walk) + 1)]
    for r in range(rows):
        lines += [f"    for j in T.unroll({cols}):", *_indent(store(r), 2)]
    return lines


def _by_rows(m: str, variants: list[tuple[int, list[str]]]) -> str:
    """A body choosing among nests for passes of decreasing rows: the one of the most rows that m fills."""
    if m.isdigit():  # rows fixed at compile time
        return "\n".join(_indent(next(nest for rows, nest in variants if int(m) >= rows), 1)) + "\n"
    lines = []
    for i, (rows, nest) in enumerate(variants[:-1]):
        lines += [("el" if i else "") + f"if {m} >= {rows}:", *_indent(nest, 1)]
    return "\n".join(_indent(lines + ["else:", *_indent(variants[-1][1], 1)], 1)) + "\n"


# (rows, columns) of the expert passes: an expert's rows in pairs, as many as it has, then one;
# 8 columns as a decode GEMV's. The 35B-A3B's fused MoE (64 experts allocated, top-8) at 16
# rows ran in 12.3 ms, opencl 9.6 (with passes of 4, 2 and 1 rows of 4 columns 13.2; one row
# a pass, unsorted, 15.7); at one row 1.12, unsorted 1.09, opencl 0.95 (alternated in one process)
EXPERT_PASSES = ((2, 8), (1, 8))


def expert_order(m: str, experts: int) -> str:
    """Statements sorting the (row, slot) pairs of ids[m] by expert, a counting sort: expert
    e's pairs are order[count[e]:count[e + 1]] (count: int32[experts + 2]). One task does
    it, before the expert products read it."""
    return "\n".join([
        f"for e in range({experts + 2}):", "    count[e] = 0",
        f"for p in range({m}):", "    count[ids[p] + 2] = count[ids[p] + 2] + 1",
        f"for e in range({experts}):", "    count[e + 2] = count[e + 2] + count[e + 1]",
        f"for p in range({m}):", "    order[count[ids[p] + 1]] = p",
        "    count[ids[p] + 1] = count[ids[p] + 1] + 1"])


def expert_product(n: int, k: int, experts: int, slots: str, per_token: bool, dtype: DType) -> str:
    """PrimFunc body computing out[p, n] = x[p // slots or p, k] @ w[ids[p]]ᵀ for an f32 x and
    experts w[E, n, k] of any type product_nest takes, the pairs sorted by expert
    (expert_order's count and order): each task takes each expert's pairs in passes of
    EXPERT_PASSES rows, so an expert's weights are decoded once for all the rows of a pass.
    (The first pair left is kept in span[0], moved on after each kind of pass, never inside
    one: OpenCL C tests a loop's bound on every iteration. With loop extents written as sums
    over the passes before them, TVM 0.27's llvm code gave wrong rows and crashed.)"""
    cols = _widest(EXPERT_PASSES[0][1], n)
    x_row = (lambda row: f"({row}) // {slots}") if per_token else (lambda row: row)
    return _expert_walk(n // cols, experts, [], [rows for rows, _ in EXPERT_PASSES],
                        lambda rows, row: _pass(rows, cols, n, k, row, x_row, f"e * {n} + ", dtype))


def _expert_walk(tasks: int, experts: int, scratch: list[str], passes: list[int], pass_lines) -> str:
    """PrimFunc body: each of `tasks` tasks (cg) walks every expert's pairs (e; expert_order's
    count and order) in passes of each size in `passes` as long as it has that many left;
    pass_lines(rows, row) are a pass's lines, row(r) its r-th pair."""
    lines = [f"for cg in tasks({tasks}):", '    span = T.alloc_buffer((2,), "int32", scope=SCRATCH)',
             *_indent(scratch, 1),
             f"    for e in range({experts}):", "        span[0] = count[e]", "        span[1] = count[e + 1]"]
    for i, rows in enumerate(passes):
        lines += [f"        for q{i} in range((span[1] - span[0]) // {rows}):",
                  *_indent(pass_lines(rows, lambda r, i=i, rows=rows: f"order[span[0] + q{i} * {rows} + {r}]"), 3),
                  f"        span[0] = span[0] + (span[1] - span[0]) // {rows} * {rows}"]
    return "\n".join(_indent(lines, 1)) + "\n"


# (rows, groups of 16 columns) of the expert passes over Q8_0 x: an expert's rows in pairs,
# then one, as the f32 x passes. 8 groups a task: the 35B-A3B's fused MoE on tvm-llvm at one
# row 0.80-0.86 -> 0.61-0.62 ms, at 16 rows 7.8 -> 7.0 ms against 4 groups (alternated)
Q8_EXPERT_PASSES = ((2, 8), (1, 8))


def expert_q8_x_product(n: int, k: int, experts: int, slots: str, per_token: bool, vnni: bool, dtype: DType) -> str:
    """expert_product for Q8_0 x, the experts (of a quant.Q8_X_TYPES type) in their dp4 pack
    (expert by expert, each padded to whole groups): each pass as q8_product_nest's, on an
    expert's pairs."""
    groups = -(-n // LANES)
    cols = _widest(Q8_EXPERT_PASSES[0][1], groups)
    x_row = (lambda row: f"({row}) // {slots}") if per_token else (lambda row: row)
    return _expert_walk(groups // cols, experts, _q8_scratch(Q8_EXPERT_PASSES[0][0], cols, k, dtype),
                        [rows for rows, _ in Q8_EXPERT_PASSES],
                        lambda rows, row: _q8_pass(rows, cols, 1, n, k, row, x_row, f"cg * {cols} + j", f"e * {groups} + ",
                                                   vnni, dtype))


def _widest(most: int, n: int) -> int:
    """The largest power of two up to `most` (a power of two) that divides n: columns per
    task, vector lanes along a row, output slices side by side."""
    return next(w for w in (most >> i for i in range(most.bit_length())) if n % w == 0)


def _indent(lines: list[str], levels: int) -> list[str]:
    return ["    " * levels + s for s in lines]


ATTENTION_ROWS = 8  # query rows a task takes: each block of keys is read once for them all
KEYS = LANES         # keys a step takes: their scores, weights and exps are one vector


def exp_nonpositive(x: str) -> str:
    """e^x for x <= 0 (TIR's exp is a libm call per element: this one vectorises): x = n ln2 + f
    with |f| <= ln2/2 (ln2 in two parts, Cody-Waite), e^f by its Taylor series to f^7
    (relative error below 2e-7), times 2^n made from its exponent bits; x below -87 (e^x
    < 2^-125) is taken as -87."""
    x = f"T.max({x}, T.float32(-87.0))"
    n = f"T.floor({x} * T.float32(1.4426950408889634) + T.float32(0.5))"
    f = f"({x} - {n} * T.float32(0.693145751953125) - {n} * T.float32(1.4286067653302226e-06))"
    series = "T.float32(1.0 / 5040)"
    for k in (720, 120, 24, 6, 2, 1, 1):
        series = f"(T.float32({1.0 / k!r}) + {f} * {series})"
    power = f'T.reinterpret("float32", T.shift_left(T.Cast("int32", {n}) + 127, 23))'
    return f"{series} * {power}"


def _vector_fold(buf: str, lanes: int, op: str) -> list[str]:
    """Lines leaving op (T.max, or "+") over buf[0:lanes] in buf[0], halving the vector each step."""
    lines = []
    while lanes > 1:
        lanes //= 2
        both = f"{buf}[l] + {buf}[l + {lanes}]" if op == "+" else f"{op}({buf}[l], {buf}[l + {lanes}])"
        lines += [f"for l in vectorized({lanes}):", f"    {buf}[l] = {both}"]
    return lines


def attention_nest(t: str, cap: str, hq: int, hkv: int, d: int, dv: int, scale: float, causal: bool,
                   window: int) -> str:
    """PrimFunc body: out = softmax(q kᵀ scale, masked) v over the first min(kv_len, cap) cache
    rows, online (one pass over K and V, a running max and sum per query row and head).

    A task is a KV head and a block of ATTENTION_ROWS query rows; it walks its rows' visible
    keys (kv_len is read in the kernel, so one kernel serves every cache fill) in steps of
    KEYS at multiples of KEYS (so a row's sums do not depend on the rows beside it: batch
    invariance), and each step's keys and values, read once, serve every query head of the
    group in every row of the block. Per row, a step makes its keys' scores for every head
    of the group at once: each slice of a key, loaded once, feeds the group's dot products,
    independent chains of FMAs (one head at a time took two loads per FMA, and the verify
    ran 1.7x behind opencl; 1.2x so). Then per head it rescales the running sums once if the
    step raised the max and takes the exps as one vector (exp_nonpositive); the weighted
    values are summed in registers the same way, each slice of a value loaded once for the
    group, `ways` slices of each head's output side by side (one slice at a time chained
    every key's FMA to the last: 3x slower). Keys a row's mask hides are never read (an
    unfilled cache row may hold anything: a weight of 0 times it could be NaN)."""
    group, rows = hq // hkv, ATTENTION_ROWS
    heads = rows * group
    ld, lv = _widest(LANES, d), _widest(LANES, dv)
    blocks = f"(({t} + {rows - 1}) // {rows})"
    first = f"task % {blocks} * {rows}"
    kvh = f"task // {blocks}"
    row = f"{first} + r"
    slot = f"r * {group} + g"
    q_at = f"(({row}) * {hq} + {kvh} * {group} + g) * {d}"
    k_at = f"(({{j}}) * {hkv} + {kvh}) * {d}"
    # keys visible to a row: [row_lo, row_hi); to the task: [lo, hi)
    n = _Text("n")

    def visible(query_row: str) -> tuple:
        return visible_range(TIR, n, n - _Text(t) + _Text(query_row), causal, window)

    row_lo, row_hi = visible(row)
    lo, hi = visible(first)[0], visible(f"T.min({first} + {rows - 1}, {t} - 1)")[1]
    chunks = d // ld
    # independent sums per dot product, for the FMA latency: the group's heads are such sums
    chains = 2 if chunks % 2 == 0 and group < 4 else 1
    # output slices each head sums side by side: ways x group vectors of partial sums, at most 16
    ways = _widest(1 << (min(4, max(1, LANES // group)).bit_length() - 1), dv // lv)

    def each_head(body: list[str], lanes: int) -> list[str]:
        return [f"for g in T.unroll({group}):", f"    for l in vectorized({lanes}):", *_indent(body, 2)]

    def scores(keys: list[str]) -> list[str]:
        """The scores of keys side by side (one load of each q slice feeds them all: one key
        at a time loaded q for every FMA; pairs took tvm-opencl's 16-row attention from 2.3x
        to 2.1x of opencl), each summed as a key alone is: its chains over the slices, then
        its lanes folded, so a key's score does not depend on its partner."""
        def step(a: int, at: str, first: bool) -> list[str]:
            return each_head([f"dot{a}_{i}[g * {ld} + l] = " + ("" if first else f"dot{a}_{i}[g * {ld} + l] + ")
                              + f"q[{q_at} + {at}] * k[{k_at.format(j=j)} + {at}]" for i, j in enumerate(keys)], ld)
        lines = [line for a in range(chains) for line in step(a, f"{a * ld} + l", True)]
        if chunks > chains:
            lines += [f"for c in range(1, {chunks // chains}):",
                      *[line for a in range(chains) for line in _indent(step(a, f"(c * {chains} + {a}) * {ld} + l", False), 1)]]
        for i, j in enumerate(keys):
            both = " + ".join(f"dot{a}_{i}[g * {ld} + l]" for a in range(chains))
            lines += [f"for g in T.unroll({group}):", f"    for l in vectorized({ld}):", f"        lanes[l] = {both}",
                      *_indent(_vector_fold("lanes", ld, "+"), 1),
                      f"    score[g * {KEYS} + {j} - j0] = lanes[0] * {f32(scale)}"]
        return lines
    pairs = "(its_hi - its_lo) // 2"
    dot = [f"for p in range({pairs}):", *_indent(scores(["its_lo + 2 * p", "its_lo + 2 * p + 1"]), 1),
           "if (its_hi - its_lo) % 2 == 1:", *_indent(scores(["its_hi - 1"]), 1)]
    bookkeeping = [
        f"for l in vectorized({KEYS}):", f"    top[l] = score[g * {KEYS} + l]", *_vector_fold("top", KEYS, "T.max"),
        f"if top[0] > m[{slot}]:",  # a new running max: rescale what was summed so far
        f"    top[1] = T.exp(m[{slot}] - top[0])",
        f"    total[{slot}] = total[{slot}] * top[1]",
        f"    for i in range({dv}):", f"        acc[({slot}) * {dv} + i] = acc[({slot}) * {dv} + i] * top[1]",
        f"    m[{slot}] = top[0]",
        f"for l in vectorized({KEYS}):",
        f"    weight[g * {KEYS} + l] = T.if_then_else(score[g * {KEYS} + l] == {f32(float('-inf'))}, T.float32(0), "
        f"{exp_nonpositive(f'score[g * {KEYS} + l] - m[{slot}]')})",
        f"for l in vectorized({KEYS}):", f"    top[l] = weight[g * {KEYS} + l]", *_vector_fold("top", KEYS, "+"),
        f"total[{slot}] = total[{slot}] + top[0]"]
    span = lv * ways
    part = f"out_part[g * {span} + w * {lv} + l]"
    # out_part is only ever touched a vector of lv at a time, so TVM's OpenCL C keeps it a
    # vector array (in registers): copied span-wide, its lanes were scalar stores, and PoCL
    # rebuilt the vectors from 128-bit pieces on every key (tvm-opencl's 16-row attention
    # 18 -> 12 ms, 2.0x -> 1.25x of opencl; llvm's 1.25x -> 1.05x; alternated, two runs)
    def each_slice(body: str) -> list[str]:
        return [f"for g in T.unroll({group}):", f"    for w in T.unroll({ways}):",
                f"        for l in vectorized({lv}):", f"            {body}"]
    at = f"g * {span} + w * {lv} + l"
    cell = f"({slot}) * {dv} + c * {span} + w * {lv} + l"
    values = [f"for c in range({dv // span}):",
              *_indent(each_slice(f"out_part[{at}] = acc[{cell}]"), 1),
              "    for j in range(its_lo, its_hi):",
              f"        for w in T.unroll({ways}):",
              *_indent(each_head([f"{part} = {part} + weight[g * {KEYS} + j - j0] * "
                                  f"v[(j * {hkv} + {kvh}) * {dv} + (c * {ways} + w) * {lv} + l]"], lv), 3),
              *_indent(each_slice(f"acc[{cell}] = out_part[{at}]"), 1)]
    head = [f"for l in vectorized({group * KEYS}):", f"    score[l] = {f32(float('-inf'))}",
            *dot,
            f"for g in range({group}):", *_indent(bookkeeping, 1),
            *values]
    lines = [f"for task in tasks({hkv} * {blocks}):",
             f'    acc = T.alloc_buffer(({heads * dv},), "float32", scope=SCRATCH)',
             f'    m = T.alloc_buffer(({heads},), "float32", scope=SCRATCH)',
             f'    total = T.alloc_buffer(({heads},), "float32", scope=SCRATCH)',
             *[f'    dot{a}_{i} = T.alloc_buffer(({group * ld},), "float32", scope=SCRATCH)'
               for a in range(chains) for i in range(2)],
             f'    lanes = T.alloc_buffer(({ld},), "float32", scope=SCRATCH)',
             f'    score = T.alloc_buffer(({group * KEYS},), "float32", scope=SCRATCH)',
             f'    weight = T.alloc_buffer(({group * KEYS},), "float32", scope=SCRATCH)',
             f'    top = T.alloc_buffer(({KEYS},), "float32", scope=SCRATCH)',
             f'    out_part = T.alloc_buffer(({group * lv * ways},), "float32", scope=SCRATCH)',
             f"    n = T.min(kv_len[0], {cap})",
             f"    for i in range({heads}):",
             f"        m[i] = {f32(float('-inf'))}", "        total[i] = T.float32(0)",
             f"    for i in range({heads * dv}):", "        acc[i] = T.float32(0)",
             f"    start = {lo} // {KEYS} * {KEYS}",
             f"    for step in range(({hi} - start + {KEYS - 1}) // {KEYS}):",
             f"        j0 = start + step * {KEYS}",
             f"        for r in range({rows}):",
             f"            its_lo = T.max(j0, {row_lo})",
             f"            its_hi = T.min(j0 + {KEYS}, {row_hi})",
             f"            if {row} < {t} and its_lo < its_hi:",
             *_indent(head, 4),
             f"    for r in range({rows}):",
             f"        if {row} < {t}:",
             f"            for g in range({group}):",
             f"                for c in range({dv}):",
             f"                    out[(({row}) * {hq} + {kvh} * {group} + g) * {dv} + c] = "
             f"acc[({slot}) * {dv} + c] / total[{slot}]"]
    return "\n".join(_indent(lines, 1)) + "\n"


def delta_rule_nest(t: str, hk: int, hv: int, dk: int, dv: int, tiled: bool, scale: float) -> str:
    """PrimFunc body of the gated delta rule (ops_recurrent.gated_delta_rule's recurrence): a
    task per v head walks the rows over its state S[dk, dv], vectorised along the value dim;
    every sum over the key dim runs in the order the per-column form sums it. Per row one pass
    over the state sums kᵀS, the next writes the updated cells (delta_error, delta_update);
    the first row reads the old state, later rows the new (a head's state stays in cache).
    Each cell is read before it is written, so the new state may be the old one's buffer.
    No rows: the new state is the old. The loops over a row's vectors are unrolled: as loops,
    PoCL kept their vectors in memory (tvm-opencl's 16-row rule 2.07x of opencl, unrolled
    1.73x; llvm unchanged, 0.92-1.02x)."""
    lv = _widest(LANES, dv)
    kh = f"h % {hk}" if tiled else f"h // {hv // hk}"
    qk = f"(ti * {hk} + {kh}) * {dk} + e"
    tv = f"ti * {hv} + h"
    cell = f"(h * {dk} + e) * {dv} + c * {lv} + l"
    col = f"c * {lv} + l"
    sums, decay = _Text(f"kv[{col}]"), _Text("decay[0]")

    def vec(body: str) -> list[str]:
        return [f"for c in T.unroll({dv // lv}):", f"    for l in vectorized({lv}):", f"        {body}"]

    def per_source(body: Callable[[_Text], str]) -> list[str]:
        """body over the state the row reads: the old for the first row, else the new."""
        return ["if ti == 0:", *_indent(vec(body(_Text(f"state[{cell}]"))), 1),
                "else:", *_indent(vec(body(_Text(f"new_state[{cell}]"))), 1)]

    error = delta_error(_Text(f"v[({tv}) * {dv} + {col}]"), sums, decay, _Text(f"beta[{tv}]"))
    lines = [f"for h in tasks({hv}):",
             f'    kv = T.alloc_buffer(({dv},), "float32", scope=SCRATCH)',
             f'    o_row = T.alloc_buffer(({dv},), "float32", scope=SCRATCH)',
             '    decay = T.alloc_buffer((1,), "float32", scope=SCRATCH)',
             f"    if {t} == 0:",
             f"        for i in range({dk * dv}):", f"            new_state[h * {dk * dv} + i] = state[h * {dk * dv} + i]",
             f"    for ti in range({t}):",
             f"        {decay} = T.exp(g[{tv}])",
             *_indent(vec(f"{sums} = T.float32(0)"), 2),
             f"        for e in range({dk}):",
             *_indent(per_source(lambda s: f"{sums} = {sums + s * _Text(f'k[{qk}]')}"), 3),
             *_indent(vec(f"{sums} = {error}"), 2),
             *_indent(vec(f"o_row[{col}] = T.float32(0)"), 2),
             f"        for e in range({dk}):",
             *_indent(per_source(lambda s: f"new_state[{cell}] = {delta_update(s, _Text(f'k[{qk}]'), sums, decay)}"), 3),
             *_indent(vec(f"o_row[{col}] = o_row[{col}] + new_state[{cell}] * (q[{qk}] * {f32(scale)})"), 3),
             *_indent(vec(f"o[({tv}) * {dv} + {col}] = o_row[{col}]"), 2)]
    return "\n".join(_indent(lines, 1)) + "\n"

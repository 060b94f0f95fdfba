"""Numpy (de)quantisation of the GGUF weight types, bit-exact with ggml.

Storage conventions (what `GGUFFile.raw` returns and what kernels consume):
F32 -> float32, F16 -> float16, BF16 -> uint16 (the raw bits), Q8_0 -> uint8 whose last dim
holds `K // 32` blocks of 34 bytes (fp16 scale `d`, then 32 int8 `qs`); the other block types
likewise hold their blocks as bytes, in a one-byte dtype named after the type (DType.numpy).
Leading dims are free, so any row selection of a storage array is itself a valid storage array.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dflash_ir.blocks import DECODERS
from dflash_ir.dtypes import DType

_Q8_0_SCALE_BYTES = 2


def storage_shape(shape: Sequence[int], dtype: DType) -> tuple[int, ...]:
    """Numpy storage shape of a tensor with logical `shape`: only block types change it."""
    shape = tuple(int(d) for d in shape)
    if not dtype.is_block:
        return shape
    if not shape or shape[-1] % dtype.block_size:
        raise ValueError(
            f"{dtype} needs a last dimension that is a multiple of {dtype.block_size}, got shape {shape}"
        )
    return (*shape[:-1], shape[-1] // dtype.block_size * dtype.block_bytes)


def dequantize(storage: np.ndarray, dtype: DType) -> np.ndarray:
    """Float32 values of `storage` (always a new, writable array)."""
    storage = np.asarray(storage)
    if dtype not in _FLOAT_TYPES:
        raise ValueError(f"cannot dequantize {dtype}: not a floating-point storage type")
    if storage.dtype != dtype.numpy():
        raise ValueError(f"{dtype} storage must have numpy dtype {dtype.numpy()}, got {storage.dtype}")
    if dtype is DType.BF16:
        return (storage.astype(np.uint32) << 16).view(np.float32)
    if dtype is DType.Q8_0:
        return _dequantize_q8_0(storage)
    if dtype in DECODERS:
        return _decode_blocks(storage, dtype)
    return storage.astype(np.float32)


def quantize(x: np.ndarray, dtype: DType) -> np.ndarray:
    """Storage array holding `x` rounded to `dtype` the way gguf-py / ggml round it."""
    x = np.asarray(x, dtype=np.float32)
    if dtype is DType.F32:
        return x.copy()
    if dtype is DType.F16:
        return x.astype(np.float16)
    if dtype is DType.BF16:
        return _quantize_bf16(x)
    if dtype is DType.Q8_0:
        return quantize_q8_0(x)
    if dtype in DECODERS:
        raise ValueError(f"cannot quantize to {dtype} here: llama.cpp's llama-quantize makes such files "
                         "(dflash_ir.benchmark.peer.quantize runs it)")
    raise ValueError(f"cannot quantize to {dtype}: not a floating-point storage type")


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0 storage of `x` (last dim a multiple of 32), as llama.cpp's quantize_row_q8_0_ref."""
    x = np.asarray(x, dtype=np.float32)
    out_shape = storage_shape(x.shape, DType.Q8_0)
    blocks = x.reshape(-1, DType.Q8_0.block_size)
    # Extreme blocks overflow exactly as in ggml (inf scale, NaN quants): that is the defined result.
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
        inv_d = np.where(d == 0, np.float32(0), np.float32(1) / d)
        qs = _round_half_away(blocks * inv_d).astype(np.int8)
        packed = np.concatenate([d.astype(np.float16).view(np.uint8), qs.view(np.uint8)], axis=1)
    return packed.reshape(out_shape)


def _dequantize_q8_0(storage: np.ndarray) -> np.ndarray:
    bb = DType.Q8_0.block_bytes
    if storage.ndim == 0 or storage.shape[-1] % bb:
        raise ValueError(
            f"q8_0 storage needs a last dimension that is a multiple of {bb} bytes, got shape {storage.shape}"
        )
    blocks = storage.reshape(*storage.shape[:-1], storage.shape[-1] // bb, bb)
    d = np.ascontiguousarray(blocks[..., :_Q8_0_SCALE_BYTES]).view(np.float16).astype(np.float32)
    qs = blocks[..., _Q8_0_SCALE_BYTES:].view(np.int8).astype(np.float32)
    with np.errstate(invalid="ignore"):  # an inf scale times a zero quant is NaN, as in ggml
        return (qs * d).reshape(*storage.shape[:-1], -1)


class _BlockReader:
    """The decoders' reader (dflash_ir/blocks.py) over blocks[..., nb, block_bytes]: a byte index
    is an int (one byte per block) or an array over the block's elements; values are int32 and
    float32 arrays that broadcast to [..., nb, block_size]."""

    def __init__(self, blocks: np.ndarray):
        self.blocks = blocks

    def u8(self, byte):
        if isinstance(byte, int):
            return self.blocks[..., byte:byte + 1].astype(np.int32)
        return np.take(self.blocks, byte, axis=-1).astype(np.int32)

    def f16(self, byte: int):
        return np.ascontiguousarray(self.blocks[..., byte:byte + 2]).view(np.float16).astype(np.float32)

    @staticmethod
    def f32(x):
        return np.asarray(x).astype(np.float32)

    @staticmethod
    def f32_bits(x):
        return np.asarray(x).astype(np.uint32).view(np.float32)

    @staticmethod
    def select(cond, a, b):
        return np.where(cond, a, b)

    @staticmethod
    def table(name: str, values, index):
        return np.asarray(values, np.float32)[index]


def _decode_blocks(storage: np.ndarray, dtype: DType) -> np.ndarray:
    bb = dtype.block_bytes
    if storage.ndim == 0 or storage.shape[-1] % bb:
        raise ValueError(
            f"{dtype} storage needs a last dimension that is a multiple of {bb} bytes, got shape {storage.shape}"
        )
    blocks = storage.view(np.uint8).reshape(*storage.shape[:-1], storage.shape[-1] // bb, bb)
    i = np.arange(dtype.block_size, dtype=np.int32)
    with np.errstate(invalid="ignore", over="ignore"):  # inf/NaN scales decode as in ggml
        values = DECODERS[dtype].value(_BlockReader(blocks), i)
    return values.reshape(*storage.shape[:-1], -1)  # every value depends on i: a new [..., nb, block] array


def block_parts(storage: np.ndarray, dtype: DType) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A Q8_X_TYPES storage [..., nb * block_bytes] as its sub-blocks' parts (sub = 32, or 16),
    K / sub of each per row: scales f32 [..., K/sub], integer codes as exact f32
    [..., K/sub, sub] and offsets f32 [..., K/sub] (None for types without), so that
    value = scale * code [+ offset]."""
    bb = dtype.block_bytes
    blocks = np.asarray(storage).view(np.uint8).reshape(*storage.shape[:-1], storage.shape[-1] // bb, bb)
    if dtype is DType.Q8_0:
        d = np.ascontiguousarray(blocks[..., :_Q8_0_SCALE_BYTES]).view(np.float16)[..., 0].astype(np.float32)
        return d, blocks[..., _Q8_0_SCALE_BYTES:].view(np.int8).astype(np.float32), None
    fmt, r = DECODERS[dtype], _BlockReader(blocks)
    if 32 % fmt.sub:
        raise ValueError(f"block_parts takes types whose sub-blocks divide 32 elements, not {dtype}")
    subs, lead = dtype.block_size // fmt.sub, storage.shape[:-1]
    j = np.arange(subs, dtype=np.int32)
    codes = np.broadcast_to(fmt.code(r, np.arange(dtype.block_size, dtype=np.int32)), (*blocks.shape[:-1], dtype.block_size))
    def per_sub(part):
        return np.broadcast_to(part(r, j), (*blocks.shape[:-1], subs)).reshape(*lead, -1).astype(np.float32)

    offset = None if fmt.offset is None else per_sub(fmt.offset)
    return per_sub(fmt.scale), np.ascontiguousarray(codes, dtype=np.float32).reshape(*lead, -1, fmt.sub), offset


def _round_half_away(v: np.ndarray) -> np.ndarray:
    """C `roundf`: float32 inputs are widened to float64 so adding 0.5 is exact."""
    wide = v.astype(np.float64)
    return np.trunc(wide + np.copysign(0.5, wide))


def _quantize_bf16(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: NaNs become quiet NaNs, everything else rounds to nearest even."""
    bits = x.view(np.uint32).astype(np.uint64)
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = ((bits & 0xFFFF0000) | 0x00400000) >> 16
    return np.where(is_nan, quiet_nan, rounded).astype(np.uint16)


_FLOAT_TYPES = (DType.F32, DType.F16, DType.BF16, DType.Q8_0, *DECODERS)


COLS = 16  # weight rows interleaved by pack_q8_0_cols16: one 16-wide vector per input index
COLS_BLOCK_BYTES = COLS * 2 + COLS * 32  # a group's block: 16 f16 scales, then 32 x 16 quants


def pack_q8_0_cols16(storage: np.ndarray, dp4: bool = False, out: np.ndarray | None = None) -> np.ndarray:
    """Q8_0 rows (storage [n, K/32*34]) in groups of 16 rows, block by block: for group g and
    block b, at byte (g * nb + b) * 544, the 16 rows' f16 scales (32 bytes), then the quants
    for input index k = 32 b + kk at 32 + 16 kk + row (so one 16-byte load holds one input
    index for 16 outputs). Rows past n (to a multiple of 16) are zero: scales 0, quants 0.
    CPU kernels keep 16 outputs in one vector and stream each group's bytes in order. A stack
    of matrices (an expert bank, [E, n, K/32*34]) is packed matrix by matrix, each padded to
    whole groups, so one expert's rows are a contiguous run of groups.

    `dp4`: the quants of four input indices side by side instead, at 32 + 64 (kk / 4) +
    4 row + kk % 4, so a 64-byte load holds 16 outputs' 4-byte words for an integer dot
    product instruction (x86 VPDPBUSD), and each stored as the unsigned byte q + 128 (q xor
    0x80; padding rows' too), the instruction's unsigned operand: x's signed quants are then
    its other operand as they are, broadcast straight from memory.

    `out`: bytes to pack into (a mapped device buffer's), else a new array is returned."""
    rows = np.ascontiguousarray(storage, dtype=np.uint8)
    if rows.ndim > 2:
        return _stacked(functools.partial(pack_q8_0_cols16, dp4=dp4), rows, out)
    blocks = rows.reshape(-1, rows.shape[-1] // DType.Q8_0.block_bytes, DType.Q8_0.block_bytes)  # [row, b, 34]
    groups, nb = -(-len(blocks) // COLS), blocks.shape[1]
    out = _groups_out(out, len(blocks), (groups, nb, COLS_BLOCK_BYTES), np.uint8)
    _interleave_rows(blocks[..., :2], out[..., :COLS * 2].reshape(groups, nb, COLS, 2), axis=2)
    if dp4:  # the quants copied out of their 34-byte blocks first, so their 4-byte words move as u32s
        words = np.ascontiguousarray(blocks[..., 2:]).view("<u4")            # [row, b, 8]
        quants = out[..., COLS * 2:]
        _interleave_rows(words, quants.view("<u4").reshape(groups, nb, 8, COLS), axis=3)
        quants ^= 0x80
    else:
        _interleave_rows(blocks[..., 2:], out[..., COLS * 2:].reshape(groups, nb, 32, COLS), axis=3)
    return out.reshape(-1)


def _stacked(pack: Callable[[np.ndarray], np.ndarray], rows: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """A stack of matrices packed matrix by matrix, one after another (into `out` when given)."""
    packed = np.concatenate([pack(m) for m in rows.reshape(-1, *rows.shape[-2:])])
    if out is None:
        return packed
    out[:] = packed
    return out


def _groups_out(out: np.ndarray | None, rows: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    """`out` (bytes) viewed as `shape` groups of COLS rows, or a new array; the padding rows
    of a last partial group zeroed."""
    if out is None:
        return np.zeros(shape, dtype)
    grouped = out.view(dtype).reshape(shape)
    if rows % COLS:
        grouped[-1] = 0
    return grouped


def _interleave_rows(rows: np.ndarray, out: np.ndarray, axis: int) -> None:
    """Row c of each group of COLS rows of `rows` ([n, ...]) into out[group, ..., c, ...], c at
    `axis`: one strided copy per c, several times faster in numpy than one transposing copy
    of small elements (what makes a load's packing run at GB/s)."""
    for c in range(COLS):
        part = rows[c::COLS]
        out[(slice(0, len(part)),) + (slice(None),) * (axis - 1) + (c,)] = part


# block types the CPU tiles decode 16 outputs at a time (pack_blocks_cols16): those whose
# decoders are arithmetic on bytes; the codebook types (a table lookup per element) go rowwise
TILED_BLOCK_TYPES = (DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q5_K,
                     DType.Q6_K)


# weight types whose products take Q8_0 activations in the `q8` numerics mode: the CPU tiles'
# types and Q8_0, whose sub-blocks (elements sharing a scale and offset) fit an activation
# block of 32 (32 long, or 16) and whose codes are integers. llama.cpp pairs Q8_0 .. Q5_1 with
# Q8_0 activations (Q8_1 for Q4_1 / Q5_1: the same quants, plus each block's sum), the
# K-quants with Q8_K (one scale per 256): here they take Q8_0 too, a finer quantisation
Q8_X_TYPES = (DType.Q8_0, *TILED_BLOCK_TYPES)


def cols16_layout(dtype: DType, dp4: bool = False) -> str:
    """The name of `dtype`'s CPU-tile pack (backends/plan.LAYOUTS); `dp4`: the one the tiles
    read 32-bit words of four codes from (Q8_0, DP4_TYPES)."""
    return f"{dtype.value}_cols16{'_dp4' if dp4 else ''}"


NIBBLES = 0x0F0F0F0F  # the low nibble of each byte of a 32-bit word


def _fifth_bits(bits):
    """Bits 0..3 of int `bits` as bit 4 of bytes 0..3."""
    return ((bits & 1) | ((bits & 2) << 7) | ((bits & 4) << 14) | ((bits & 8) << 21)) << 4


@dataclass(frozen=True)
class Dp4Words:
    """How the CPU tiles' integer dot products read a 4-to-6-bit type from its dp4 pack
    (pack_blocks_cols16_dp4): the block's first `head` and last `tail` bytes are its fields
    (f16 scales; Q3_K's and Q6_K's tails also their 8-bit scales), packed as
    pack_blocks_cols16 packs them, the bytes between as 32-bit words; `codes(word, s, q)`
    makes codes 4q .. 4q+3 of the
    block's run s of 32 elements (q a constant 0..7, s a constant or an index) as the unsigned
    bytes of an int, from `word(i)`, the pack block's i-th word; the code is that byte minus
    `bias`. Written with & | >> << only, so the same function builds kernel expressions and
    numpy arrays (tests/test_quant.py checks it against the block decoders).

    `order`: the block's words in the order the pack holds them, where the block's own is not
    the order a run first reads them in; the tail is then packed before the words, so a
    block is read front to back. A one-row product streams its weight at the speed its
    access order allows the prefetchers: Q6_K's block order (all of ql, all of qh 2 KB
    further, scales and d at the end) ran a decode's product at 19 GB/s, read front to back
    at 30.5-32.5, Q3_K's at 15 and 20 GB/s (65536 x 2048 from memory, 2-core EPYC Zen 4; from
    cache, 4096 rows, within 10% of each other)."""

    head: int
    codes: Callable
    bias: int = 0
    tail: int = 0
    order: tuple[int, ...] = ()

    def words(self, dtype: DType) -> int:
        return (dtype.block_bytes - self.head - self.tail) // 4

    @property
    def fields_first(self) -> int:
        """Bytes of fields the pack's block holds before its words."""
        return self.head + (self.tail if self.order else 0)

    def field_byte(self, byte, nbytes: int):
        """Where byte `byte` of a block of `nbytes`, one of its fields, sits in the pack's
        block: the head's where they are, the tail's after the head where the tail is packed
        first (`order`)."""
        if not self.order or (isinstance(byte, int) and byte < self.head):
            return byte
        return byte - (nbytes - self.tail) + self.head

    def word_byte(self, word: Callable, byte):
        """Byte `byte` of the block, one between its fields, from the pack's words (word(i)
        the i-th)."""
        at = byte - self.head
        return (word(at >> 2) >> ((at & 3) * 8)) & 255

    def pack_order(self, dtype: DType) -> np.ndarray:
        """The block's words in the pack's order (all of them)."""
        order = self.order or range(self.words(dtype))
        assert sorted(order) == list(range(self.words(dtype))), f"{dtype}: order is not a permutation of its words"
        return np.array(order)


def _low_nibbles(qs: int):
    """Q4_0 / Q4_1 order from word `qs` on: codes i and i + 16 share byte i (low, high)."""
    return lambda word, s, q: (word(qs + (q & 3)) >> (4 * (q >> 2))) & NIBBLES


def _with_qh(qs: int):
    """Q5_0 / Q5_1: the nibbles from word `qs` on, bit i of word 0 (qh) as code i's bit 4."""
    nibbles = _low_nibbles(qs)
    return lambda word, s, q: nibbles(word, s, q) | _fifth_bits(word(0) >> (4 * q))


def _k_nibbles(word, s, q):
    """Q4_K / Q5_K: 32 bytes from word 3 (byte 16) on hold sub-blocks 2p (low) and 2p + 1 (high)."""
    return (word(3 + 8 * (s >> 1) + q) >> (4 * (s & 1))) & NIBBLES


def _q5_k_codes(word, s, q):
    """Q5_K: the nibbles 32 bytes later (qh first), bit s of qh's byte e as code e's bit 4."""
    return ((word(11 + 8 * (s >> 1) + q) >> (4 * (s & 1))) & NIBBLES) | (((word(3 + q) >> s) & 0x01010101) << 4)


def _q6_k_codes(word, s, q):
    """Q6_K in Q6_K_ORDER: ql's bytes e of runs s (low nibble) and s + 2 (high), s & 1 = 0 or
    1 in the block's half s >> 2, and qh's byte e of that half's four runs (two bits each,
    2 (s & 3) up); each half is 24 words, ql's word q of the first pair of runs beside qh's
    word q, then ql's eight words of the second pair."""
    half = 24 * (s >> 2)
    low = (word(half + 2 * q + (s & 1) * (16 - q)) >> (4 * ((s >> 1) & 1))) & NIBBLES
    return low | (((word(half + 2 * q + 1) >> (2 * (s & 3))) & 0x03030303) << 4)


def _side_by_side(a: range, b: range) -> tuple[int, ...]:
    return tuple(w for pair in zip(a, b) for w in pair)


# the words in the order the runs of 32 first read them (four codes q at a time): Q3_K's
# hmask (words 0..7, read by every run) beside qs's first half (8..15), then its second half;
# Q6_K's halves (runs 0..3, 4..7) one after the other, each its 16 words of ql low nibbles
# (runs 4h and 4h + 1; the high nibbles are runs 4h + 2 and 4h + 3) with qh's 8 words beside
# the first 8
Q3_K_ORDER = (*_side_by_side(range(0, 8), range(8, 16)), *range(16, 24))
Q6_K_ORDER = (*_side_by_side(range(0, 8), range(32, 40)), *range(8, 16),
              *_side_by_side(range(16, 24), range(40, 48)), *range(24, 32))


def _q2_k_codes(word, s, q):
    """Q2_K: qs's 64 bytes from word 4 (byte 16), four 2-bit codes a byte: byte e of runs
    4 (s >> 2) .. at 32 (s >> 2) + e, bits 2 (s & 3)."""
    return (word(4 + 8 * (s >> 2) + q) >> (2 * (s & 3))) & 0x03030303


def _q3_k_codes(word, s, q):
    """Q3_K in Q3_K_ORDER: qs's byte e of the block's half s >> 2, bits 2 (s & 3) as Q2_K's,
    and hmask's byte e, bit s as code e's bit 2 (codes are that minus 4); hmask's word q
    beside qs's word q of the first half, then qs's eight words of the second."""
    return ((((word(2 * q) >> s) & 0x01010101) << 2)
            | ((word(2 * q + 1 + (s >> 2) * (15 - q)) >> (2 * (s & 3))) & 0x03030303))


DP4_TYPES = {DType.Q4_0: Dp4Words(2, _low_nibbles(0), 8), DType.Q4_1: Dp4Words(4, _low_nibbles(0)),
             DType.Q2_K: Dp4Words(0, _q2_k_codes, tail=4),
             DType.Q3_K: Dp4Words(0, _q3_k_codes, 4, tail=14, order=Q3_K_ORDER),
             DType.Q5_0: Dp4Words(2, _with_qh(1), 16), DType.Q5_1: Dp4Words(4, _with_qh(1)),
             DType.Q4_K: Dp4Words(4, _k_nibbles), DType.Q5_K: Dp4Words(4, _q5_k_codes),
             DType.Q6_K: Dp4Words(0, _q6_k_codes, 32, tail=18, order=Q6_K_ORDER)}


def pack_blocks_cols16(storage: np.ndarray, dtype: DType, out: np.ndarray | None = None) -> np.ndarray:
    """Rows of block type `dtype` (storage [n, nb * block_bytes], an even block size) in groups
    of 16 rows, block by block, as the blocks' 16-bit words side by side: word w of row c's
    block b of group g (its bytes 2w and 2w + 1, little-endian) at u16 index
    ((g * nb + b) * block_bytes / 2 + w) * 16 + c. So one 16-wide u16 load holds the same word
    of 16 rows' blocks, and the CPU tiles run a block decoder (dflash_ir/blocks.py) on 16
    outputs at once, every read a vector. Rows past n (to a multiple of 16) are zero. A stack of
    matrices is packed matrix by matrix, and `out` is as pack_q8_0_cols16's."""
    nbytes = dtype.block_bytes
    if not dtype.is_block or nbytes % 2:
        raise ValueError(f"pack_blocks_cols16 packs block types of an even block size, not {dtype}")
    rows = np.ascontiguousarray(storage, dtype=np.uint8)
    if rows.ndim > 2:
        return _stacked(functools.partial(pack_blocks_cols16, dtype=dtype), rows, out)
    words = rows.reshape(-1, rows.shape[-1]).view("<u2")                          # [row, b * w]
    out = _groups_out(out, len(words), (-(-len(words) // COLS), words.shape[1], COLS), "<u2")  # [g, b * w, row]
    _interleave_rows(words, out, axis=2)
    return out.view(np.uint8).reshape(-1)


def pack_blocks_cols16_dp4(storage: np.ndarray, dtype: DType, out: np.ndarray | None = None) -> np.ndarray:
    """pack_blocks_cols16 for the integer dot products of the CPU tiles (DP4_TYPES): a block's
    fields (head and tail) as 16-bit words side by side, as there, and the 32-bit words
    between them side by side, so one 16-wide u32 load holds the same four bytes (four codes'
    nibbles, or their high bits) of 16 rows' blocks. Group g's block b starts at byte
    (g * nb + b) * block_bytes * 16: its head, its words, its tail, each byte at 16 times its
    offset in the block; or with an `order`, its head, its tail, its words in that order."""
    layout, nbytes = DP4_TYPES[dtype], dtype.block_bytes
    rows = np.ascontiguousarray(storage, dtype=np.uint8)
    if rows.ndim > 2:
        return _stacked(functools.partial(pack_blocks_cols16_dp4, dtype=dtype), rows, out)
    blocks = rows.reshape(-1, rows.shape[-1] // nbytes, nbytes)                     # [row, b, bytes]
    groups, nb = -(-len(blocks) // COLS), blocks.shape[1]
    out = _groups_out(out, len(blocks), (groups, nb, nbytes * COLS), np.uint8)
    head, end = layout.head, nbytes - layout.tail
    head_fields, tail_fields = (np.ascontiguousarray(f).view("<u2") for f in (blocks[..., :head], blocks[..., end:]))
    words = np.ascontiguousarray(blocks[..., head:end]).view("<u4")
    if layout.order:
        parts = (head_fields, tail_fields, words[..., layout.pack_order(dtype)])
    else:
        parts = (head_fields, words, tail_fields)
    at = 0
    for part in parts:
        stop = at + part.shape[-1] * part.itemsize
        if stop > at:
            into = out[..., at * COLS:stop * COLS].view(part.dtype).reshape(groups, nb, -1, COLS)
            _interleave_rows(part, into, axis=3)
        at = stop
    return out.reshape(-1)

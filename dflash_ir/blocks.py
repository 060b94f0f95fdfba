"""The GGUF block-quant layouts, each written once as a *block decoder*.

Every type's element i of a block is `scale(j) * code(i) [+ offset(j)]`, j = i // sub the
sub-block sharing a scale (and a min): a `BlockFormat` holds `sub` and the three parts as
functions of a reader `r` and an index. The numpy reference (quant.py) calls them with arrays
of indices and a reader over many blocks at once; the kernel layer (backends/kernels/access.py
and backends/tvm/tir.py) with kernel expressions and readers that emit loads, and can decode a
sub-block's scale once for all its elements. So the layout facts live here only, and every
consumer decodes the same way. The parts use only what every side shares: integer + - * << >>
& | ^ on indices and bytes (the index or byte on the left of a shift), comparisons with <,
negation, and the reader's methods:

    r.u8(byte)          the block's byte at `byte` (an index expression), as an int
    r.f16(byte)         the f16 at a constant even byte, as f32
    r.f32(x)            an int as f32
    r.f32_bits(x)       the f32 whose bits are int x
    r.select(c, a, b)   a where c, else b
    r.table(name, v, q) entry q of the constant table `v` (f32)

The arithmetic is ggml's, in ggml's order ((d * sc) * q - dmin * m for the K-quants: the
offset is -(dmin * m), and adding a negated value is subtracting it, exactly), so the numpy
decoders equal gguf-py's dequantisation bit for bit (tests/test_quant_types.py).
Layouts: ggml-common.h block_q4_0 .. block_q6_K, block_iq4_nl, block_iq4_xs, block_mxfp4.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .dtypes import DType

# non-linear 4-bit codebooks: IQ4_NL / IQ4_XS (kvalues_iq4nl) and MXFP4 (E2M1 values, doubled)
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def bits(r, i, at: int, run: int, width: int):
    """Field `i` of `width` bits (1, 2 or 4) in a packed array at byte `at`, ggml's packing:
    runs of `run` consecutive bytes hold consecutive fields, the next run of fields goes in
    the next higher bits of the same bytes, and after 8 / width runs the next bytes start."""
    per_byte = 8 // width
    span = (run * per_byte).bit_length() - 1  # log2 of the fields one run of bytes holds
    byte = at + run * (i >> span) + (i & (run - 1))
    shift = width * ((i >> (run.bit_length() - 1)) & (per_byte - 1))
    return (r.u8(byte) >> shift) & ((1 << width) - 1)


def _signed(x):
    """A byte read as int8."""
    return (x ^ 128) - 128


def _k4_scale_min(r, j, at: int):
    """6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block, 12 bytes at `at`:
    j < 4 in the low 6 bits of bytes j and 4 + j; j >= 4 in the nibbles of byte 4 + j with
    the top bits of bytes j - 4 and j as bits 4..5."""
    lo = j & 3
    first, mins, last = r.u8(at + lo), r.u8(at + 4 + lo), r.u8(at + 8 + lo)
    scale = r.select(j < 4, first & 63, (last & 15) | ((first >> 6) << 4))
    minimum = r.select(j < 4, mins & 63, (last >> 4) | ((mins >> 6) << 4))
    return scale, minimum


def _d(r, j):
    """The block's one f16 scale (every sub-block's)."""
    return r.f16(0)


def _m(r, j):
    """The f16 min of Q4_1 / Q5_1, added to every element."""
    return r.f16(2)


def _q5_low(at_qh: int, at_qs: int):
    """The 5-bit code of Q5_0 / Q5_1: low nibble, bit i of the 32-bit qh as bit 4, read from
    the little-endian 16-bit half holding it, moved up by 4: 16 consecutive elements from a
    multiple of 16 then read the same two bytes (a kernel's vector lanes one broadcast word,
    where a byte per 8 elements was a gather; one-row 4096 x 4096 Q5_0 on tvm-llvm 4.25 ->
    0.90 ms, opencl's 0.73)."""
    def code(r, i):
        at = at_qh + ((i >> 4) << 1)
        return bits(r, i, at_qs, 16, 4) | ((((r.u8(at + 1) << 12) | (r.u8(at) << 4)) >> (i & 15)) & 16)
    return code


def _k_scale(at_d: int, sub_scale):
    return lambda r, j: r.f16(at_d) * r.f32(sub_scale(r, j))


def _k4_scale(r, j):
    return _k4_scale_min(r, j, 4)[0]


def _k4_min(r, j):
    return -(r.f16(2) * r.f32(_k4_scale_min(r, j, 4)[1]))


def _q3_k_scale(r, j):
    return (bits(r, j, 96, 8, 4) | (bits(r, j, 104, 4, 2) << 4)) - 32


def _iq4_xs_scale(r, j):
    return (bits(r, j, 4, 1, 4) | (bits(r, j, 2, 1, 2) << 4)) - 32


def _mxfp4_scale(r, j):
    """The shared E8M0 exponent e scales by 2^(e - 128) (half of 2^(e - 127): the codebook is
    doubled); e < 2 gives a subnormal f32 (2^-128 is 0x00200000 as bits, 2^-127 twice that)."""
    e = r.u8(0)
    return r.f32_bits(r.select(e < 2, (e + 1) * 0x00200000, (e - 1) << 23))


@dataclass(frozen=True)
class BlockFormat:
    """How a block type's element values are made (module docstring): `sub` elements share
    `scale(r, j)` and `offset(r, j)` (None: nothing added); `code(r, i)` is element i's f32 code."""

    sub: int
    scale: Callable[[Any, Any], Any]
    code: Callable[[Any, Any], Any]
    offset: Callable[[Any, Any], Any] | None = None

    def value(self, r, i):
        """Element i's value: the parts combined in ggml's order."""
        v = self.scale(r, i >> (self.sub.bit_length() - 1)) * self.code(r, i)
        return v if self.offset is None else v + self.offset(r, i >> (self.sub.bit_length() - 1))


DECODERS: dict[DType, BlockFormat] = {
    DType.Q4_0: BlockFormat(32, _d, lambda r, i: r.f32(bits(r, i, 2, 16, 4) - 8)),
    DType.Q4_1: BlockFormat(32, _d, lambda r, i: r.f32(bits(r, i, 4, 16, 4)), _m),
    DType.Q5_0: BlockFormat(32, _d, lambda r, i: r.f32(_q5_low(2, 6)(r, i) - 16)),
    DType.Q5_1: BlockFormat(32, _d, lambda r, i: r.f32(_q5_low(4, 8)(r, i)), _m),
    DType.Q2_K: BlockFormat(16, _k_scale(80, lambda r, j: r.u8(j) & 15), lambda r, i: r.f32(bits(r, i, 16, 32, 2)),
                            lambda r, j: -(r.f16(82) * r.f32(r.u8(j) >> 4))),
    # a clear high bit (hmask) means -4
    DType.Q3_K: BlockFormat(16, _k_scale(108, _q3_k_scale),
                            lambda r, i: r.f32((bits(r, i, 32, 32, 2) | (bits(r, i, 0, 32, 1) << 2)) - 4)),
    DType.Q4_K: BlockFormat(32, _k_scale(0, _k4_scale), lambda r, i: r.f32(bits(r, i, 16, 32, 4)), _k4_min),
    DType.Q5_K: BlockFormat(32, _k_scale(0, _k4_scale),
                            lambda r, i: r.f32(bits(r, i, 48, 32, 4) | (bits(r, i, 16, 32, 1) << 4)), _k4_min),
    DType.Q6_K: BlockFormat(16, _k_scale(208, lambda r, j: _signed(r.u8(192 + j))),
                            lambda r, i: r.f32((bits(r, i, 0, 64, 4) | (bits(r, i, 128, 32, 2) << 4)) - 32)),
    DType.IQ4_NL: BlockFormat(32, _d, lambda r, i: r.table("iq4", IQ4_VALUES, bits(r, i, 2, 16, 4))),
    DType.IQ4_XS: BlockFormat(32, _k_scale(0, _iq4_xs_scale),
                              lambda r, i: r.table("iq4", IQ4_VALUES, bits(r, i, 8, 16, 4))),
    DType.MXFP4: BlockFormat(32, _mxfp4_scale, lambda r, i: r.table("mxfp4", MXFP4_VALUES, bits(r, i, 1, 16, 4))),
}

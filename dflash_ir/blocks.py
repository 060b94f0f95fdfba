"""The GGUF block-quant layouts, each written once as a *block decoder*.

A decoder is a function `decode(r, i)`: the f32 value of element `i` of one block, built
from reads of the block's bytes through a reader `r`. The numpy reference (quant.py) calls
it with `i` an array of every element index and a reader over many blocks at once; the
kernel layer (backends/kernels/access.py) calls it with `i` a kernel expression and a
reader that emits loads. So the layout facts live here only, and every consumer decodes
the same way. Decoders use only what both sides share: integer + - * << >> & | on the
indices and bytes (with the kernel value on the left of a shift), comparisons with <, and
the reader's methods:

    r.u8(byte)          the block's byte at `byte` (an index expression), as an int
    r.f16(byte)         the f16 at a constant even byte, as f32
    r.f32(x)            an int as f32
    r.f32_bits(x)       the f32 whose bits are int x
    r.select(c, a, b)   a where c, else b
    r.table(name, v, q) entry q of the constant table `v` (f32)

The arithmetic is ggml's, in ggml's order ((d * sc) * q - dmin * m for the K-quants),
so the numpy decoders equal gguf-py's dequantisation bit for bit (tests/test_quant_types.py).
Layouts: ggml-common.h block_q4_0 .. block_q6_K, block_iq4_nl, block_iq4_xs, block_mxfp4.
"""
from __future__ import annotations

from typing import Any, Callable

from .dtypes import DType

Decoder = Callable[[Any, Any], Any]

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


def _q4_0(r, i):
    return r.f16(0) * r.f32(bits(r, i, 2, 16, 4) - 8)


def _q4_1(r, i):
    return r.f16(0) * r.f32(bits(r, i, 4, 16, 4)) + r.f16(2)


def _q5_0(r, i):
    q = bits(r, i, 6, 16, 4) | (bits(r, i, 2, 1, 1) << 4)
    return r.f16(0) * r.f32(q - 16)


def _q5_1(r, i):
    q = bits(r, i, 8, 16, 4) | (bits(r, i, 4, 1, 1) << 4)
    return r.f16(0) * r.f32(q) + r.f16(2)


def _q2_k(r, i):
    sc = r.u8(i >> 4)
    return r.f16(80) * r.f32(sc & 15) * r.f32(bits(r, i, 16, 32, 2)) - r.f16(82) * r.f32(sc >> 4)


def _q3_k(r, i):
    j = i >> 4
    sc = bits(r, j, 96, 8, 4) | (bits(r, j, 104, 4, 2) << 4)
    q = bits(r, i, 32, 32, 2) | (bits(r, i, 0, 32, 1) << 2)  # a clear high bit means -4
    return r.f16(108) * r.f32(sc - 32) * r.f32(q - 4)


def _q4_k(r, i):
    sc, m = _k4_scale_min(r, i >> 5, 4)
    return r.f16(0) * r.f32(sc) * r.f32(bits(r, i, 16, 32, 4)) - r.f16(2) * r.f32(m)


def _q5_k(r, i):
    sc, m = _k4_scale_min(r, i >> 5, 4)
    q = bits(r, i, 48, 32, 4) | (bits(r, i, 16, 32, 1) << 4)
    return r.f16(0) * r.f32(sc) * r.f32(q) - r.f16(2) * r.f32(m)


def _q6_k(r, i):
    q = bits(r, i, 0, 64, 4) | (bits(r, i, 128, 32, 2) << 4)
    return r.f16(208) * r.f32(_signed(r.u8(192 + (i >> 4)))) * r.f32(q - 32)


def _iq4_nl(r, i):
    return r.f16(0) * r.table("iq4", IQ4_VALUES, bits(r, i, 2, 16, 4))


def _iq4_xs(r, i):
    j = i >> 5
    scale = bits(r, j, 4, 1, 4) | (bits(r, j, 2, 1, 2) << 4)
    return r.f16(0) * r.f32(scale - 32) * r.table("iq4", IQ4_VALUES, bits(r, i, 8, 16, 4))


def _mxfp4(r, i):
    """The shared E8M0 exponent e scales by 2^(e - 128) (half of 2^(e - 127): the codebook is
    doubled); e < 2 gives a subnormal f32 (2^-128 is 0x00200000 as bits, 2^-127 twice that)."""
    e = r.u8(0)
    d = r.f32_bits(r.select(e < 2, (e + 1) * 0x00200000, (e - 1) << 23))
    return d * r.table("mxfp4", MXFP4_VALUES, bits(r, i, 1, 16, 4))


DECODERS: dict[DType, Decoder] = {
    DType.Q4_0: _q4_0, DType.Q4_1: _q4_1, DType.Q5_0: _q5_0, DType.Q5_1: _q5_1, DType.Q2_K: _q2_k,
    DType.Q3_K: _q3_k, DType.Q4_K: _q4_k, DType.Q5_K: _q5_k, DType.Q6_K: _q6_k, DType.IQ4_NL: _iq4_nl,
    DType.IQ4_XS: _iq4_xs, DType.MXFP4: _mxfp4,
}

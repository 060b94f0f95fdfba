"""dflash_ir.quant against gguf-py's bit-exact reference (gguf.quants)."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as ref

from dflash_ir.dtypes import DType
from dflash_ir.quant import dequantize, quantize, quantize_q8_0, storage_shape


def _awkward_rows() -> np.ndarray:
    """Blocks of 32 that stress rounding and scaling; one block per row."""
    rng = np.random.default_rng(1)
    ramp = np.arange(32, dtype=np.float32)
    rows = [
        np.zeros(32),  # d == 0: quants must be 0, not NaN
        ramp - 15.5,  # many exact .5 ties after scaling (amax 15.5 -> id 127/15.5)
        (ramp - 16) * np.float32(127 / 16),  # x*id lands on integers and halves
        np.where(ramp % 2 == 0, 1.0, -1.0) * 127,  # amax exactly 127
        -np.abs(rng.standard_normal(32)),  # all negative
        rng.standard_normal(32) * 1e30,  # huge
        rng.standard_normal(32) * 1e7,  # d overflows fp16
        rng.standard_normal(32) * 1e-30,  # tiny
        rng.standard_normal(32) * 1e-7,  # d underflows to fp16 subnormal / zero
        np.full(32, 0.49999997),
        np.concatenate([[1.0], np.zeros(31)]),
    ]
    return np.stack(rows).astype(np.float32)


def _random(shape, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.uniform(-8, 8, size=shape[:-1] + (1,)))
    return (rng.standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("shape", [(32,), (7, 64), (2, 3, 96), (4, 1, 2, 256)])
def test_q8_0_quantize_matches_gguf(shape):
    x = _random(shape)
    q = quantize_q8_0(x)
    assert q.dtype == np.uint8 and q.shape == storage_shape(shape, DType.Q8_0)
    assert np.array_equal(q, ref.quantize(x, GT.Q8_0))


def test_q8_0_edge_blocks_match_gguf():
    x = _awkward_rows()
    with np.errstate(all="ignore"):
        expected = ref.quantize(x, GT.Q8_0)
    assert np.array_equal(quantize_q8_0(x), expected)
    assert np.array_equal(quantize(x, DType.Q8_0), expected)


def test_q8_0_round_half_away_from_zero():
    x = np.zeros(32, np.float32)
    x[:4] = [127.0, 0.5, -0.5, -1.5]  # amax 127 -> id 1: the values are the quants
    qs = quantize_q8_0(x)[2:].view(np.int8)
    assert qs[:4].tolist() == [127, 1, -1, -2]


def test_q8_0_dequantize_matches_gguf():
    rng = np.random.default_rng(2)
    storage = rng.integers(0, 256, size=(5, 3, 4 * 34), dtype=np.uint8)
    d = rng.standard_normal((5, 3, 4)).astype(np.float16)  # finite scales only
    storage.reshape(5, 3, 4, 34)[..., :2] = d.view(np.uint8).reshape(5, 3, 4, 2)
    got = dequantize(storage, DType.Q8_0)
    assert got.dtype == np.float32 and got.shape == (5, 3, 128)
    assert np.array_equal(got, ref.dequantize(storage, GT.Q8_0))


def test_q8_0_dequantize_rows_of_a_table():
    x = _random((10, 64))
    q = quantize_q8_0(x)
    rows = [7, 2, 2]
    assert np.array_equal(dequantize(q[rows], DType.Q8_0), dequantize(q, DType.Q8_0)[rows])


def test_q8_0_round_trip_error_bound():
    x = (np.random.default_rng(5).standard_normal((16, 64)) * 3).astype(np.float32)  # fp16-normal scales
    back = dequantize(quantize_q8_0(x), DType.Q8_0)
    amax = np.abs(x.reshape(16, 2, 32)).max(axis=-1, keepdims=True)
    err = np.abs(back - x).reshape(16, 2, 32)
    half_step_plus_fp16_scale_error = 0.5 + 127 * 2.0**-11
    assert np.all(err <= amax / 127 * half_step_plus_fp16_scale_error * 1.001)


@pytest.mark.parametrize("shape", [(5,), (3, 33), (2, 2, 8)])
def test_bf16_matches_gguf(shape):
    x = _random(shape, seed=3)
    x.flat[0] = np.nan
    x.flat[-1] = -np.inf
    bits = quantize(x, DType.BF16)
    assert bits.dtype == np.uint16 and bits.shape == shape
    assert np.array_equal(bits.view(np.uint8), ref.quantize(x, GT.BF16).reshape(*shape[:-1], -1))
    expected = ref.dequantize(bits.view(np.uint8), GT.BF16)
    assert np.array_equal(dequantize(bits, DType.BF16), expected, equal_nan=True)


def test_bf16_rounds_to_nearest_even():
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20], np.float32)  # tie down, tie up, above tie
    assert dequantize(quantize(x, DType.BF16), DType.BF16).tolist() == [1.0, 1 + 2**-6, 1 + 2**-7]


def test_f16_and_f32_match_gguf():
    x = _random((4, 40), seed=4)
    half = quantize(x, DType.F16)
    assert half.dtype == np.float16
    assert np.array_equal(half, ref.quantize(x, GT.F16))
    assert np.array_equal(dequantize(half, DType.F16), ref.dequantize(half, GT.F16))
    full = quantize(x, DType.F32)
    assert np.array_equal(dequantize(full, DType.F32), x)


def test_dequantize_returns_a_writable_copy():
    x = np.ones((2, 4), np.float32)
    x.flags.writeable = False
    out = dequantize(x, DType.F32)
    out[0, 0] = 5
    assert x[0, 0] == 1


def test_storage_shape():
    assert storage_shape((248320, 64), DType.Q8_0) == (248320, 68)
    assert storage_shape((3, 5), DType.BF16) == (3, 5)
    with pytest.raises(ValueError, match="multiple of 32"):
        storage_shape((4, 48), DType.Q8_0)


@pytest.mark.parametrize(
    ("storage", "dtype", "match"),
    [
        (np.zeros((2, 33), np.uint8), DType.Q8_0, "multiple of 34"),
        (np.zeros(4, np.float32), DType.F16, "numpy dtype float16"),
        (np.zeros(4, np.float16), DType.BF16, "numpy dtype uint16"),
        (np.zeros(4, np.int32), DType.I32, "cannot dequantize i32"),
    ],
)
def test_dequantize_rejects_bad_storage(storage, dtype, match):
    with pytest.raises(ValueError, match=match):
        dequantize(storage, dtype)


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="cannot quantize to i32"):
        quantize(np.zeros(4), DType.I32)


@pytest.mark.parametrize("dp4", [False, True])
def test_q8_0_cols16_packs_each_quant_where_the_tiles_read_it(dp4):
    """Group g, block b at byte (g * nb + b) * 544: 16 f16 scales, then quant (row, 32 b + kk)
    at 32 + 16 kk + lane, or with dp4 at 32 + 64 (kk / 4) + 4 lane + kk % 4 as the unsigned
    byte q + 128; rows padded with quants 0."""
    from dflash_ir.quant import COLS_BLOCK_BYTES, pack_q8_0_cols16

    n, k = 21, 96
    storage = quantize(np.random.default_rng(3).standard_normal((n, k)).astype(np.float32), DType.Q8_0)
    blocks = storage.reshape(n, k // 32, 34)
    packed = pack_q8_0_cols16(storage, dp4=dp4)
    assert packed.size == 2 * (k // 32) * COLS_BLOCK_BYTES
    for row in range(32):
        g, lane = divmod(row, 16)
        for b in range(k // 32):
            at = (g * (k // 32) + b) * COLS_BLOCK_BYTES
            want = blocks[row, b] if row < n else np.zeros(34, np.uint8)
            assert bytes(packed[at + 2 * lane:at + 2 * lane + 2]) == bytes(want[:2])
            for kk in range(32):
                offset = 64 * (kk // 4) + 4 * lane + kk % 4 if dp4 else 16 * kk + lane
                quant = int(want[2 + kk].view(np.int8))
                assert packed[at + 32 + offset] == (quant + 128 if dp4 else quant & 0xFF)



@pytest.mark.parametrize("dtype", [DType.Q4_K, DType.Q6_K, DType.Q5_0, DType.Q4_1])
def test_block_cols16_packs_each_word_where_the_tiles_read_it(dtype):
    """Word w (bytes 2w, 2w + 1) of row (16 g + lane)'s block b at u16 index
    ((g * nb + b) * bytes / 2 + w) * 16 + lane; rows past n zero."""
    from dflash_ir.quant import pack_blocks_cols16

    n, nb = 21, 2
    storage = np.random.default_rng(4).integers(0, 256, (n, nb * dtype.block_bytes), dtype=np.uint8)
    words = pack_blocks_cols16(storage, dtype).view("<u2")
    W = dtype.block_bytes // 2
    assert words.size == 32 * nb * W
    for row in range(32):
        g, lane = divmod(row, 16)
        for b in range(nb):
            block = storage[row, b * dtype.block_bytes:(b + 1) * dtype.block_bytes] if row < n else None
            for w in range(W):
                want = 0 if block is None else int(block[2 * w]) + 256 * int(block[2 * w + 1])
                assert words[((g * nb + b) * W + w) * 16 + lane] == want


def test_block_cols16_refuses_odd_blocks_and_packs_expert_banks_matrix_by_matrix():
    from dflash_ir.quant import pack_blocks_cols16

    with pytest.raises(ValueError, match="even block size"):
        pack_blocks_cols16(np.zeros((16, 17), np.uint8), DType.MXFP4)
    bank = np.random.default_rng(5).integers(0, 256, (3, 20, 144), dtype=np.uint8)  # 3 experts of 20 rows
    packed = pack_blocks_cols16(bank, DType.Q4_K)
    per = pack_blocks_cols16(bank[0], DType.Q4_K).size
    assert packed.size == 3 * per
    assert all(np.array_equal(packed[e * per:(e + 1) * per], pack_blocks_cols16(bank[e], DType.Q4_K)) for e in range(3))
    into = np.full(packed.size, 0xA5, np.uint8)  # a mapped buffer's old bytes
    assert pack_blocks_cols16(bank, DType.Q4_K, out=into) is into and np.array_equal(into, packed)

DP4 = [DType.Q4_0, DType.Q4_1, DType.Q5_0, DType.Q5_1, DType.Q2_K, DType.Q3_K, DType.Q4_K, DType.Q5_K, DType.Q6_K]


def test_every_type_of_the_cpu_tiles_has_dp4_words():
    from dflash_ir.quant import DP4_TYPES, Q8_X_TYPES, TILED_BLOCK_TYPES

    assert set(DP4_TYPES) == set(TILED_BLOCK_TYPES) == set(DP4) == set(Q8_X_TYPES) - {DType.Q8_0}


@pytest.mark.parametrize("dtype", DP4)
def test_block_cols16_dp4_packs_f16_fields_and_32_bit_words_where_the_tiles_read_them(dtype):
    """Row (16 g + lane)'s block b at byte B = (g * nb + b) * bytes * 16: a 16-bit field at
    byte f of the head or the tail at B + 16 f' + 2 lane, its 32-bit word w at B + 16 F +
    64 w' + 4 lane, where f' = f and w' = w and F is the head's bytes in the block's order;
    with an `order`, the tail follows the head (f' = head + f - tail's start), F is head +
    tail, and w' is w's place in the order."""
    from dflash_ir.quant import DP4_TYPES, pack_blocks_cols16_dp4

    n, nb, nbytes, layout = 21, 3, dtype.block_bytes, DP4_TYPES[dtype]
    head, tail = layout.head, nbytes - layout.tail
    fields = {f: f for f in range(0, head, 2)} | {
        f: head + f - tail if layout.order else f for f in range(tail, nbytes, 2)}
    places = {w: i for i, w in enumerate(layout.order or range(layout.words(dtype)))}
    first = head + layout.tail if layout.order else head
    storage = np.random.default_rng(6).integers(0, 256, (n, nb * nbytes), dtype=np.uint8)
    packed = pack_blocks_cols16_dp4(storage, dtype)
    assert packed.size == 32 * nb * nbytes
    for row in range(32):
        g, lane = divmod(row, 16)
        for b in range(nb):
            block = storage[row, b * nbytes:(b + 1) * nbytes] if row < n else np.zeros(nbytes, np.uint8)
            at = (g * nb + b) * nbytes * 16
            for f, to in fields.items():
                assert bytes(packed[at + 16 * to + 2 * lane:][:2]) == bytes(block[f:f + 2])
            for w, to in places.items():
                word = block[head + 4 * w:head + 4 * w + 4]
                assert bytes(packed[at + 16 * first + 64 * to + 4 * lane:][:4]) == bytes(word)


@pytest.mark.parametrize("dtype", [DType.Q3_K, DType.Q6_K])
def test_a_dp4_pack_with_an_order_is_read_front_to_back(dtype):
    """The order the tiles first read a block's words in (runs of 32 in order, four codes q
    at a time) is the pack's: each word first read after the one before it (the fields,
    packed before them, are read first: each sub-block's scale before its codes)."""
    from dflash_ir.quant import DP4_TYPES

    words, firsts = DP4_TYPES[dtype], []
    assert words.order

    def word(i):
        if i not in firsts:
            firsts.append(i)
        return 0
    for s in range(dtype.block_size // 32):
        for q in range(8):
            words.codes(word, s, q)
    assert firsts == list(range(words.words(dtype)))


@pytest.mark.parametrize("dtype", DP4)
def test_dp4_words_describe_the_block_decoders(dtype):
    """What the VPDPBUSD tiles read of each type (quant.DP4_TYPES), run on numpy words of random
    blocks: codes(word, s, q) are the codes 4q .. 4q+3 of run s, plus bias, that its decoder
    (dflash_ir/blocks.py) gives. (Where the f16 fields are, the pack test checks.)"""
    from dflash_ir.quant import DP4_TYPES, block_parts

    words, n = DP4_TYPES[dtype], 40
    blocks = np.random.default_rng(7).integers(0, 256, (n, dtype.block_bytes), dtype=np.uint8)
    end = dtype.block_bytes - words.tail
    for f in [*range(0, words.head, 2), *range(end, dtype.block_bytes, 2)]:  # finite scales
        blocks[:, f:f + 2] = np.float16([0.5]).view(np.uint8)
    wide = np.ascontiguousarray(blocks[:, words.head:end]).view("<u4").astype(np.int64)  # [n, words]
    assert wide.shape[1] == words.words(dtype)
    wide = wide[:, words.pack_order(dtype)]  # as the pack holds them
    _, codes, _ = block_parts(blocks, dtype)  # [n, subs, sub]
    codes = codes.reshape(n, -1, 32)  # runs of 32
    for s in range(dtype.block_size // 32):
        for q in range(8):
            got = words.codes(lambda i: wide[:, i], s, q)
            unpacked = (got[:, None] >> (8 * np.arange(4))) & 255
            assert np.array_equal(unpacked - words.bias, codes[:, s, 4 * q:4 * q + 4]), (s, q)

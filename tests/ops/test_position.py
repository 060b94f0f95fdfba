import math
import re

import numpy as np
import pytest

from dflash_ir.ops.position import RotaryPairs, inv_freq_f32, rotate
from dflash_ir.ops.registry import OpError, get_op
from dflash_ir.types import parse_type
from written_once import written_out

F = np.float32
rng = np.random.default_rng(3)


def types(name, *inputs, **attrs):
    return [str(t) for t in get_op(name).output_types([parse_type(t) for t in inputs], attrs)]


def rope(x, pos, **attrs):
    (out,) = get_op("rope").run([x, pos], attrs)
    return out


def rotate_pairs(x, angles, n_rot):
    """x[T, H, D] with pair (i, i + n_rot/2) of row t turned by angles[t][i] (python floats)."""
    y = x.astype(np.float64)
    half = n_rot // 2
    for t in range(x.shape[0]):
        for h in range(x.shape[1]):
            for i in range(half):
                c, s = math.cos(angles[t][i]), math.sin(angles[t][i])
                a, b = float(x[t, h, i]), float(x[t, h, i + half])
                y[t, h, i], y[t, h, i + half] = a * c - b * s, a * s + b * c
    return y


def test_neox_pairs_over_the_first_n_rot_dims():
    x = rng.standard_normal((3, 2, 10)).astype(F)
    positions = [0, 1, 7]
    theta, n_rot = 10000.0, 6
    angles = [[p * theta ** (-2 * i / n_rot) for i in range(n_rot // 2)] for p in positions]
    out = rope(x, np.array(positions, np.int32), n_rot=n_rot, theta=theta)
    assert out.dtype == F
    np.testing.assert_allclose(out, rotate_pairs(x, angles, n_rot), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[..., n_rot:], x[..., n_rot:])
    np.testing.assert_array_equal(out[0], x[0])  # position 0 is the identity


@pytest.mark.parametrize("n_rot", [6, 10])
def test_adjacent_pairs_are_halves_on_llama_cpps_permuted_rows(n_rot):
    """llama.cpp's converter stores HF dim s * n_rot/2 + i of a head at dim 2i + s; rotating
    adjacent pairs of that order is the NeoX rotation of HF's order, bit for bit."""
    x = rng.standard_normal((3, 2, 10)).astype(F)
    half = n_rot // 2
    stored = [s * half + i for i in range(half) for s in (0, 1)] + list(range(n_rot, 10))
    positions = np.array([0, 5, 900], np.int32)
    adjacent = rope(x[..., stored], positions, n_rot=n_rot, theta=1e4, pairs="adjacent")
    np.testing.assert_array_equal(adjacent, rope(x, positions, n_rot=n_rot, theta=1e4)[..., stored])


def test_freq_factors_divide_each_inverse_frequency():
    """Llama 3's scaling (llama.cpp's rope_freqs.weight): frequency i runs factor_i times slower."""
    x = rng.standard_normal((3, 2, 8)).astype(F)
    positions, theta, factors = [0, 3, 40], 10000.0, (1.0, 2.5, 8.0)
    angles = [[p * theta ** (-2 * i / 6) / factors[i] for i in range(3)] for p in positions]
    out = rope(x, np.array(positions, np.int32), n_rot=6, theta=theta, freq_factors=factors)
    np.testing.assert_allclose(out, rotate_pairs(x, angles, 6), rtol=1e-5, atol=1e-5)


def test_one_row_full_rotation():
    x = rng.standard_normal((1, 1, 4)).astype(F)
    out = rope(x, np.array([2], np.int32), n_rot=4, theta=1e7)
    angles = [[2.0, 2.0 * 1e7 ** -0.5]]
    np.testing.assert_allclose(out, rotate_pairs(x, angles, 4), rtol=1e-5, atol=1e-6)


def test_inv_freq_is_float32_within_two_ulp_of_an_f32_pow():
    """HF: inv_freq = 1 / (base ** (arange(0, d, 2).float() / d)) in f32; ours rounds pow correctly."""
    for n_rot, theta in ((64, 1e7), (128, 1e6), (64, 1e4)):
        ours = inv_freq_f32(n_rot, theta)
        f32_pow = F(1) / (F(theta) ** (np.arange(0, n_rot, 2, dtype=F) / F(n_rot)))
        assert ours.dtype == F
        assert np.abs(ours.view(np.int32) - f32_pow.view(np.int32)).max() <= 2


def test_angle_is_a_float32_product_like_hf():
    """freqs = pos.float() * inv_freq in f32: at large positions this rounding is visible."""
    n_rot, theta = 64, 1e7
    positions = np.array([5, 4097, 100_003, 262_143], np.int32)
    freqs = positions.astype(F)[:, None] * inv_freq_f32(n_rot, theta)
    x = rng.standard_normal((4, 1, n_rot)).astype(F)
    cos, sin = np.cos(freqs)[:, None], np.sin(freqs)[:, None]
    x1, x2 = x[..., :32], x[..., 32:]
    hf = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    np.testing.assert_allclose(rope(x, positions, n_rot=n_rot, theta=theta), hf, atol=3e-6)


def _hf_cos_sin(freqs):
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb.astype(np.float64)), np.sin(emb.astype(np.float64))


def _hf_rotate(x, cos, sin):
    half = cos.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:2 * half], x[..., :half]], axis=-1)
    y = x.astype(np.float64)
    y[..., :2 * half] = x[..., :2 * half] * cos[:, None] + rotated * sin[:, None]
    return y


def _component_freqs(pos, n_rot, theta):
    """[3, T, n_rot/2]: the frequencies of each position component (HF's freqs before mixing)."""
    inv = theta ** (-np.arange(0, n_rot, 2) / n_rot)
    return np.stack([pos[:, c, None] * inv for c in range(3)])


def test_interleaved_mrope_matches_hf_apply_interleaved_mrope():
    sections, n_rot = (11, 11, 10), 64
    pos = rng.integers(0, 50, (5, 3)).astype(np.int32)
    freqs = _component_freqs(pos, n_rot, 1e7)
    freqs_t = freqs[0].copy()  # transcription of HF `apply_interleaved_mrope`
    for dim, offset in enumerate((1, 2), start=1):
        length = sections[dim] * 3
        idx = slice(offset, length, 3)
        freqs_t[..., idx] = freqs[dim, ..., idx]
    x = rng.standard_normal((5, 2, 80)).astype(F)
    expected = _hf_rotate(x, *_hf_cos_sin(freqs_t))
    out = rope(x, pos, n_rot=n_rot, theta=1e7, sections=sections, interleaved=True)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-5)


def test_contiguous_mrope_matches_hf_qwen2_vl_split():
    sections, n_rot = (3, 3, 2), 16
    pos = rng.integers(0, 30, (4, 3)).astype(np.int32)
    freqs = _component_freqs(pos, n_rot, 10000.0)
    cos = np.stack(_hf_cos_sin(freqs)[0])  # [3, T, n_rot]
    sin = np.stack(_hf_cos_sin(freqs)[1])
    doubled = list(sections) * 2  # HF: cat([m[i % 3] for i, m in enumerate(cos.split(mrope_section * 2))])
    bounds = np.cumsum([0] + doubled)
    cos_t = np.concatenate([cos[i % 3, :, bounds[i]:bounds[i + 1]] for i in range(6)], axis=-1)
    sin_t = np.concatenate([sin[i % 3, :, bounds[i]:bounds[i + 1]] for i in range(6)], axis=-1)
    x = rng.standard_normal((4, 3, 20)).astype(F)
    out = rope(x, np.concatenate([pos, np.zeros((4, 1), np.int32)], axis=1),
               n_rot=n_rot, theta=10000.0, sections=sections + (0,))
    np.testing.assert_allclose(out, _hf_rotate(x, cos_t, sin_t), rtol=1e-5, atol=1e-5)


def test_text_positions_reduce_mrope_to_plain_rope():
    x = rng.standard_normal((6, 2, 256)).astype(F)
    p = np.arange(100, 106, dtype=np.int32)
    plain = rope(x, p, n_rot=64, theta=1e7)
    llama_style = np.stack([p, p, p, np.zeros_like(p)], axis=1)  # llama.cpp expands text to [p, p, p, 0]
    for pos in (p, llama_style):
        for interleaved in (True, False):
            out = rope(x, pos, n_rot=64, theta=1e7, sections=(11, 11, 10, 0), interleaved=interleaved)
            np.testing.assert_array_equal(out, plain)


def test_rope_rule_accepts():
    assert types("rope", "f32[T,16,256]", "i32[T]", n_rot=64, theta=1e7) == ["f32[T,16,256]"]
    assert types("rope", "f32[T,16,256]", "i32[T,4]", n_rot=64, theta=1e7,
                 sections=[11, 11, 10, 0], interleaved=True) == ["f32[T,16,256]"]


@pytest.mark.parametrize("x, pos, attrs, message", [
    ("f32[T,2,8]", "i32[S]", {}, r"x rows \(T\) != pos rows \(S\)"),
    ("f32[T,2,8]", "i32[T]", {"n_rot": 5}, "n_rot must be even"),
    ("f32[T,2,8]", "i32[T]", {"n_rot": 16}, r"n_rot=16 exceeds the head dim of f32\[T,2,8\]"),
    ("f32[T,2,8]", "i32[T,3]", {}, "has position components but no sections"),
    ("f32[T,2,8]", "i32[T]", {"interleaved": True}, "interleaved needs sections"),
    ("f32[T,2,8]", "i32[T,3]", {"sections": (2, 1, 2)}, r"must sum to n_rot/2 = 4"),
    ("f32[T,2,8]", "i32[T,3]", {"sections": (1, 1, 1, 1)}, r"sections must be \(t, h, w\)"),
    ("f32[T,2,8]", "i32[T,2]", {"sections": (2, 1, 1)}, "needs at least 3 components"),
    ("f32[T,16]", "i32[T]", {}, "x must have rank 3"),
    ("f32[T,2,8]", "f32[T]", {}, "pos must be i32"),
    ("f32[T,2,8]", "i32[T]", {"freq_factors": (1.0, 2.0)}, r"freq_factors must be n_rot/2 = 4 positive finite"),
    ("f32[T,2,8]", "i32[T]", {"freq_factors": (1.0, 2.0, -1.0, 1.0)}, "freq_factors must be"),
])
def test_rope_rule_rejects(x, pos, attrs, message):
    with pytest.raises(OpError, match=f"rope: .*{message}"):
        types("rope", x, pos, **{"n_rot": 8, "theta": 1e4, **attrs})


# a rotary pair's rotation written out: `lo * c - hi * s` in Python, kernel-layer or TVMScript text
ROTATION_WRITTEN_OUT = re.compile(r"\* *\{?(c|cos|cs)\}? *- *\{?\w+\}? *\* *\{?(s|sin|sn)\b")


def test_the_rotation_and_its_pairs_are_written_once():
    """The reference, the kernel layer (rope and the fused attention) and TVM's rope call
    `rotate` and `RotaryPairs`: only ops/position.py writes the rotation, and the pair maps
    agree with themselves on every dim (numpy operands here; kir and TIR in the kernel cases)."""
    hits = written_out(ROTATION_WRITTEN_OUT, "dflash_ir/ops/position.py")
    assert not hits, "\n".join(hits)
    for pairs in ("halves", "adjacent"):
        p = RotaryPairs(8, pairs)
        frequency, first = p.of(np.arange(8), np.where)
        dims = np.stack(p.dims(np.arange(4)), axis=1)
        assert sorted(dims.ravel()) == list(range(8))
        assert all(dims[frequency[e], 0 if first[e] else 1] == e for e in range(8))
    assert rotate(1.0, 0.0, 0.0, 1.0) == (0.0, 1.0)  # a quarter turn takes (1, 0) to (0, 1)

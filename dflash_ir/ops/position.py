"""Rotary position embedding: partial RoPE, plus multi-section (M-RoPE / Qwen3.5 IMROPE).

Which dims rotate together (`pairs`): "halves", NeoX's (i, i + n_rot/2), as HF and Qwen run
it; "adjacent", (2i, 2i + 1), llama.cpp's mode for `llama` files, whose converter permuted
the q and k rows so that adjacent pairs of the file are HF's rotate-half pairs (the file's
dim 2i + s holds HF's s * n_rot/2 + i). Frequency i drives pair i either way.

`freq_factors`: Llama 3's frequency scaling as llama.cpp's converter stores it (the
`rope_freqs.weight` tensor, one factor per frequency): inverse frequency i is divided by
factor i, in f32, before the angle is formed (the order llama.cpp and HF's llama3 rope take).

Precision: the angle is formed the way HF forms it, so our logits track HF's: inv_freq is
float32 (theta^(2i/n_rot) rounded to f32, then an f32 reciprocal) and angle = f32(pos) *
inv_freq is one f32 product. The f32 pow is rounded correctly (computed in f64), which is
deterministic across platforms and within an ulp or two of any libm/Sleef powf. cos and sin
are taken of the f32 angle in f64 and rounded, i.e. correctly rounded f32 results. An f64
angle would be more accurate but would differ from HF by up to half an ulp of the angle
(~5e-4 rad at position 10^4), the largest of these errors.
"""
from __future__ import annotations

import inspect
import math

import numpy as np

from ..dtypes import DType
from ..types import TensorType
from .rules import (bool_attr, check, choice_attr, defop, expect_dtype, expect_rank, expect_same, int_attr, ints_attr,
                    number_attr)

F32 = np.float32
_COMPONENTS = 3  # t, h, w


PAIRS = ("halves", "adjacent")


def _rope_rule(x: TensorType, pos: TensorType, *, n_rot, theta, sections, interleaved, pairs,
               freq_factors) -> TensorType:
    expect_dtype("x", x, DType.F32)
    expect_rank("x", x, 3)
    expect_dtype("pos", pos, DType.I32)
    expect_rank("pos", pos, 1, 2)
    expect_same("x rows", x.shape[0], "pos rows", pos.shape[0], (x, pos))
    int_attr("n_rot", n_rot, minimum=2)
    check(n_rot % 2 == 0, f"n_rot must be even, got {n_rot}")
    if isinstance(x.shape[2], int):
        check(n_rot <= x.shape[2], f"n_rot={n_rot} exceeds the head dim of {x}")
    check(number_attr("theta", theta) > 0, f"theta must be positive, got {theta}")
    sections = ints_attr("sections", sections)
    bool_attr("interleaved", interleaved)
    choice_attr("pairs", pairs, PAIRS)
    check(isinstance(freq_factors, tuple) and len(freq_factors) in (0, n_rot // 2)
          and all(isinstance(f, float) and math.isfinite(f) and f > 0 for f in freq_factors),
          f"freq_factors must be n_rot/2 = {n_rot // 2} positive finite floats, or none; got {freq_factors!r}")
    if sections:
        check(len(sections) in (3, 4) and not any(sections[_COMPONENTS:]),
              f"sections must be (t, h, w) or (t, h, w, 0), got {sections}")
        check(sum(sections) == n_rot // 2, f"sections {sections} must sum to n_rot/2 = {n_rot // 2}")
    else:
        check(pos.rank == 1, f"pos {pos} has position components but no sections are given")
        check(not interleaved, "interleaved needs sections")
    if pos.rank == 2 and isinstance(pos.shape[1], int):
        check(pos.shape[1] >= _COMPONENTS, f"pos {pos} needs at least {_COMPONENTS} components (t, h, w)")
    return x


def inv_freq_f32(n_rot: int, theta: float, freq_factors: tuple[float, ...] = ()) -> np.ndarray:
    """theta^(-2i/n_rot) for i < n_rot/2, rounded as HF's float32 computation rounds it, then
    divided by `freq_factors` (f32) where given."""
    exponent = np.arange(0, n_rot, 2, dtype=F32) / F32(n_rot)
    inv_freq = F32(1) / (np.float64(F32(theta)) ** exponent.astype(np.float64)).astype(F32)
    return inv_freq / np.asarray(freq_factors, F32) if freq_factors else inv_freq


def frequency_components(half: int, sections: tuple[int, ...], interleaved: bool) -> np.ndarray:
    """Which position component (0=t, 1=h, 2=w) drives each of the `half` frequencies.

    Interleaved (HF `apply_interleaved_mrope`): frequency j follows h if j%3==1 and
    j < 3*sections[1], w if j%3==2 and j < 3*sections[2], else t. Contiguous: the first
    sections[0] frequencies follow t, the next sections[1] h, the next sections[2] w."""
    if not sections:
        return np.zeros(half, dtype=np.int64)
    if not interleaved:
        return np.repeat(np.arange(_COMPONENTS), sections[:_COMPONENTS])
    j = np.arange(half)
    component = np.zeros(half, dtype=np.int64)
    for c in (1, 2):
        component[(j % 3 == c) & (j < 3 * sections[c])] = c
    return component


class RotaryPairs:
    """Which dims of a head rotate together (`pairs`), as index arithmetic on any operands
    (ints, numpy arrays, kernel-layer or TVMScript expressions), so the reference, the kernel
    layer and TVM read one definition: halves pairs (i, i + n_rot/2), adjacent (2i, 2i + 1)."""

    def __init__(self, n_rot: int, pairs: str):
        self.half = n_rot // 2
        self.adjacent = pairs == "adjacent"

    def dims(self, i):
        """The dims of frequency i's pair."""
        return (i * 2, i * 2 + 1) if self.adjacent else (i, i + self.half)

    def of(self, e, select):
        """(frequency, whether e is its pair's first dim) of dim e < n_rot; `select(c, a, b)`
        is the operands' choice."""
        if self.adjacent:
            return e >> 1, (e & 1) < 1
        return select(e < self.half, e, e - self.half), e < self.half


def rotate(lo, hi, c, s):
    """A pair (lo, hi) turned by the angle whose cosine and sine are c and s: the rotation of
    the reference, the kernel layer and TVM (operands with *, - and +)."""
    return lo * c - hi * s, hi * c + lo * s


@defop("rope", _rope_rule)
def rope(x, pos, *, n_rot, theta, sections=(), interleaved=False, pairs="halves", freq_factors=()):
    """Rotation of `pairs` over the first n_rot dims of each head, the rest passed through.
    pos i32[T] (same position for every component) or i32[T, S] (components t, h, w first)
    with `sections`."""
    half = n_rot // 2
    components = frequency_components(half, tuple(sections), interleaved)
    per_component = pos if pos.ndim == 2 else np.broadcast_to(pos[:, None], (len(pos), _COMPONENTS))
    positions = per_component[:, components]
    angle = positions.astype(F32) * inv_freq_f32(n_rot, theta, freq_factors)
    cos = np.cos(angle.astype(np.float64)).astype(F32)[:, None, :]
    sin = np.sin(angle.astype(np.float64)).astype(F32)[:, None, :]
    first, second = RotaryPairs(n_rot, pairs).dims(np.arange(half))
    y = x.copy()
    y[..., first], y[..., second] = rotate(x[..., first], x[..., second], cos, sin)
    return y


# rope's optional attributes and their defaults: what a fused op carries besides n_rot and theta
ROPE_DEFAULTS = {name: p.default for name, p in inspect.signature(rope).parameters.items()
                 if p.default is not inspect.Parameter.empty}

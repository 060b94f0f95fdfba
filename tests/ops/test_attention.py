import math
import re

import numpy as np
import pytest

from dflash_ir.activations import NUMPY
from dflash_ir.errors import ContextOverflowError
from dflash_ir.ops.attention import visible_range
from dflash_ir.ops.registry import OpError, get_op
from dflash_ir.types import parse_type
from written_once import written_out

F = np.float32
rng = np.random.default_rng(11)


def types(name, *inputs, **attrs):
    return [str(t) for t in get_op(name).output_types([parse_type(t) for t in inputs], attrs)]


def run(name, *arrays, **attrs):
    (out,) = get_op(name).run(arrays, attrs)
    return out


def attention_loops(q, k, v, kv_len, scale, causal, window):
    """Per (t, h): the visible keys listed by hand, scores, softmax in python floats."""
    T, Hq, _ = q.shape
    group = Hq // k.shape[1]
    out = np.zeros((T, Hq, v.shape[2]))
    for t in range(T):
        me = kv_len - T + t
        keys = [j for j in range(kv_len)
                if (not causal or j <= me) and (window == 0 or me - j < window)]
        for h in range(Hq):
            kv = h // group
            scores = [scale * sum(float(a) * float(b) for a, b in zip(q[t, h], k[j, kv])) for j in keys]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            for w, j in zip(weights, keys):
                out[t, h] += w / sum(weights) * v[j, kv].astype(np.float64)
    return out


CASES = [  # T, Hq, Hkv, capacity, kv_len, causal, window
    (1, 2, 2, 8, 5, True, 0),      # decode, no GQA, cache partly filled
    (4, 6, 2, 9, 9, True, 0),      # prefill, GQA 3
    (3, 4, 1, 12, 7, False, 0),    # draft block: non-causal, MQA
    (5, 4, 2, 10, 8, True, 3),     # sliding window
    (2, 2, 1, 6, 6, False, 2),     # non-causal window: only the past is limited
    (3, 3, 3, 3, 3, True, 0),      # full cache
]


@pytest.mark.parametrize("T, Hq, Hkv, capacity, kv_len, causal, window", CASES)
def test_attention_matches_explicit_loops(T, Hq, Hkv, capacity, kv_len, causal, window):
    D, Dv = 8, 5
    q = rng.standard_normal((T, Hq, D)).astype(F)
    k = rng.standard_normal((capacity, Hkv, D)).astype(F)
    v = rng.standard_normal((capacity, Hkv, Dv)).astype(F)
    k[kv_len:] = np.nan  # rows past kv_len are garbage and must not be read
    v[kv_len:] = np.nan
    out = run("attention", q, k, v, np.array(kv_len, np.int32), scale=D ** -0.5, causal=causal, window=window)
    assert out.dtype == F and out.shape == (T, Hq, Dv)
    expected = attention_loops(q, k, v, kv_len, D ** -0.5, causal, window)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_single_visible_key_returns_its_value():
    q = rng.standard_normal((1, 1, 4)).astype(F)
    k = rng.standard_normal((4, 1, 4)).astype(F)
    v = rng.standard_normal((4, 1, 3)).astype(F)
    out = run("attention", q, k, v, np.array(3, np.int32), scale=1.0, window=1)
    np.testing.assert_allclose(out[0, 0], v[2, 0], rtol=1e-6)


def test_large_scores_stay_finite():
    q = np.full((1, 1, 2), 100.0, F)
    k = np.array([[[100.0, 100.0]], [[-100.0, -100.0]]], F)
    v = np.array([[[1.0]], [[2.0]]], F)
    out = run("attention", q, k, v, np.array(2, np.int32), scale=1.0, causal=False)
    np.testing.assert_allclose(out, [[[1.0]]])


@pytest.mark.parametrize("kv_len, T, causal, message", [
    (9, 1, True, r"kv_len 9 is outside \(0, 8\]"),
    (0, 1, False, r"kv_len 0 is outside"),
    (2, 3, True, "3 queries cannot be the last rows of kv_len 2"),
])
def test_attention_bad_kv_len(kv_len, T, causal, message):
    q = np.zeros((T, 1, 2), F)
    kv = np.zeros((8, 1, 2), F)
    with pytest.raises(ValueError, match=f"attention: {message}"):
        run("attention", q, kv, kv, np.array(kv_len, np.int32), scale=1.0, causal=causal)


def test_attention_rule():
    assert types("attention", "f32[T,16,256]", "f32[C,4,256]", "f32[C,4,256]", "i32[]",
                 scale=0.0625) == ["f32[T,16,256]"]
    assert types("attention", "f32[B,32,128]", "f32[C,8,128]", "f32[C,8,64]", "i32[]",
                 scale=0.1, causal=False, window=2048) == ["f32[B,32,64]"]


@pytest.mark.parametrize("q, k, v, kv_len, message", [
    ("f32[T,6,8]", "f32[C,4,8]", "f32[C,4,8]", "i32[]", r"q heads \(6\) must be a multiple of kv heads \(4\)"),
    ("f32[T,4,8]", "f32[C,4,16]", "f32[C,4,8]", "i32[]", r"q head dim \(8\) != k head dim \(16\)"),
    ("f32[T,4,8]", "f32[C,4,8]", "f32[S,4,8]", "i32[]", r"k rows \(C\) != v rows \(S\)"),
    ("f32[T,4,8]", "f32[C,4,8]", "f32[C,2,8]", "i32[]", r"k heads \(4\) != v heads \(2\)"),
    ("f32[T,4,8]", "f32[C,4,8]", "f32[C,4,8]", "i32[1]", "kv_len must have rank 0"),
    ("f32[T,4,8]", "f16[C,4,8]", "f32[C,4,8]", "i32[]", "k must be f32"),
])
def test_attention_rule_rejects(q, k, v, kv_len, message):
    with pytest.raises(OpError, match=f"attention: {message}"):
        types("attention", q, k, v, kv_len, scale=1.0)


def test_attention_rule_rejects_bad_window():
    with pytest.raises(OpError, match="attention: window must be >= 0"):
        types("attention", "f32[T,4,8]", "f32[C,4,8]", "f32[C,4,8]", "i32[]", scale=1.0, window=-1)


def test_visible_range_by_hand():
    # 10 cached rows, the query at position 7: causal it sees 0..7, with a window of 3 5..7
    assert visible_range(NUMPY, 10, 7, True, 3) == (5, 8)
    assert visible_range(NUMPY, 10, 7, True, 0) == (0, 8)
    assert visible_range(NUMPY, 10, 7, False, 0) == (0, 10)
    assert visible_range(NUMPY, 10, 7, False, 3) == (5, 10)
    assert visible_range(NUMPY, 10, 1, True, 3) == (0, 2)


# a causal or window bound written out (the spellings the kernel layer, TVM's text and loop
# nest and the reference had): a query's own position + 1, or window - 1 back
MASK_WRITTEN_OUT = re.compile(r"window - 1|- \{window\} \+ 1|qpos \+ 1|\+ row\b.*\+ 1\)|j <= |j > .*window"
                              r"|query_pos - key_pos")


def test_every_attention_masks_by_the_visible_range():
    """The reference, the kernel layer's attention (GPU and CPU) and TVM's (the blocks and
    the llvm loop nest) take a query's keys from visible_range; each copy it replaced
    matched the pattern."""
    hits = written_out(MASK_WRITTEN_OUT, "dflash_ir/ops/attention.py")
    assert not hits, "\n".join(hits)


def test_kv_write_writes_rows_into_a_copy():
    cache = np.zeros((6, 2, 3), F)
    new = rng.standard_normal((2, 2, 3)).astype(F)
    out = run("kv_write", cache, new, np.array(3, np.int32))
    np.testing.assert_array_equal(out[3:5], new)
    assert not out[:3].any() and not out[5:].any()
    assert not cache.any()
    np.testing.assert_array_equal(run("kv_write", cache, new, np.array(4, np.int32))[4:], new)  # up to the end


def test_kv_write_overflow_message():
    with pytest.raises(ContextOverflowError,
                       match="context overflow: writing 3 rows at position 5 needs rows up to 8 but the cache holds 6"):
        run("kv_write", np.zeros((6, 1, 1), F), np.zeros((3, 1, 1), F), np.array(5, np.int32))


def test_kv_write_rule():
    assert types("kv_write", "f32[C,4,256]", "f32[T,4,256]", "i32[]") == ["f32[C,4,256]"]
    with pytest.raises(OpError, match=r"kv_write: new dim 2 \(128\) != cache dim 2 \(256\)"):
        types("kv_write", "f32[C,4,256]", "f32[T,4,128]", "i32[]")
    with pytest.raises(OpError, match="kv_write: new rows f16.* do not match the cache"):
        types("kv_write", "f32[C,4,256]", "f16[T,4,256]", "i32[]")
    with pytest.raises(OpError, match="kv_write: pos must have rank 0"):
        types("kv_write", "f32[C,4,256]", "f32[T,4,256]", "i32[T]")

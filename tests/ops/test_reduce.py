import functools
import math
import re

import numpy as np
import pytest

from dflash_ir.activations import NUMPY
from dflash_ir.ops.reduce import precedes
from dflash_ir.ops.registry import OpError, get_op
from dflash_ir.types import parse_type
from written_once import written_out

F = np.float32


def types(name, *inputs, **attrs):
    return [str(t) for t in get_op(name).output_types([parse_type(t) for t in inputs], attrs)]


def run(name, *arrays, **attrs):
    out = get_op(name).run(arrays, attrs)
    return out[0] if len(out) == 1 else out


def test_rmsnorm_by_hand():
    x = np.array([[3.0, 4.0], [1.0, -1.0]], F)
    out = run("rmsnorm", x, eps=0.0)
    np.testing.assert_allclose(out, [[3 / math.sqrt(12.5), 4 / math.sqrt(12.5)], [1, -1]], rtol=1e-6)
    eps_only = run("rmsnorm", np.zeros((1, 2), F) + F(1), eps=3.0)
    np.testing.assert_allclose(eps_only, [[0.5, 0.5]], rtol=1e-6)


def test_rmsnorm_weight_in_any_float_dtype():
    x = np.array([[3.0, 4.0]], F)
    bf16_two_and_half = np.array([0x4000, 0x3F00], np.uint16)  # bf16 bits of 2.0 and 0.5
    expected = [[2 * 3 / math.sqrt(12.5), 0.5 * 4 / math.sqrt(12.5)]]
    np.testing.assert_allclose(run("rmsnorm", x, bf16_two_and_half, eps=0.0), expected, rtol=1e-6)
    np.testing.assert_allclose(run("rmsnorm", x, np.array([2, 0.5], np.float16), eps=0.0), expected, rtol=1e-6)


def test_rmsnorm_rule():
    assert types("rmsnorm", "f32[T,8]", "f32[8]", eps=1e-6) == ["f32[T,8]"]
    assert types("rmsnorm", "f32[T,H,256]", "bf16[256]", eps=1e-6) == ["f32[T,H,256]"]
    assert types("rmsnorm", "f32[T,8]", eps=1e-6) == ["f32[T,8]"]
    with pytest.raises(OpError, match=r"rmsnorm: w size \(4\) != x last dim \(8\)"):
        types("rmsnorm", "f32[T,8]", "f32[4]", eps=1e-6)
    with pytest.raises(OpError, match="rmsnorm: missing a required argument: 'eps'"):
        types("rmsnorm", "f32[T,8]")
    with pytest.raises(OpError, match="rmsnorm: w must have rank 1"):
        types("rmsnorm", "f32[T,8]", "f32[1,8]", eps=1e-6)


def test_l2norm():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], F)
    np.testing.assert_allclose(run("l2norm", x[:1], eps=0.0), [[0.6, 0.8]], rtol=1e-6)
    out = run("l2norm", x)  # default eps 1e-6 keeps the zero row finite
    np.testing.assert_allclose(out, [[3 / math.sqrt(25 + 1e-6), 4 / math.sqrt(25 + 1e-6)], [0, 0]], rtol=1e-6)
    assert types("l2norm", "f32[T,16,128]") == ["f32[T,16,128]"]


def _softmax(values):
    top = max(values)
    e = [math.exp(v - top) for v in values]
    return [v / sum(e) for v in e]


def test_softmax_both_axes_and_large_values():
    x = np.array([[1.0, 2.0, 3.0], [1000.0, 1000.0, -1000.0]], F)
    np.testing.assert_allclose(run("softmax", x), [_softmax(r) for r in x.tolist()], rtol=1e-6)
    columns = np.array([_softmax(c) for c in x.T.tolist()]).T
    np.testing.assert_allclose(run("softmax", x, axis=0), columns, rtol=1e-6, atol=1e-30)
    with pytest.raises(OpError, match="softmax: axis 2 is out of range for rank 2"):
        types("softmax", "f32[T,4]", axis=2)


def test_topk_descending_ties_to_lower_index():
    x = np.array([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 5.0, 0.0]], F)
    values, indices = run("topk", x, k=3)
    assert indices.dtype == np.int32 and values.dtype == F
    assert indices.tolist() == [[1, 2, 3], [2, 0, 3]]
    assert values.tolist() == [[3, 3, 2], [5, 0, 0]]


def test_precedes_is_numpys_stable_descending_order():
    assert precedes(NUMPY, 3.0, 5, 2.0, 1) and not precedes(NUMPY, 2.0, 1, 3.0, 5)
    assert precedes(NUMPY, 2.0, 1, 2.0, 4) and not precedes(NUMPY, 2.0, 4, 2.0, 1)
    assert not precedes(NUMPY, 2.0, 1, 2.0, 1)
    x = np.random.default_rng(3).integers(0, 5, 40).astype(F)  # many ties
    order = sorted(range(len(x)), key=functools.cmp_to_key(
        lambda i, j: -1 if precedes(NUMPY, x[i], i, x[j], j) else 1 if precedes(NUMPY, x[j], j, x[i], i) else 0))
    assert order == np.argsort(-x, kind="stable").tolist()
    assert order[0] == np.argmax(x)


# the tie-break written out (the kernel layer's and TensorIR's spellings): values equal and
# then the indices compared
ORDER_WRITTEN_OUT = re.compile(r"\.eq\([^)]*\)\)? *& *\(|== *st\[0\]")


def test_every_selection_orders_by_precedes():
    """argmax (the work-group tree and the CPU lanes), topk's passes, the MoE routing's
    passes and tree, and TVM's top-k compare by precedes; each copy it replaced matched the
    pattern."""
    hits = written_out(ORDER_WRITTEN_OUT, "dflash_ir/ops/reduce.py")
    assert not hits, "\n".join(hits)


def test_topk_rule():
    assert types("topk", "f32[T,256]", k=8) == ["f32[T,8]", "i32[T,8]"]
    assert types("topk", "f32[T,E]", k=8) == ["f32[T,8]", "i32[T,8]"]
    with pytest.raises(OpError, match=r"topk: k=9 exceeds the last dim of f32\[T,8\]"):
        types("topk", "f32[T,8]", k=9)
    with pytest.raises(OpError, match="topk: k must be >= 1"):
        types("topk", "f32[T,8]", k=0)


def test_argmax_first_maximum():
    x = np.array([[1.0, 5.0, 5.0], [-2.0, -3.0, -2.0]], F)
    out = run("argmax", x)
    assert out.dtype == np.int32 and out.tolist() == [1, 0]
    single = run("argmax", np.array([0.0, 2.0, 1.0], F))
    assert isinstance(single, np.ndarray) and single.shape == () and single == 1
    assert types("argmax", "f32[T,V]") == ["i32[T]"]
    assert types("argmax", "f32[V]") == ["i32[]"]


def test_sum():
    x = np.arange(6, dtype=F).reshape(2, 3)
    assert run("sum", x, axis=1).tolist() == [3, 12]
    assert run("sum", x, axis=0, keepdims=True).tolist() == [[3, 5, 7]]
    as_int = run("sum", np.array([[1, 2], [3, 4]], np.int32), axis=-1)
    assert as_int.dtype == np.int32 and as_int.tolist() == [3, 7]
    assert types("sum", "f32[T,k,H]", axis=1) == ["f32[T,H]"]
    assert types("sum", "f32[T,k,H]", axis=-1, keepdims=True) == ["f32[T,k,1]"]
    with pytest.raises(OpError, match="sum: keepdims must be a bool"):
        types("sum", "f32[T,4]", axis=0, keepdims=1)

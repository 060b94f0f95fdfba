import math

import numpy as np
import pytest

from dflash_ir.ops.registry import OpError, get_op
from dflash_ir.types import parse_type


def types(name, *inputs, **attrs):
    return [str(t) for t in get_op(name).output_types([parse_type(t) for t in inputs], attrs)]


def run(name, *arrays, **attrs):
    (out,) = get_op(name).run(arrays, attrs)
    return out


F = np.float32


@pytest.mark.parametrize("name, expected", [
    ("add", [[11, 22, 33], [14, 25, 36]]),
    ("sub", [[-9, -18, -27], [-6, -15, -24]]),
    ("mul", [[10, 40, 90], [40, 100, 180]]),
    ("div", [[0.1, 0.1, 0.1], [0.4, 0.25, 0.2]]),
])
def test_binary_broadcasts_a_row(name, expected):
    a = np.array([[1, 2, 3], [4, 5, 6]], F)
    b = np.array([10, 20, 30], F)
    out = run(name, a, b)
    assert out.dtype == F and out.shape == (2, 3)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_integer_add_stays_integer_and_scalars_stay_arrays():
    out = run("add", np.array([1, 2], np.int32), np.array(5, np.int32))
    assert out.dtype == np.int32 and out.tolist() == [6, 7]
    scalar = run("mul", np.array(2, F), np.array(3, F))
    assert isinstance(scalar, np.ndarray) and scalar.shape == () and scalar == 6


def test_broadcast_rule_with_symbols():
    assert types("add", "f32[T,1,4]", "f32[3,1]") == ["f32[T,3,4]"]
    assert types("mul", "f32[T,4]", "f32[4]") == ["f32[T,4]"]
    assert types("sub", "f32[T,4]", "f32[1,1]") == ["f32[T,4]"]
    assert types("add", "f32[T,4]", "f32[5,4]") == ["f32[5,4]"]  # T must be 5
    assert types("add", "i32[]", "i32[]") == ["i32[]"]


@pytest.mark.parametrize("a, b, message", [
    ("f32[T,4]", "f32[S,4]", "do not broadcast"),
    ("f32[3,4]", "f32[2,4]", "do not broadcast"),
    ("f32[T,4]", "i32[T,4]", "dtypes differ"),
])
def test_binary_rule_rejects(a, b, message):
    with pytest.raises(OpError, match=f"add: .*{message}"):
        types("add", a, b)


def test_integer_division_is_rejected():
    with pytest.raises(OpError, match="div: a must be f32, got i32"):
        types("div", "i32[4]", "i32[4]")


def test_wrong_input_count_is_an_op_error():
    with pytest.raises(OpError, match="add: "):
        types("add", "f32[4]")


X = np.array([-100.0, -3.5, -1.0, 0.0, 0.5, 2.0, 100.0], F)


def _sigmoid(v):
    return 1 / (1 + math.exp(-v)) if v >= 0 else math.exp(v) / (1 + math.exp(v))


@pytest.mark.parametrize("name, scalar_fn", [
    ("neg", lambda v: -v),
    ("exp", lambda v: math.exp(v) if v < 80 else math.inf),
    ("sigmoid", _sigmoid),
    ("silu", lambda v: v * _sigmoid(v)),
    ("softplus", lambda v: v + math.log1p(math.exp(-v)) if v > 0 else math.log1p(math.exp(v))),
])
def test_unary_matches_scalar_math(name, scalar_fn):
    x = X if name != "exp" else X[1:-1]
    with np.errstate(over="raise", invalid="raise"):
        out = run(name, x)
    assert out.dtype == F and out.shape == x.shape
    np.testing.assert_allclose(out, [scalar_fn(float(v)) for v in x], rtol=2e-6, atol=1e-30)


def test_unary_rule():
    assert types("silu", "f32[T,8]") == ["f32[T,8]"]
    with pytest.raises(OpError, match="sigmoid: x must be f32"):
        types("sigmoid", "i32[3]")


def test_scale():
    np.testing.assert_array_equal(run("scale", np.array([2.0, -4.0], F), factor=0.0625), [0.125, -0.25])
    with pytest.raises(OpError, match="scale: factor must be a number"):
        types("scale", "f32[2]", factor="2")
    with pytest.raises(OpError, match="scale: missing a required argument: 'factor'"):
        types("scale", "f32[2]")


def test_cast_values():
    x = np.array([-1.7, 2.9, 0.5], F)
    as_int = run("cast", x, dtype="i32")
    assert as_int.dtype == np.int32 and as_int.tolist() == [-1, 2, 0]
    half = run("cast", x, dtype="f16")
    assert half.dtype == np.float16
    back = run("cast", half, dtype="f32")
    assert back.dtype == F and np.allclose(back, x, rtol=1e-3)
    assert run("cast", np.array([3, -2], np.int32), dtype="f32").tolist() == [3.0, -2.0]


def test_cast_rule():
    assert types("cast", "f32[T,3]", dtype="f16") == ["f16[T,3]"]
    with pytest.raises(OpError, match="cast: casts go to or from f32, not f16 -> i32"):
        types("cast", "f16[3]", dtype="i32")
    with pytest.raises(OpError, match="cast: dtype must be one of"):
        types("cast", "f32[3]", dtype="q8_0")
    with pytest.raises(OpError, match="cast: unexpected keyword|cast: got an unexpected"):
        types("cast", "f32[3]", dtype="f16", rounding="nearest")

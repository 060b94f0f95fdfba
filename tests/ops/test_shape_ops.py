import numpy as np
import pytest

from dflash_ir.ops.registry import OpError, get_op
from dflash_ir.types import parse_type


def types(name, *inputs, **attrs):
    return [str(t) for t in get_op(name).output_types([parse_type(t) for t in inputs], attrs)]


def run(name, *arrays, **attrs):
    (out,) = get_op(name).run(arrays, attrs)
    return out


A = np.arange(12, dtype=np.float32).reshape(3, 4)


def test_concat():
    out = run("concat", A, A[:1], axis=0)
    assert out.shape == (4, 4) and out[3].tolist() == [0, 1, 2, 3]
    assert run("concat", A[:, :1], A[:, 3:], axis=-1).tolist() == [[0, 3], [4, 7], [8, 11]]
    assert types("concat", "f32[T,4096]", "f32[T,4096]", "f32[T,4096]", axis=1) == ["f32[T,12288]"]
    assert types("concat", "f32[T,8]", "f32[5,8]", axis=1) == ["f32[5,16]"]


@pytest.mark.parametrize("inputs, axis, message", [
    (("f32[T,4]", "f32[16,4]"), 0, r"axis 0 sizes \['T', 16\] include symbols"),
    (("f32[2,4]", "f32[3,5]"), 0, r"dim 1 \(5\) != dim 1 \(4\)"),
    (("f32[T,4]", "i32[T,4]"), 1, "inputs must share dtype and rank"),
    (("f32[T,4]",), 3, "axis 3 is out of range for rank 2"),
])
def test_concat_rule_rejects(inputs, axis, message):
    with pytest.raises(OpError, match=f"concat: .*{message}"):
        types("concat", *inputs, axis=axis)


def test_concat_needs_an_input():
    with pytest.raises(OpError, match="concat: needs at least one input"):
        types("concat", axis=0)


def test_slice():
    assert run("slice", A, axis=1, start=1, stop=3).tolist() == [[1, 2], [5, 6], [9, 10]]
    assert run("slice", A, axis=0, start=1).tolist() == A[1:].tolist()
    assert run("slice", A, axis=0, start=3).shape == (0, 4)
    assert types("slice", "f32[16,V]", axis=0, start=1) == ["f32[15,V]"]
    assert types("slice", "f32[T,V]", axis=0, start=0) == ["f32[T,V]"]
    assert types("slice", "f32[T,8192]", axis=1, start=2048, stop=4096) == ["f32[T,2048]"]
    assert types("slice", "f32[C,4]", axis=0, start=0, stop=5) == ["f32[5,4]"]


@pytest.mark.parametrize("attrs, message", [
    ({"axis": 0, "start": 1}, "slicing symbolic axis 0 of f32\\[T,8\\] from 1 to its end has no nameable size"),
    ({"axis": 1, "start": 2, "stop": 9}, "stop 9 is past the end of axis 1"),
    ({"axis": 1, "start": 4, "stop": 2}, "stop must be >= 4"),
    ({"axis": 1, "start": -1}, "start must be >= 0"),
])
def test_slice_rule_rejects(attrs, message):
    with pytest.raises(OpError, match=f"slice: {message}"):
        types("slice", "f32[T,8]", **attrs)


def test_slice_past_a_symbolic_end_fails_at_run_time():
    with pytest.raises(ValueError, match=r"slice: stop 5 is past the end of axis 0 \(size 3\)"):
        run("slice", A, axis=0, start=0, stop=5)


def test_reshape_values_and_symbolic_prefix():
    x = np.arange(2 * 256, dtype=np.float32).reshape(2, 256)
    out = run("reshape", x, shape=("T", 4, 64))
    assert out.shape == (2, 4, 64) and out[1, 3, 63] == x[1, 255]
    assert run("reshape", out, shape=["T", -1]).shape == (2, 256)
    assert run("reshape", A, shape=(-1, 2)).shape == (6, 2)


@pytest.mark.parametrize("source, shape, expected", [
    ("f32[T,256]", ("T", 4, 64), "f32[T,4,64]"),
    ("f32[T,4,64]", ("T", -1), "f32[T,256]"),
    ("f32[T,S,8]", ("T", "S", 2, 4), "f32[T,S,2,4]"),
    ("f32[8,6]", (-1, 4), "f32[12,4]"),
    ("f32[6]", (1, 2, 3), "f32[1,2,3]"),
    ("f32[T,1]", ("T",), "f32[T]"),
])
def test_reshape_rule(source, shape, expected):
    assert types("reshape", source, shape=shape) == [expected]


@pytest.mark.parametrize("source, shape, message", [
    ("f32[T,256]", (4, "T", 64), "symbols must lead the target shape"),
    ("f32[T,256]", ("S", 256), "must start with x's leading dims \\[T\\]"),
    ("f32[T,256]", (-1, 256), "symbols of f32\\[T,256\\] beyond the target's leading \\[\\] are not carried through"),
    ("f32[T,256]", ("T", 3, 64), "element counts differ"),
    ("f32[T,256]", ("T", -1, -1), "at most one -1"),
    ("f32[T,256]", ("T", -1, 3), "cannot reshape"),
    ("f32[T,256]", ("T", -2), "shape entry must be >= -1"),
])
def test_reshape_rule_rejects(source, shape, message):
    with pytest.raises(OpError, match=f"reshape: .*{message}"):
        types("reshape", source, shape=shape)


def test_transpose():
    x = np.arange(24).reshape(2, 3, 4).astype(np.float32)
    out = run("transpose", x, perm=(1, 0, 2))
    assert out.shape == (3, 2, 4) and out[2, 1, 3] == x[1, 2, 3]
    assert types("transpose", "f32[T,H,D]", perm=[1, 0, 2]) == ["f32[H,T,D]"]
    with pytest.raises(OpError, match="transpose: perm \\(0, 0, 1\\) is not a permutation of the 3 axes"):
        types("transpose", "f32[T,H,D]", perm=(0, 0, 1))


def test_gather():
    idx = np.array([[2, 0], [1, 1]], np.int32)
    out = run("gather", A, idx, axis=0)
    assert out.shape == (2, 2, 4) and out[0, 0].tolist() == A[2].tolist()
    assert run("gather", A, np.array([3, 0], np.int32), axis=1).tolist() == [[3, 0], [7, 4], [11, 8]]
    assert types("gather", "f32[B,V]", "i32[K]", axis=0) == ["f32[K,V]"]
    assert types("gather", "f32[T,E]", "i32[T,k]", axis=1) == ["f32[T,T,k]"]
    with pytest.raises(ValueError, match=r"gather: index -1 is out of range \[0, 3\)"):
        run("gather", A, np.array([-1], np.int32), axis=0)
    with pytest.raises(OpError, match="gather: idx must be i32"):
        types("gather", "f32[3,4]", "f32[2]", axis=0)


def test_repeat_tile_and_interleave():
    x = np.array([[1.0, 2.0]], np.float32)
    assert run("repeat", x, axis=1, repeats=3).tolist() == [[1, 2, 1, 2, 1, 2]]
    assert run("repeat", x, axis=1, repeats=2, mode="interleave").tolist() == [[1, 1, 2, 2]]
    assert types("repeat", "f32[T,16,128]", axis=1, repeats=2, mode="interleave") == ["f32[T,32,128]"]
    assert types("repeat", "f32[T,16]", axis=0, repeats=1) == ["f32[T,16]"]
    with pytest.raises(OpError, match="repeat: repeating symbolic axis 0 of f32\\[T,16\\] has no nameable size"):
        types("repeat", "f32[T,16]", axis=0, repeats=2)
    with pytest.raises(OpError, match="repeat: mode must be one of 'tile', 'interleave'"):
        types("repeat", "f32[T,16]", axis=1, repeats=2, mode="stack")


@pytest.mark.parametrize("name, attrs", [
    ("slice", {"axis": 0, "start": 0, "stop": 1}),
    ("reshape", {"shape": (2, 2, 32)}),
    ("transpose", {"perm": (1, 0)}),
    ("repeat", {"axis": 0, "repeats": 2}),
])
def test_block_quantised_values_are_not_moved(name, attrs):
    with pytest.raises(OpError, match=f"{name}: x must be .* got q8_0"):
        types(name, "q8_0[4,32]", **attrs)

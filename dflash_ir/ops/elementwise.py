"""Elementwise ops: broadcasting binary arithmetic, f32 activations, scale and cast."""
from __future__ import annotations

import numpy as np

from .. import activations
from ..activations import NUMPY
from ..dtypes import DType
from ..types import TensorType
from .rules import broadcast_shapes, check, choice_attr, defop, expect_dtype, number_attr

F32 = np.float32


def _binary(name: str, symbol: str, dtypes: tuple[DType, ...]) -> None:
    def rule(a: TensorType, b: TensorType) -> TensorType:
        expect_dtype("a", a, *dtypes)
        check(a.dtype == b.dtype, f"operand dtypes differ: {a} vs {b}")
        return TensorType(a.dtype, broadcast_shapes(a.shape, b.shape))

    def reference(a, b):
        return np.asarray(activations.BINARY[name](NUMPY, np.asarray(a), np.asarray(b)))

    reference.__doc__ = f"a {symbol} b with numpy broadcasting; both operands have the same dtype."
    defop(name, rule)(reference)


# integer add/sub/mul serve index arithmetic (positions, offsets); division is f32 only
_binary("add", "+", (DType.F32, DType.I32))
_binary("sub", "-", (DType.F32, DType.I32))
_binary("mul", "*", (DType.F32, DType.I32))
_binary("div", "/", (DType.F32,))


def _unary(name: str, doc: str) -> None:
    def rule(x: TensorType) -> TensorType:
        expect_dtype("x", x, DType.F32)
        return x

    def reference(x):
        return np.asarray(activations.UNARY[name](NUMPY, np.asarray(x)), dtype=F32)

    reference.__doc__ = doc
    defop(name, rule)(reference)


_unary("neg", "-x.")
_unary("exp", "e^x.")
_unary("sigmoid", "1/(1+e^-x), overflow-free.")
_unary("silu", "x*sigmoid(x).")
_unary("softplus", "log(1+e^x), stable for large |x|.")


def _scale_rule(x: TensorType, *, factor) -> TensorType:
    expect_dtype("x", x, DType.F32)
    number_attr("factor", factor)
    return x


@defop("scale", _scale_rule)
def scale(x, *, factor):
    """x * factor, the factor rounded to f32 first (as a kernel's f32 constant would be)."""
    return np.asarray(x * F32(factor), dtype=F32)


_CASTABLE = (DType.F32, DType.F16, DType.I32)


def _cast_rule(x: TensorType, *, dtype) -> TensorType:
    target = DType.parse(choice_attr("dtype", dtype, [d.value for d in _CASTABLE]))
    expect_dtype("x", x, *_CASTABLE)
    check(DType.F32 in (x.dtype, target), f"casts go to or from f32, not {x.dtype} -> {target}")
    return TensorType(target, x.shape)


@defop("cast", _cast_rule)
def cast(x, *, dtype):
    """Convert between f32 and f16/i32; f32 -> i32 truncates toward zero (a C cast)."""
    return np.asarray(x).astype(DType.parse(dtype).numpy())
